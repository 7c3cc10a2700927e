#!/usr/bin/env python3
"""Train the demo model's multi-token-prediction (MTP) layer, the draft head of speculative
decoding, on top of the trained and frozen main model, and add it to the checkpoint.

The objective is the main model's shifted by one, as the DeepSeek-V4 report trains its MTP
module: at position t the layer reads the main model's last-layer streams h_t and the embedding
of token t+1, and predicts token t+2 (cross-entropy on the training bytes), plus (--mtp-distill)
the KL to the main model's own distribution of token t+2, which is what drafts are verified
against. The layer is HF
transformers' DeepSeek-V4 decoder layer (sliding-window attention, score-routed MoE: the kinds
the engine gives an MTP layer by default) between the release's e_proj/h_proj/enorm/hnorm and
its own mHC head and norm; the embedding and LM head are the main model's. It starts from the
main model's own pieces (attention of the sliding layer 0, MoE and mHC of the last layer, the
head's mHC collapse and norm), h_proj at identity: it starts as "what the main model would say
next" and learns the step after.

The tensors are written under the release's names (`mtp.0.*`, what engine.models.deepseek_v4
loads) next to the main model's, and config.json gets `num_nextn_predict_layers: 1`.

    python3 scripts/demo_mtp.py --model engine/assets/dsaserve-demo-v4 --time-budget-s 900
scripts/train_demo_model.py runs it after the main model's training (--mtp-time-budget-s).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]


class MTP(torch.nn.Module):
    """The release's MTPBlock around one HF decoder layer (main embedding and head shared)."""

    def __init__(self, main, layer_cls, head_cls, norm_cls) -> None:
        super().__init__()
        cfg = copy.deepcopy(main.config)
        cfg.layer_types = ["sliding_attention"] + list(cfg.layer_types[1:])
        cfg.mlp_layer_types = ["moe"] + list(cfg.mlp_layer_types[1:])
        self.layer_config = cfg
        hidden = cfg.hidden_size
        self.layer = layer_cls(cfg, 0)
        self.e_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.h_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.enorm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.hnorm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.norm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.hc_head = head_cls(cfg)
        layers = main.model.layers
        with torch.no_grad():
            own = self.layer.state_dict()
            sources = {
                "self_attn.": layers[0].state_dict(),
                "mlp.": layers[-1].state_dict(),
                "attn_hc.": layers[-1].state_dict(),
                "ffn_hc.": layers[-1].state_dict(),
                "input_layernorm.": layers[0].state_dict(),
                "post_attention_layernorm.": layers[-1].state_dict(),
            }
            for name in own:
                for prefix, source in sources.items():
                    if name.startswith(prefix) and name in source:
                        own[name] = source[name].clone()
            self.layer.load_state_dict(own)
            self.hc_head.load_state_dict(main.model.hc_head.state_dict())
            self.norm.load_state_dict(main.model.norm.state_dict())
            self.h_proj.weight.copy_(torch.eye(hidden))
            self.e_proj.weight.normal_(0, 0.02)
            self.enorm.weight.fill_(1.0)
            self.hnorm.weight.fill_(1.0)

    def forward(self, main, streams, next_ids, layer_kwargs) -> torch.Tensor:
        """streams [B, T, hc, H] at positions t; next_ids [B, T] tokens t+1 -> logits [B, T, V]
        of tokens t+2."""
        e = self.e_proj(self.enorm(main.model.embed_tokens(next_ids)))
        x = e.unsqueeze(2) + self.h_proj(self.hnorm(streams))
        out = self.layer(x, input_ids=next_ids, **layer_kwargs)
        return main.lm_head(self.norm(self.hc_head(out)))


