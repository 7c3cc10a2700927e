"""A plain-torch DSpark head for DeepSeek-V4, written from the published description (DeepSeek's
DeepSpec `modeling/dspark`: context features, the block mask, the Markov and confidence heads;
the V4 head's layout as vLLM's and SGLang's loaders read it) and independent of the engine's
code: the V4 decoder pieces are HF transformers' (the repository's reference for V4 math), the
DSpark parts are written here. It is the yardstick of the engine's head (tests/models/
test_dspark.py) and, differentiable and batched, what scripts/demo_dspark.py trains the demo
model's head as.

For a sequence with target hidden states at positions 0..T-1 and a block anchored at p (the
token at p is the block's first row, noise tokens after it, at positions p .. p + gamma - 1):

    tap_l(t)   = mean over the hc streams of the target's layer-l output at t
    main_x(t)  = main_norm(main_proj([tap_l1(t) | tap_l2(t) | ...]))
    each draft layer (a V4 decoder layer, sliding window W): the block rows' queries attend to
               keys RoPE(kv_norm(kv_proj(main_x(t)))) of the context positions p - W <= t < p
               and to the block rows' own keys, all of them (bidirectional)
    h_k        = hc_head(streams of block row k); base logits U_k = lm_head(norm(h_k)), the token
               at p + k + 1
    Markov     e_k = W1[x_{k-1}] (x_{-1} = the anchor), logits U_k + W2 e_k
    confidence sigmoid(w . [h_k ; e_k])
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf


def draft_layer_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """A one-layer config whose layer is a DSpark draft layer: sliding window, score-routed."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["sliding_attention"]
    cfg.mlp_layer_types = ["moe"]
    return cfg


