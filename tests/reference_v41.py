"""An independent plain-torch forward of DeepSeek-V4.1 (tests): no HF transformers class exists.

Written from DeepSeek's own inference code for the model (huggingface.co/deepseek-ai/
DeepSeek-V4.1-Flash, revision dba1be0a, inference/model.py and inference/engram.py, read in a
public vendored copy that keeps them byte-identical), sharing no code with the engine's model:
one sequence, prefilled from position 0 in one pass (the release's `start_pos == 0` branch),
every layer on every row, weights read straight from the checkpoint (FP8 / FP4 ones
dequantized here from their codes and scales), float32 throughout. Each function names the
source it restates (`model.py:Name`). What the release also does and this leaves out:
- its QAT round trips (window KV through FP8 per 32, compressed KV through FP4 per 16, indexer
  queries and keys through FP4 per 32): the engine's fp32 path and its default bf16 KV cache
  skip them too;
- images (no vision tower is served), the DSpark head (`forward_spec`), tensor parallelism.

`greedy` re-runs the whole prefix for every token: the release's decode branch computes the
same function of the prefix, one row at a time.

V4.1 as a family of tests/model_fixtures.py: this module stands where tests.hf_reference stands
for the families transformers has (`VOCAB`, `make_hf_checkpoint`, a model called as HF's are).
Its checkpoints are the engine's tiny writer's (random weights under the release's names): the
writer is no model code, and this module reads what it wrote on its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from dsaserve.engine.models.deepseek_v41.tiny import make_tiny_model

VOCAB = 265  # the tiny tokenizer's: the 256 bytes, the chat tokens, V4.1's <｜System｜>
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor, quantized ones dequantized (FP8 e4m3 in 32- or 128-blocks, FP4 e2m1 pairs
    with a scale per 32; `.scale` multiplies), as float32 (int64 as it is)."""
    raw = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            raw |= {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, t in raw.items():
        scale = raw.get(name.removesuffix(".weight") + ".scale")
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in raw:
            continue
        if scale is not None and name.endswith(".weight"):
            s = scale.float()  # (e8m0 -> 2^(byte - 127))
            if t.dtype == torch.float8_e4m3fn and s.shape == (t.shape[0], t.shape[1] // 32):
                out[name] = t.float() * s.repeat_interleave(32, -1)  # Engram rows: 1 x 32
            elif t.dtype == torch.float8_e4m3fn:
                n, k = t.shape
                b = next(b for b in (32, 128) if s.shape == (-(-n // b), -(-k // b)))
                s = s.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
                out[name] = t.float() * s
            else:  # FP4: the low nibble holds the even element (convert.py)
                u8 = t.view(torch.uint8).long()
                codes = torch.stack((u8 & 15, u8 >> 4), -1).flatten(-2)
                out[name] = torch.tensor(FP4)[codes] * s.repeat_interleave(32, -1)
        elif t.dtype == torch.int64:
            out[name] = t
        else:
            out[name] = t.float()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.py:RMSNorm.forward."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def freqs_cis(dim: int, seqlen: int, original: int, base: float, factor: float, beta_fast: float,
              beta_slow: float) -> torch.Tensor:  # fmt: skip
    """model.py:precompute_freqs_cis: YaRN when original > 0, complex exponentials per row."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original > 0:

        def corrected(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(
            0, 1
        )
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def rotate(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """model.py:apply_rotary_emb on the last rope dims: adjacent pairs as complex numbers.
    x [T, ..., rd], freqs [T, rd // 2]."""
    c = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs.conj() if inverse else freqs
    f = f.view(f.shape[0], *([1] * (c.dim() - 2)), f.shape[-1])
    return torch.view_as_real(c * f).flatten(-2)


def with_rope(x: torch.Tensor, freqs: torch.Tensor, rd: int, inverse: bool = False):
    return torch.cat((x[..., :-rd], rotate(x[..., -rd:], freqs, inverse)), dim=-1)


def is_prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, math.isqrt(n) + 1))


class EngramHashes:
    """engram.py: build_compressed_token_map, compute_hash_multipliers, EngramLayout.from_args,
    NgramHashState.forward."""

    def __init__(self, cfg: dict, tokenizer_json: Path) -> None:
        backend = BackendTokenizer.from_file(str(tokenizer_json))
        normalizer = normalizers.Sequence(
            [
                normalizers.NFKC(),
                normalizers.NFD(),
                normalizers.StripAccents(),
                normalizers.Lowercase(),
                normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                normalizers.Replace(Regex(r"^ $"), "\ue000"),
                normalizers.Strip(),
                normalizers.Replace("\ue000", " "),
            ]
        )
        key_to_new: dict[str, int] = {}
        lookup = []
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            text = backend.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:
                key = backend.id_to_token(token_id)
            else:
                normalized = normalizer.normalize_str(text)
                key = normalized if normalized else text
            if key not in key_to_new:
                key_to_new[key] = len(key_to_new)
            lookup.append(key_to_new[key])
        assert len(key_to_new) == cfg["engram_compressed_vocab_size"]
        self.token_map = torch.tensor(lookup)
        self.pad_id = lookup[cfg["engram_pad_token_id"]]
        layers, n = cfg["engram_layer_ids"], cfg["engram_max_ngram_size"]
        bound = max(1, (np.iinfo(np.int64).max // len(key_to_new)) // 2)
        self.multipliers = torch.stack(
            [
                torch.tensor(
                    np.random.default_rng(10007 * layer).integers(
                        low=0, high=bound, size=(n,), dtype=np.int64
                    )
                    * 2
                    + 1
                )  # fmt: skip
                for layer in layers
            ]
        )
        primes, seen = [], set()
        for _ in layers:
            per_ngram = []
            for _ in range(n - 1):
                sizes, current = [], cfg["engram_vocab_size"] - 1
                for _ in range(cfg["engram_n_heads"]):
                    current += 1
                    while not is_prime(current) or current in seen:
                        current += 1
                    seen.add(current)
                    sizes.append(current)
                per_ngram.append(sizes)
            primes.append(per_ngram)
        self.primes = torch.tensor(primes)  # [L, n - 1, heads]
        flat = [[p for per in layer for p in per] for layer in primes]
        self.offsets = torch.tensor(np.array([np.cumsum([0, *f[:-1]]) for f in flat]))
        self.max_ngram = n

    def __call__(self, ids: list[int]) -> torch.Tensor:
        """[T, L, (n - 1) * heads] hash ids of a sequence prefilled from position 0."""
        cache = self.token_map[torch.tensor(ids)][None]  # [1, T]
        positions = torch.arange(len(ids))[None]
        tokens, blocked = [], torch.zeros_like(positions, dtype=torch.bool)
        for shift in range(self.max_ngram):
            source = cache.gather(1, (positions - shift).clamp_min(0))
            blocked = blocked | (positions < shift)
            tokens.append(torch.where(blocked, self.pad_id, source))
        products = torch.stack(tokens, dim=-1).unsqueeze(2) * self.multipliers  # [1, T, L, n]
        rolling, hashes = products[..., 0], []
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return (torch.cat(hashes, dim=-1) + self.offsets)[0]


class ReferenceV41:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self.cfg = cfg = json.loads((model_dir / "config.json").read_text())["text_config"]
        self.w = read_weights(model_dir)
        self.eps = cfg["rms_norm_eps"]
        self.hashes = EngramHashes(cfg, model_dir / "tokenizer.json") if cfg.get(
            "engram_layer_ids") else None  # fmt: skip
        tokenizer = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokens = tokenizer.get_vocab_size(with_added_tokens=True)  # (rows past it: padding)
        rope = cfg.get("rope_scaling") or {}
        self.yarn = (
            rope.get("original_max_position_embeddings", 0),
            rope.get("factor", 1.0),
            rope.get("beta_fast", 32),
            rope.get("beta_slow", 1),
        )

    def weight(self, name: str) -> torch.Tensor:
        return self.w[name]

    def logits(self, ids: list[int]) -> torch.Tensor:
        """model.py:Transformer.forward at start_pos 0, every row's logits: [T, vocab] (the
        tokenizer's tokens: what a server scores)."""
        cfg, n = self.cfg, self.cfg["hc_mult"]
        t = len(ids)
        h = self.weight("embed.weight")[torch.tensor(ids)]  # [T, D]
        h = h.unsqueeze(1).repeat(1, n, 1)  # [T, hc, D]
        pre_mix = torch.zeros(t, n)
        pre_mix[:, 0] = 1.0  # make_identity_pre_mix
        hashes = self.hashes(ids) if self.hashes else None
        shared: dict = {}  # SharedAttentionRuntime
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            if hashes is not None and i in cfg["engram_layer_ids"]:
                h = self.engram(p + "engram.", h, hashes[:, cfg["engram_layer_ids"].index(i)])
            h, pre_mix = self.block(i, p, h, pre_mix, shared)
        h = (pre_mix.unsqueeze(-1) * h).sum(1)  # Block.hc_pre with the last FFN's mix
        logits = rms_norm(h, self.weight("norm.weight"), self.eps) @ self.weight("head.weight").t()
        return logits[:, : self.tokens]

    def greedy(self, ids: list[int], steps: int, allowed: list[int] | None = None) -> list[int]:
        """The most likely token each step, among the tokenizer's (a padded row is no token), or
        among `allowed` (vLLM's allowed_token_ids)."""
        out = list(ids)
        for _ in range(steps):
            last = self.logits(out)[-1]
            if allowed is not None:
                last = torch.full_like(last, -torch.inf).index_copy(
                    0, torch.tensor(allowed), last[allowed]
                )
            out.append(int(last.argmax()))
        return out[len(ids) :]

    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: list[int] | None = None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> SimpleNamespace:
        """HF's causal-LM call, as tests.hf_reference's hf_logits and hf_greedy make it, so the
        shared cases run this reference where they run HF's models: input_ids [1, T] -> `logits`
        [1, T, tokens] of those rows, and a `cache` that is the tokens so far (each call runs
        the whole sequence again; positions follow from it)."""
        past = cache or []
        ids = past + input_ids[0].tolist()
        return SimpleNamespace(logits=self.logits(ids)[len(past) :][None], cache=ids)

    # ---------------------------------------------------------------- Block

    def hc_mixes(self, h: torch.Tensor, prefix: str):
        """model.py:Block.hc_mixes + kernel hc_split_sinkhorn -> (pre, post, comb)."""
        n, iters, eps = self.cfg["hc_mult"], self.cfg["hc_sinkhorn_iters"], self.cfg["hc_eps"]
        fn, scale, base = (self.weight(prefix + s) for s in ("fn", "scale", "base"))
        x = h.flatten(1).float()
        mixes = F.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
        post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
        comb = torch.exp(comb - comb.amax(-1, keepdim=True))
        comb = comb / comb.sum(-1, keepdim=True) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb

    def block(self, i: int, p: str, h: torch.Tensor, pre_mix: torch.Tensor, shared: dict):
        """model.py:Block.forward: each sublayer collapses with the previous one's `pre`."""
        residual = h
        attn_pre, attn_post, attn_comb = self.hc_mixes(h, p + "hc_attn_")
        x = (pre_mix.unsqueeze(-1) * h).sum(1)  # hc_pre
        x = rms_norm(x, self.weight(p + "attn_norm.weight"), self.eps)
        x = self.attention(i, p + "attn.", x, shared)
        h = attn_post.unsqueeze(-1) * x.unsqueeze(-2) + (
            attn_comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(1)  # fmt: skip  # hc_post
        residual = h
        ffn_pre, ffn_post, ffn_comb = self.hc_mixes(h, p + "hc_ffn_")
        x = (attn_pre.unsqueeze(-1) * h).sum(1)
        x = rms_norm(x, self.weight(p + "ffn_norm.weight"), self.eps)
        x = self.moe(p + "ffn.", x)
        h = ffn_post.unsqueeze(-1) * x.unsqueeze(-2) + (
            ffn_comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(1)  # fmt: skip
        return h, ffn_pre

    def engram(self, p: str, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """model.py:ParallelEngramEmbedding.forward (rows dequantized, cast to bf16) and
        Engram.forward."""
        n, d = self.cfg["hc_mult"], self.cfg["hidden_size"]
        rows = self.w[p + "embed.weight"][hash_ids].to(torch.bfloat16).float()  # [T, cols, dim]
        kv = rows.flatten(-2) @ self.weight(p + "wkv.weight").t()
        key, value = kv.split([n * d, d], dim=-1)
        key = key.unflatten(-1, (n, d))
        weight = self.weight(p + "q_weight") * self.weight(p + "k_weight")
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        dot = (h * weight * key).sum(-1) * rstd * d**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return h + gate.unsqueeze(-1) * value.unsqueeze(-2)

    def moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """model.py:Gate.forward (sqrtsoftplus scores, the bias picks, weights normalized and
        scaled), Expert.forward (clamped SwiGLU, the routing weight before w2), MoE.forward."""
        cfg, limit = self.cfg, self.cfg["swiglu_limit"]
        scores = x @ self.weight(p + "gate.weight").t()
        scores = (
            F.softplus(scores).sqrt() if cfg["scoring_func"] == "sqrtsoftplus" else scores.sigmoid()
        )
        indices = (scores + self.weight(p + "gate.bias")).topk(cfg["num_experts_per_tok"], dim=-1)[
            1
        ]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]

        def expert(q: str, v: torch.Tensor, route: torch.Tensor | None) -> torch.Tensor:
            gate = v @ self.weight(q + "w1.weight").t()
            up = v @ self.weight(q + "w3.weight").t()
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
            hidden = F.silu(gate) * up
            if route is not None:
                hidden = route * hidden
            return hidden @ self.weight(q + "w2.weight").t()

        y = torch.zeros_like(x)
        for e in range(cfg["n_routed_experts"]):
            tok, slot = torch.where(indices == e)
            if len(tok):
                y[tok] += expert(f"{p}experts.{e}.", x[tok], weights[tok, slot, None])
        return y + expert(p + "shared_experts.", x, None)

    # ---------------------------------------------------------------- Attention

    def attention(self, i: int, p: str, x: torch.Tensor, shared: dict) -> torch.Tensor:
        """model.py:Attention.forward (prefill): a window of raw KV plus, on compressed layers,
        the top-k entries of the latest KV source, in one softmax with the sink."""
        cfg = self.cfg
        t, heads, hd, rd = (
            x.shape[0],
            cfg["num_attention_heads"],
            cfg["head_dim"],
            cfg["qk_rope_head_dim"],
        )
        ratio, win = cfg["compress_ratios"][i], cfg["sliding_window"]
        if ratio:
            freqs = freqs_cis(rd, t, self.yarn[0], cfg["compress_rope_theta"], *self.yarn[1:])
        else:
            freqs = freqs_cis(rd, t, 0, cfg["rope_theta"], 1.0, 32, 1)
        qr = rms_norm(
            x @ self.weight(p + "wq_a.weight").t(), self.weight(p + "q_norm.weight"), self.eps
        )
        q = with_rope(
            (qr @ self.weight(p + "wq_b.weight").t()).unflatten(-1, (heads, hd)), freqs, rd
        )
        kv = with_rope(
            rms_norm(
                x @ self.weight(p + "wkv.weight").t(), self.weight(p + "kv_norm.weight"), self.eps
            ),
            freqs,
            rd,
        )
        # get_window_topk_idxs(start_pos=0): each query's own causal window
        end = torch.arange(t).unsqueeze(1)
        idxs = (end - win + 1).clamp(0) + torch.arange(min(t, win))
        idxs = torch.where(idxs > end, -1, idxs)
        keys = kv
        if ratio:
            compress, picks = self.compressed(i, p, x, qr, freqs, shared)
            keys = torch.cat((kv, compress))
            idxs = torch.cat((idxs, torch.where(picks >= 0, picks + t, -1)), dim=1)
        o = self.sparse_attn(q, keys, self.weight(p + "attn_sink"), idxs, hd**-0.5)
        o = with_rope(o, freqs, rd, inverse=True)
        groups = cfg["o_groups"]
        wo_a = self.weight(p + "wo_a.weight").view(groups, cfg["o_lora_rank"], -1)
        o = torch.einsum("sgd,grd->sgr", o.view(t, groups, -1), wo_a)
        return o.flatten(1) @ self.weight(p + "wo_b.weight").t()

    @staticmethod
    def sparse_attn(q, kv, sink, idxs, scale) -> torch.Tensor:
        """kernel sparse_attn: per query and head, softmax over its index list (-1 skipped) with
        exp(sink) in the denominator; K = V = the whole row."""
        valid = idxs >= 0
        gathered = kv[idxs.clamp(min=0)]  # [T, K, D]
        logits = torch.einsum("thd,tkd->thk", q, gathered) * scale
        logits = logits.masked_fill(~valid[:, None, :], -torch.inf)
        top = torch.maximum(logits.amax(-1), sink[None, :])
        p = torch.exp(logits - top.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(sink[None, :] - top)
        return torch.einsum("thk,tkd->thd", p / denom.unsqueeze(-1), gathered)

    def compressed(self, i, p, x, qr, freqs, shared):
        """model.py:Attention._compress_kv, Compressor.forward (prefill), Indexer.forward,
        select_candidate_blocks."""
        cfg, t = self.cfg, x.shape[0]
        ratio, rd = cfg["compress_ratios"][i], cfg["qk_rope_head_dim"]
        latent = None
        if i in cfg["kv_source_layer_ids"]:
            c = p + "compressor."
            if ratio == 1:
                latent = rms_norm(
                    x @ self.weight(c + "wkv.weight").t(), self.weight(c + "norm.weight"), self.eps
                )
            else:
                cut = t - t % ratio
                kv = (x @ self.weight(c + "wkv.weight").t())[:cut].unflatten(0, (-1, ratio))
                score = (x @ self.weight(c + "wgate.weight").t())[:cut].unflatten(0, (-1, ratio))
                latent = rms_norm(
                    (kv * score.softmax(dim=1)).sum(1), self.weight(c + "norm.weight"), self.eps
                )
        if i in cfg["index_source_layer_ids"]:
            shared["topk"] = self.indexer(i, p + "indexer.", x, qr, latent, freqs, shared)
        if latent is not None:
            shared["compress_kv"] = with_rope(latent, freqs[: t - t % ratio : ratio], rd)
        return shared["compress_kv"], shared["topk"]

    def indexer(self, i, p, x, qr, latent, freqs, shared) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        ratio, rd = cfg["compress_ratios"][i], cfg["qk_rope_head_dim"]
        heads, dim = cfg["index_n_heads"], cfg["index_head_dim"]
        if latent is not None:  # owns_k: the keys come from this source's latent
            k = rms_norm(
                latent @ self.weight(p + "wk.weight").t(),
                self.weight(p + "k_norm.weight"),
                self.eps,
            )
            shared["index_k"] = with_rope(k, freqs[: t - t % ratio : ratio], rd)
        q = with_rope(
            (qr @ self.weight(p + "wq_b.weight").t()).unflatten(-1, (heads, dim)), freqs, rd
        )
        weights = (x @ self.weight(p + "weights_proj.weight").t()) * (dim**-0.5 * heads**-0.5)
        score = torch.einsum("shd,td->sht", q, shared["index_k"]).relu()
        score = (score * weights.unsqueeze(-1)).sum(1)  # [T, entries]
        lens = (torch.arange(1, t + 1) // ratio).unsqueeze(-1)
        score = score.masked_fill(torch.arange(t // ratio) >= lens, -torch.inf)
        source = cfg.get("candidate_source_layer_id", -1)
        if i == source:
            shared["candidates"] = self.candidate_blocks(score, lens)
        elif 0 <= source < i:
            score = score.masked_fill(~shared["candidates"], -torch.inf)
        topk = min(cfg["index_topk"], t // ratio)
        idxs = score.topk(topk, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(idxs < lens, idxs, -1)

    def candidate_blocks(self, logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """model.py:select_candidate_blocks -> a mask shaped like logits."""
        size, count = self.cfg["candidate_block_size"], self.cfg["candidate_topk_blocks"]
        width = logits.size(-1)
        scores = F.pad(logits, (0, -width % size), value=-torch.inf)
        scores = scores.unflatten(-1, (-1, size)).amax(dim=-1)
        blocks = scores.size(-1)
        last = (lens - 1) // size
        scores = scores.masked_fill(torch.arange(blocks) == last, torch.inf)
        top = scores.topk(min(count, blocks), dim=-1)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            -1, top.indices, top.values > -torch.inf
        )
        return keep.repeat_interleave(size, dim=-1)[..., :width]


def make_hf_checkpoint(path: Path, seed: int = 0) -> ReferenceV41:
    """A tiny random V4.1 checkpoint written in `path` (no HF class exists: the release's
    names) and the reference on it (tests/model_fixtures.Family's interface)."""
    return ReferenceV41(make_tiny_model(path, seed=seed))