def main_streams(main, inputs: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The frozen main model over inputs [B, T]: (its last layer's streams [B, T, hc, H], the
    keyword arguments its layers got (RoPE tables, mask, positions), its logits [B, T, V])."""
    seen: dict = {}

    def grab(module, args, kwargs):
        seen.update(
            {k: kwargs[k] for k in ("position_embeddings", "position_ids", "attention_mask")}
        )

    def keep(module, args, kwargs, output):
        seen["streams"] = output

    last = main.model.layers[-1]
    hooks = [
        last.register_forward_pre_hook(grab, with_kwargs=True),
        last.register_forward_hook(keep, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            logits = main(input_ids=inputs, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    streams = seen.pop("streams")
    return streams, seen, logits


def train_mtp(main, train_bytes: torch.Tensor, args, log: dict):
    """Train an MTP layer for `main` (frozen) on train_bytes (uint8, on the CPU); returns it.
    args: mtp_time_budget_s, mtp_steps, mtp_lr, mtp_distill, batch_size, seq_len, seed, and
    resume + model (a checkpoint to go on from)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    for p in main.parameters():
        p.requires_grad_(False)
    main.eval()
    device = next(main.parameters()).device
    mtp = MTP(main, m.DeepseekV4DecoderLayer, m.DeepseekV4HyperHead, m.DeepseekV4RMSNorm)
    log["mtp"] = {"train": []}
    if getattr(args, "resume", False) and resume(mtp, m.DeepseekV4ForCausalLM, Path(args.model)):
        print("resuming from the checkpoint's MTP layer", flush=True)
        log["mtp"]["resumed"] = True
    mtp = mtp.to(device)
    params = [p for n, p in mtp.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(params, lr=args.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 7)
    t0, step = time.monotonic(), 0
    while time.monotonic() - t0 < args.mtp_time_budget_s and step < args.mtp_steps:
        lr = args.mtp_lr * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(
            0, train_bytes.numel() - args.seq_len - 1, (args.batch_size,), generator=gen
        )
        window = train_bytes[starts[:, None] + torch.arange(args.seq_len + 1)].long().to(device)
        inputs, targets = window[:, :-1], window[:, 1:]
        streams, kwargs, main_logits = main_streams(main, inputs)
        logits = mtp(main, streams, targets, kwargs)  # [B, T, V]: token t+2
        draft = logits[:, :-1].flatten(0, 1).float().log_softmax(-1)
        loss = F.nll_loss(draft, targets[:, 1:].flatten())
        if args.mtp_distill:  # and the main model's own distribution of token t+2
            teacher = main_logits[:, 1:].flatten(0, 1).float().log_softmax(-1)
            loss = loss + args.mtp_distill * F.kl_div(
                draft, teacher, log_target=True, reduction="batchmean"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            # how often the draft for t+2 equals the main model's own greedy choice there
            agree = (logits[:, :-1].argmax(-1) == main_logits[:, 1:].argmax(-1)).float().mean()
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "agrees_with_main": round(agree.item(), 4),
                "elapsed_s": round(time.monotonic() - t0, 1),
            }
            log["mtp"]["train"].append(entry)
            print(f"mtp {entry}", flush=True)
    log["mtp"]["steps"] = step
    return mtp


def _one_layer(mtp: MTP, model_cls):
    """A one-layer HF model whose layer is built as the MTP layer (for its names on disk)."""
    cfg = copy.deepcopy(mtp.layer_config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = cfg.layer_types[:1]
    cfg.mlp_layer_types = cfg.mlp_layer_types[:1]
    return model_cls(cfg)


def resume(mtp: MTP, model_cls, model_dir: Path) -> bool:
    """Load the `mtp.0.*` tensors a checkpoint already has into `mtp` (training goes on from
    them); False when it has none."""
    stored = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
              if k.startswith("mtp.0.")}  # fmt: skip
    if not stored:
        return False
    one = _one_layer(mtp, model_cls)
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)
        names = load_file(str(Path(tmp) / "model.safetensors"))
        layer = {k: stored["mtp.0." + k.removeprefix("model.layers.0.")] for k in names
                 if k.startswith("model.layers.0.")}  # fmt: skip
        save_file({**names, **layer}, str(Path(tmp) / "model.safetensors"))
        one = model_cls.from_pretrained(tmp, dtype=torch.float32)
    with torch.no_grad():
        mtp.layer.load_state_dict(one.model.layers[0].state_dict())
        for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            getattr(mtp, name).weight.copy_(stored[f"mtp.0.{name}.weight"].float())
        for part in ("fn", "base", "scale"):
            getattr(mtp.hc_head, f"hc_{part}").copy_(stored[f"mtp.0.hc_head_{part}"].float())
    return True


def mtp_tensors(mtp: MTP, model_cls) -> dict[str, torch.Tensor]:
    """The layer's tensors under the release's names (`mtp.0.*`), bf16 where V4 keeps bf16."""
    one = _one_layer(mtp, model_cls)
    one.model.layers[0].load_state_dict(mtp.layer.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)  # HF writes the release's names for a layer
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out = {
        "mtp.0." + k.removeprefix("model.layers.0."): v
        for k, v in saved.items()
        if k.startswith("model.layers.0.")
    }
    for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = getattr(mtp, name).weight.detach()
    for part in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{part}"] = getattr(mtp.hc_head, f"hc_{part}").detach()
    return {k: _stored(k, v) for k, v in out.items()}


def _stored(name: str, t: torch.Tensor) -> torch.Tensor:
    fp32 = any(s in name for s in ("hc_", "attn_sink", "ape", "gate.bias", "norm"))
    return (
        t.float().contiguous()
        if fp32 or t.dtype == torch.int64
        else t.to(torch.bfloat16).contiguous()
    )


def add_to_checkpoint(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    path = out / "model.safetensors"
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}
    save_file({**state, **tensors}, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def add_mtp_args(p: argparse.ArgumentParser, budget_s: float) -> None:
    """The MTP training's flags (train_demo_model.py takes them too)."""
    p.add_argument("--mtp-time-budget-s", type=float, default=budget_s)
    p.add_argument("--mtp-steps", type=int, default=10**9)
    p.add_argument("--mtp-lr", type=float, default=1e-3)
    p.add_argument(
        "--mtp-distill",
        type=float,
        default=1.0,
        help="weight of the KL to the main model's distribution of token t+2 (0: data only)",
    )


def record_acceptance(model_dir: Path, bench_json: Path) -> None:
    """Put bench/spec_decode.py's acceptance figures into the model's train_log.json and
    rewrite its card (README.md) from that log."""
    try:
        from demo_model_card import write_card
    except ImportError:
        from scripts.demo_model_card import write_card
    record = json.loads(bench_json.read_text())
    log = json.loads((model_dir / "train_log.json").read_text())
    rows = {name.removeprefix("K="): row for name, row in record["rows"].items()}
    log["mtp"]["acceptance"] = {
        "command": f"`python -m bench.spec_decode`, {record['args']['prompts']} prompts of "
        f"{record['args']['prompt_bytes']} bytes, {record['args']['max_tokens']} tokens each",
        "rows": {k: row for k, row in rows.items() if k.isdigit() and k != "0"},
    }
    (model_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    write_card(model_dir / "README.md", log)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "engine/assets/dsaserve-demo-v4"))
    p.add_argument("--data", default=str(REPO / "data" / "tinyshakespeare.txt"))
    add_mtp_args(p, 900)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--resume", action="store_true", help="go on from the checkpoint's MTP layer, if any"
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--record-acceptance",
        metavar="BENCH_JSON",
        help="no training: put bench/spec_decode.py's figures into the model's log and card",
    )
    args = p.parse_args(argv)
    if args.record_acceptance:
        record_acceptance(Path(args.model), Path(args.record_acceptance))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import DeepseekV4ForCausalLM

    out = Path(args.model)
    main_model = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    data = Path(args.data).read_bytes()
    split = len(data) - int(len(data) * 0.05)  # the main model's held-out 5 %
    train_bytes = torch.frombuffer(bytearray(data[:split]), dtype=torch.uint8)
    log: dict = {}
    mtp = train_mtp(main_model, train_bytes, args, log)
    add_to_checkpoint(out, mtp_tensors(mtp, DeepseekV4ForCausalLM))
    train_log = out / "train_log.json"
    full = json.loads(train_log.read_text()) if train_log.exists() else {}
    before = full.get("mtp", {}) if log["mtp"].get("resumed") else {}
    full["mtp"] = {
        **log["mtp"],
        "train": before.get("train", []) + log["mtp"]["train"],  # (steps count on from before)
        "steps": before.get("steps", 0) + log["mtp"]["steps"],
        "args": {k: v for k, v in vars(args).items() if k != "model"},
    }
    train_log.write_text(json.dumps(full, indent=2) + "\n")
    print(f"MTP layer written to {out}", flush=True)


if __name__ == "__main__":
    main()