class DSparkReference(torch.nn.Module):
    def __init__(
        self,
        config: DeepseekV4Config,
        num_layers: int,
        taps: list[int],
        rank: int,
        noise_token_id: int,
        confidence: bool = True,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.taps, self.noise, self.window = list(taps), noise_token_id, config.sliding_window
        layer_cfg = draft_layer_config(config)
        self.layer_config = layer_cfg
        self.layers = torch.nn.ModuleList(
            hf.DeepseekV4DecoderLayer(layer_cfg, 0) for _ in range(num_layers)
        )
        self.rotary = hf.DeepseekV4RotaryEmbedding(layer_cfg)
        self.main_proj = torch.nn.Linear(hidden * len(taps), hidden, bias=False)
        self.main_norm = hf.DeepseekV4RMSNorm(hidden, eps)
        self.norm = hf.DeepseekV4RMSNorm(hidden, eps)
        self.hc_head = hf.DeepseekV4HyperHead(config)
        self.markov_w1 = torch.nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = torch.nn.Linear(rank, config.vocab_size, bias=False)
        self.confidence = torch.nn.Linear(hidden + rank, 1, bias=False) if confidence else None

    # ---------------------------------------------------------------- the target's side

    def target_taps(self, target: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the tapped hidden states [B, T, len(taps) * hidden] (a causal forward of
        the target; its layers' outputs caught by hooks)."""
        caught: dict[int, torch.Tensor] = {}
        hooks = [
            target.model.layers[i].register_forward_hook(
                lambda _m, _a, out, i=i: caught.__setitem__(i, out.mean(dim=2))
            )
            for i in self.taps
        ]
        try:
            target(ids)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([caught[i] for i in self.taps], dim=-1)

    # ---------------------------------------------------------------- the head

    def forward(
        self, target: DeepseekV4ForCausalLM, taps: torch.Tensor, ids: torch.Tensor,
        anchors: torch.Tensor, gamma: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """taps [B, T, L*H] of positions 0..T-1, ids [B, T] their tokens, anchors [B, A]
        positions (< T) -> (h [B, A, gamma, H] the head's hidden states, base logits
        [B, A, gamma, V])."""
        b, a = anchors.shape
        main_x = self.main_norm(self.main_proj(taps))  # [B, T, H]
        block = torch.full((b, a, gamma), self.noise, dtype=torch.long, device=ids.device)
        block[:, :, 0] = ids.gather(1, anchors)
        positions = (anchors[..., None] + torch.arange(gamma, device=ids.device)).view(b, -1)
        x = target.model.embed_tokens(block.view(b, -1))  # [B, A*gamma, H]
        streams = x.unsqueeze(2).expand(-1, -1, self.layer_config.hc_mult, -1).contiguous()
        mask = self._mask(anchors, taps.shape[1], gamma)  # [B, 1, A*gamma, T + A*gamma]
        for layer in self.layers:
            streams = self._layer(layer, streams, main_x, positions, mask, block.view(b, -1))
        h = self.hc_head(streams).view(b, a, gamma, -1)
        return h, target.lm_head(self.norm(h)).float()

    def _mask(self, anchors: torch.Tensor, t: int, gamma: int) -> torch.Tensor:
        """Additive mask: block row (anchor p) sees context p - W <= t < p and its own block."""
        b, a = anchors.shape
        p = anchors.repeat_interleave(gamma, dim=1)[..., None]  # [B, A*gamma, 1]
        ctx = torch.arange(t, device=anchors.device)
        sees_ctx = (ctx < p) & (ctx >= p - self.window)  # [B, A*gamma, T]
        rows = torch.arange(a * gamma, device=anchors.device) // gamma
        sees_block = (rows[:, None] == rows[None, :]).expand(b, -1, -1)
        visible = torch.cat([sees_ctx, sees_block], dim=-1)
        return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None]

    def _layer(self, layer, streams, main_x, positions, mask, ids) -> torch.Tensor:
        """One draft layer (HF's DeepseekV4DecoderLayer.forward, its attention replaced)."""
        dtype = streams.dtype
        post, comb, collapsed = layer.attn_hc(streams)
        out = self._attention(layer.self_attn, layer.input_layernorm(collapsed), main_x,
                              positions, mask)  # fmt: skip
        streams = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, collapsed = layer.ffn_hc(streams)
        out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )

    def _attention(self, attn, x, main_x, positions, mask) -> torch.Tensor:
        """x [B, R, H] block rows at `positions` [B, R]; context keys from main_x [B, T, H] at
        positions 0..T-1 (the mask says which each row sees)."""
        b, r, _ = x.shape
        t = main_x.shape[1]
        cos_q, sin_q = self.rotary(x, positions, layer_type="main")
        ctx_pos = torch.arange(t, device=x.device)[None].expand(b, -1)
        cos_c, sin_c = self.rotary(x, ctx_pos, layer_type="main")
        q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(b, r, -1, attn.head_dim)
        q = hf.apply_rotary_pos_emb(attn.q_b_norm(q.transpose(1, 2)), cos_q, sin_q)
        k_block = attn.kv_norm(attn.kv_proj(x))[:, None]  # [B, 1, R, D]
        k_ctx = attn.kv_norm(attn.kv_proj(main_x))[:, None]  # [B, 1, T, D]
        kv = torch.cat(
            [
                hf.apply_rotary_pos_emb(k_ctx, cos_c, sin_c),
                hf.apply_rotary_pos_emb(k_block, cos_q, sin_q),
            ],
            dim=2,
        )
        out, _ = hf.eager_attention_forward(attn, q, kv, kv, mask.to(q.dtype), attn.scaling)
        # [B, R, heads, D]: V's RoPE undone at the query's position
        out = hf.apply_rotary_pos_emb(out.transpose(1, 2), cos_q, -sin_q).transpose(1, 2)
        grouped = attn.o_a_proj(out.reshape(b, r, attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)

    def markov(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """base [..., V] + W2 W1[prev] (prev [...] the token before each row)."""
        return base + self.markov_w2(self.markov_w1(prev)).float()

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        assert self.confidence is not None
        return self.confidence(torch.cat([h, self.markov_w1(prev)], -1).float()).squeeze(-1)

    @torch.no_grad()
    def draft(
        self, h: torch.Tensor, base: torch.Tensor, anchor_tokens: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Serial Markov pass over one block per row: h [N, gamma, H], base [N, gamma, V],
        anchor_tokens [N] -> (greedy drafts [N, gamma], confidences [N, gamma] or None)."""
        prev, drafts, confs = anchor_tokens, [], []
        for k in range(base.shape[1]):
            if self.confidence is not None:
                confs.append(torch.sigmoid(self.confidence_logit(h[:, k], prev)))
            prev = self.markov(base[:, k, :vocab], prev).argmax(-1)
            drafts.append(prev)
        return torch.stack(drafts, 1), torch.stack(confs, 1) if confs else None

    # ---------------------------------------------------------------- a checkpoint's tensors

    def load_release(self, model_dir: Path) -> None:
        """The head's tensors from a dense checkpoint in the release's layout (mtp.i.*)."""
        raw = load_file(str(model_dir / "model.safetensors"))
        last = len(self.layers) - 1
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                own = {k.removeprefix(f"mtp.{i}."): v for k, v in raw.items()
                       if k.startswith(f"mtp.{i}.") and not _head_tensor(k)}  # fmt: skip
                layer.load_state_dict(_hf_layer_state(self.layer_config, own))
            self.main_proj.weight.copy_(raw["mtp.0.main_proj.weight"])
            self.main_norm.weight.copy_(raw["mtp.0.main_norm.weight"])
            self.norm.weight.copy_(raw[f"mtp.{last}.norm.weight"])
            for part in ("fn", "base", "scale"):
                getattr(self.hc_head, f"hc_{part}").copy_(raw[f"mtp.{last}.hc_head_{part}"])
            self.markov_w1.weight.copy_(raw[f"mtp.{last}.markov_head.markov_w1.weight"])
            self.markov_w2.weight.copy_(raw[f"mtp.{last}.markov_head.markov_w2.weight"])
            if self.confidence is not None:
                self.confidence.weight.copy_(raw[f"mtp.{last}.confidence_head.proj.weight"])

    def release_tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the release's names (the inverse of load_release)."""
        last, out = len(self.layers) - 1, {}
        for i, layer in enumerate(self.layers):
            for k, v in _release_layer_state(self.layer_config, layer).items():
                out[f"mtp.{i}.{k}"] = v
        out["mtp.0.main_proj.weight"] = self.main_proj.weight
        out["mtp.0.main_norm.weight"] = self.main_norm.weight
        out[f"mtp.{last}.norm.weight"] = self.norm.weight
        for part in ("fn", "base", "scale"):
            out[f"mtp.{last}.hc_head_{part}"] = getattr(self.hc_head, f"hc_{part}")
        out[f"mtp.{last}.markov_head.markov_w1.weight"] = self.markov_w1.weight
        out[f"mtp.{last}.markov_head.markov_w2.weight"] = self.markov_w2.weight
        if self.confidence is not None:
            out[f"mtp.{last}.confidence_head.proj.weight"] = self.confidence.weight
        return {k: v.detach().contiguous() for k, v in out.items()}


def _head_tensor(name: str) -> bool:
    rest = name.split(".", 2)[2]
    return rest.startswith(("main_proj.", "main_norm.", "norm.", "hc_head_", "markov_head.",
                            "confidence_head."))  # fmt: skip


def _one_layer_model(cfg: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM(cfg)


def _hf_layer_state(cfg: DeepseekV4Config, release: dict[str, torch.Tensor]) -> dict:
    """A draft layer's release-named tensors -> an HF decoder layer's state dict (HF's loader
    does the renaming: a one-layer checkpoint written and read back)."""
    one = _one_layer_model(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        layer = {f"model.layers.0.{k}": v for k, v in release.items()}
        save_file({**{k: v for k, v in saved.items() if not k.startswith("model.layers.0.")},
                   **layer}, str(Path(tmp) / "model.safetensors"))  # fmt: skip
        one = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return one.model.layers[0].state_dict()


def _release_layer_state(cfg: DeepseekV4Config, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An HF decoder layer's tensors under the release's names (HF's save_pretrained writes
    them)."""
    one = _one_layer_model(cfg)
    one.model.layers[0].load_state_dict(layer.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    return {k.removeprefix("model.layers.0."): v for k, v in saved.items()
            if k.startswith("model.layers.0.")}  # fmt: skip


def masked_acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """DeepSpec's confidence target: 1 - TV(softmax(draft), softmax(target)), per row."""
    p, q = draft_logits.float().softmax(-1), target_logits.float().softmax(-1)
    return (1 - 0.5 * (p - q).abs().sum(-1)).clamp(0, 1)
