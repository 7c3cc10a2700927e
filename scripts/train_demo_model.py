#!/usr/bin/env python3
"""Train dsaserve's built-in demo model: a small DeepSeek-V4 that writes Shakespeare-like text.

The model is HF transformers' `DeepseekV4ForCausalLM` (the differentiable reference of the
architecture the engine serves) with every V4 layer kind: sliding-window, CSA (compressor and
lightning indexer) and HCA attention, hash-routed and routed MoE, mHC residual streams. It reads
data/tinyshakespeare.txt one byte per token (engine/text/byte_tokenizer.py), holding out the last 5%
of the bytes, and is written as a checkpoint `engine.LLM` loads: config.json, bf16
model.safetensors, the tokenizer files with a play-dialogue chat template, README.md (the model
card), train_log.json and loss.png.

The indexer is not trained: its top-k selection has no gradient (DeepSeek trains it with a
separate distillation loss), so it stays frozen at its random init and the rest of the model
learns to use whatever it selects.

One H200, about 4 minutes (then --mtp-time-budget-s, 60 s by default, train the MTP layer:
scripts/demo_mtp.py):
    python3 scripts/train_demo_model.py --device cuda --out OUT/dsaserve-demo-v4 --time-budget-s 240
CPU smoke run (seconds; --smoke shrinks the model):
    python3 scripts/train_demo_model.py --device cpu --smoke --steps 20 --seq-len 128 \
        --batch-size 4 --out /tmp/demo
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # the time budget counts from here (before the heavy imports)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

try:  # run as a script: its folder is on sys.path
    from demo_model_card import write_card, write_loss_png
    from demo_mtp import add_mtp_args, add_to_checkpoint, mtp_tensors, train_mtp
except ImportError:  # loaded from the repository root (tests/models/test_train_demo_model.py)
    from scripts.demo_model_card import write_card, write_loss_png
    from scripts.demo_mtp import add_mtp_args, add_to_checkpoint, mtp_tensors, train_mtp

from dsaserve.engine.text.byte_tokenizer import PLAY_CHAT_TEMPLATE, write_byte_tokenizer  # noqa: E402

BOS, EOS, VOCAB = (
    256,
    257,
    262,
)  # the tiny tokenizer: byte b is token b, then bos, eos, 4 chat tokens
HELDOUT_FRACTION = 0.05
MAX_EXPORT_BYTES = 15 << 20  # the trainer machine returns files of at most 16 MiB
MODEL_NAME = "dsaserve-demo-v4"

# Attention in shapes the Triton kernels tile (16 query heads, head_dim 512 of which 64 RoPE,
# power-of-two indexer width, >= 16 indexer heads), scaled for a 512-token training context:
# a 128-token window, CSA every 4 tokens (128 entries at 512 tokens, of which the indexer keeps
# 32), HCA every 16. About 7.5 M parameters (15 MB in bf16).
DEMO_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=4,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=512,
    partial_rotary_factor=64 / 512,
    q_lora_rank=48,
    o_groups=4,
    o_lora_rank=32,
    sliding_window=128,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=32,
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=80,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    bos_token_id=BOS,
    eos_token_id=EOS,
)

# Same layer kinds and routing, small widths: for CPU smoke runs and tests only.
SMOKE_OVERRIDES = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=16 / 64,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=32,
    index_head_dim=32,
    index_topk=8,
    n_routed_experts=4,
    moe_intermediate_size=32,
)


MIN_TRANSFORMERS = "5.24"  # the version whose deepseek_v4 the engine is tested against
_INSTALL_HINT = (
    "Install the wheel first, e.g.\n"
    "  python3 -m pip install --no-index --no-deps --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site:$PWD"
)


def require_deepseek_v4():
    """transformers' DeepSeek-V4 classes, or exit with a message that says how to get them."""
    try:
        import transformers
    except ImportError as e:
        sys.exit(
            f"error: cannot import transformers ({e}); "
            f"this script needs transformers >= {MIN_TRANSFORMERS} "
            f"(DeepseekV4ForCausalLM). {_INSTALL_HINT}"
        )
    from packaging.version import Version

    where = f"transformers {transformers.__version__} from {Path(transformers.__file__).parent}"
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError:
        sys.exit(
            f"error: {where} has no deepseek_v4 model; "
            f"this script needs transformers >= {MIN_TRANSFORMERS}. " + _INSTALL_HINT
        )
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        # Older deepseek_v4 code differs (precision of norms and RoPE, the `cache` argument).
        sys.exit(
            f"error: {where}: this script needs transformers >= {MIN_TRANSFORMERS}, "
            f"the deepseek_v4 implementation dsaserve's engine is tested against. {_INSTALL_HINT}"
        )
    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        required=True,
        help=f"output model directory (its name is the served model id: {MODEL_NAME})",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--steps",
        type=int,
        default=2000,
        help="training steps (upper bound when --time-budget-s is set)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="tokens per training window (bos + seq_len-1 bytes)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock budget for the whole run, startup and export included: the step count "
        "(and so the LR schedule) is fitted to it after a few timed steps",
    )
    p.add_argument(
        "--reserve-s",
        type=float,
        default=40.0,
        help="seconds of the budget kept for export, sample and engine check "
        "(the final eval's estimated time is kept back as well)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="cosine floor, as a fraction of --lr"
    )
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=1e-2,
        help="aux-loss-free balancing: how far each step moves a routed gate's selection bias "
        "(DeepSeek-V3 used 1e-3 over far more steps)",
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument(
        "--eval-bytes",
        type=int,
        default=0,
        help="held-out bytes for periodic evals (0: all of them)",
    )
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument(
        "--sample-tokens", type=int, default=400, help="length of the sample in the model card"
    )
    p.add_argument("--seed", type=int, default=1234)
    # the MTP layer (scripts/demo_mtp.py) on the trained, frozen model; 0: none
    add_mtp_args(p, 60.0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument(
        "--smoke", action="store_true", help="a much smaller model of the same kinds (CPU tests)"
    )
    p.add_argument(
        "--no-engine-check",
        action="store_true",
        help="skip scoring the export with dsaserve's engine (CPU) against HF",
    )
    p.add_argument("--data", default=str(REPO / "data" / "tinyshakespeare.txt"))
    args = p.parse_args(argv)
    if args.seq_len < 2 or args.batch_size < 1 or args.steps < 1:
        p.error("--seq-len must be >= 2, --batch-size and --steps >= 1")
    return args


# ----------------------------------------------------------------------------------------- data


def load_corpus(path: str | os.PathLike) -> tuple[bytes, int]:
    """The corpus bytes and the split point: [0, split) trains, [split, end) is held out."""
    data = Path(path).read_bytes()
    return data, len(data) - int(len(data) * HELDOUT_FRACTION)


def sample_batch(
    train: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the training bytes: inputs [bos, b0 .. b(L-2)], targets [b0 .. b(L-1)]."""
    starts = torch.randint(0, train.numel() - seq_len + 1, (batch,), generator=gen).to(train.device)
    targets = train[starts[:, None] + torch.arange(seq_len, device=train.device)].long()
    return with_bos(targets), targets


def with_bos(targets: torch.Tensor) -> torch.Tensor:
    bos = torch.full_like(targets[:, :1], BOS)
    return torch.cat([bos, targets[:, :-1]], dim=1)


def heldout_windows(heldout: bytes, seq_len: int, max_bytes: int = 0) -> list[bytes]:
    """The held-out text cut into consecutive windows of seq_len bytes (the last one shorter)."""
    text = heldout[:max_bytes] if max_bytes else heldout
    return [text[i : i + seq_len] for i in range(0, len(text), seq_len)]


# ----------------------------------------------------------------------------------------- model


def build_model(config_cls, model_cls, smoke: bool, seed: int):
    torch.manual_seed(seed)
    cfg = config_cls(
        **{**DEMO_CONFIG, **(SMOKE_OVERRIDES if smoke else {})}, experts_implementation="eager"
    )
    # "eager" experts: a loop over experts that works for fp32 master weights under bf16 autocast;
    # torch's grouped_mm wants bf16 weights on CUDA.
    model = model_cls(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if (
                layer.mlp.is_hash
            ):  # HF inits the hash table to zeros: draw distinct experts per token
                table = torch.stack(
                    [
                        torch.randperm(cfg.n_routed_experts, generator=gen)[: gate.top_k]
                        for _ in range(cfg.vocab_size)
                    ]
                )
                gate.tid2eid.copy_(table)
            compressor = layer.self_attn.compressor
            if compressor is not None and hasattr(compressor, "indexer"):
                compressor.indexer.requires_grad_(False)  # top-k has no gradient: frozen at init
    return model


def param_counts(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    indexer = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    cfg = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {
        "total": total,
        "indexer": indexer,
        "routed_experts": experts,
        "active_per_token": active,
    }


def export_bytes_estimate(model) -> int:
    return sum(p.numel() * (4 if _keep_fp32(n) else 2) for n, p in model.named_parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def _keep_fp32(name: str) -> bool:
    """Parameters DeepSeek-V4 keeps in fp32 (HF's _keep_in_fp32_modules_strict: mHC, sinks,
    norms, compressor position biases); everything else is exported in bf16."""
    from transformers import DeepseekV4PreTrainedModel

    parts = set(name.split("."))
    return bool(parts & set(DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict))


class BalanceTracker:
    """DeepSeek's aux-loss-free load balancing: after every step, move each routed gate's
    selection bias (`e_score_correction_bias`, used for top-k choice only) towards even load."""

    def __init__(self, model, rate: float) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.rate, self.counts, self.gates, self.last = rate, {}, [], []
        for layer in model.model.layers:
            if isinstance(layer.mlp.gate, DeepseekV4TopKRouter):
                self.gates.append(layer.mlp.gate)
                layer.mlp.gate.register_forward_hook(self._hook)

    def _hook(self, gate, _inputs, outputs) -> None:
        if gate.training:
            counts = torch.bincount(outputs[2].flatten(), minlength=gate.num_experts)
            self.counts[gate] = self.counts.get(gate, 0) + counts

    @torch.no_grad()
    def step(self) -> None:
        """Update the biases from this step's loads (kept for `imbalance`)."""
        self.last = []
        for gate in self.gates:
            counts = self.counts.pop(gate, None)
            if counts is None:
                continue
            load = counts.float()
            gate.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            self.last.append(load.max() / load.mean().clamp(min=1))

    def imbalance(self) -> list[float]:
        """Each routed gate's max/mean expert load in the last step.

        1 = even; top-k of n: at most n/k.
        """
        return [round(float(x), 2) for x in self.last]


# ----------------------------------------------------------------------------------------- eval


@torch.no_grad()
def bits_per_byte(
    model, windows: list[bytes], batch_size: int, device: torch.device, autocast
) -> float:
    """Held-out bits per byte: each window is scored as [bos] + window, every byte predicted."""
    was_training = model.training
    model.eval()
    nats, count = 0.0, 0
    by_len: dict[int, list[bytes]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            targets = torch.tensor([list(w) for w in group[i : i + batch_size]], device=device)
            with autocast():
                logits = model(input_ids=with_bos(targets), use_cache=False).logits
            nats += F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), reduction="sum"
            ).item()
            count += targets.numel()
    model.train(was_training)
    return nats / math.log(2) / count


@torch.no_grad()
def sample_text(
    model, prompt: bytes, n: int, temperature: float, seed: int, device: torch.device
) -> str:
    """Sampled continuation of bos + prompt through HF's own cache (bytes only)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = [BOS, *prompt]
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
    new: list[int] = []
    for pos in range(len(ids), len(ids) + n):
        logits = out.logits[0, -1].float().cpu()
        logits[256:] = float("-inf")
        token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        new.append(token)
        out = model(
            input_ids=torch.tensor([[token]], device=device),
            cache=out.cache,
            use_cache=True,
            position_ids=torch.tensor([[pos]], device=device),
        )
    return (prompt + bytes(new)).decode("utf-8", errors="replace")


def engine_check(out_dir: Path, hf_model, windows: list[bytes], device: torch.device) -> dict:
    """Score the export with dsaserve's engine (fp32, CPU) and HF (fp32) on the same windows."""
    from dsaserve.engine.llm import LLM

    t = time.monotonic()
    llm = LLM(
        out_dir, device="cpu", dtype="float32", cpu_threads=max(1, min(8, os.cpu_count() or 1))
    )
    nats, count = 0.0, 0
    for w in windows:
        targets = torch.tensor(list(w))
        logits = llm.score([BOS, *w[:-1]])
        nats += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(w)
    engine_bpb = nats / math.log(2) / count
    hf_bpb = bits_per_byte(hf_model, windows, len(windows), device, contextlib.nullcontext)
    with torch.no_grad():  # and the logits themselves, on the first window
        ids = [BOS, *windows[0][:-1]]
        ref = (
            hf_model(input_ids=torch.tensor([ids], device=device), use_cache=False)
            .logits[0]
            .double()
            .cpu()
        )
        ours = llm.score(ids).double()
    return {
        "windows": len(windows),
        "bytes": count,
        "engine_bpb": engine_bpb,
        "hf_bpb": hf_bpb,
        "rel_diff": abs(engine_bpb - hf_bpb) / hf_bpb,
        "logits_rel_err": ((ours - ref).norm() / ref.norm()).item(),
        "seconds": round(time.monotonic() - t, 1),
    }


# ----------------------------------------------------------------------------------------- training


def lr_at(step: int, total: int, args) -> float:
    """Linear warmup, then cosine from --lr down to --min-lr-ratio x --lr at step `total`."""
    warmup = max(
        1, min(args.warmup_steps, args.steps // 10)
    )  # fixed by --steps, not the fitted total
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model, args) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and not name.endswith("position_bias") else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = {"fused": True} if args.device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def elapsed() -> float:
    return time.monotonic() - T_START


def train(
    args,
    model,
    train_bytes: torch.Tensor,
    eval_windows: list[bytes],
    final_eval_scale: float,
    device,
    autocast,
    log: dict,
) -> None:
    """Train in place. With --time-budget-s, the step count is fitted to the budget once steps
    3..13 are timed, keeping back --reserve-s plus the final evaluation's estimated time (the
    periodic eval's time x final_eval_scale)."""
    opt = make_optimizer(model, args)
    balance = BalanceTracker(model, args.bias_update_rate)
    gen = torch.Generator().manual_seed(args.seed + 2)
    total = args.steps
    calib_from, calib_to = 3, 13  # steps timed to fit the schedule to the time budget
    t_calib, reserve = None, args.reserve_s
    run_loss, run_n, t_log = torch.zeros((), device=device), 0, time.monotonic()
    model.train()
    step = 0
    while step < total:
        if step % args.eval_every == 0:
            t_eval = time.monotonic()
            bpb = bits_per_byte(model, eval_windows, args.eval_batch_size, device, autocast)
            eval_s = time.monotonic() - t_eval
            log["evals"].append(
                {"step": step, "heldout_bpb": round(bpb, 4), "elapsed_s": round(elapsed(), 1)}
            )
            print(f"step {step:5d}  held-out {bpb:.4f} bits/byte  ({eval_s:.1f} s)", flush=True)
            if step == 0:
                log["eval_seconds"] = round(eval_s, 2)
                reserve = args.reserve_s + eval_s * final_eval_scale
                log["reserve_seconds"] = round(reserve, 1)
        if step == calib_from:
            _sync(device)
            t_calib = time.monotonic()
        if step == calib_to and args.time_budget_s:
            _sync(device)
            step_s = (time.monotonic() - t_calib) / (calib_to - calib_from)
            left = args.time_budget_s - reserve - elapsed()
            per_step = step_s + log["eval_seconds"] / args.eval_every
            fitted = calib_to + max(0, int(left / per_step))
            total = min(total, fitted)
            log["step_seconds_calibrated"] = round(step_s, 4)
            print(
                f"calibrated: {step_s * 1e3:.0f} ms/step, {left:.0f} s left -> {total} steps",
                flush=True,
            )
        if args.time_budget_s and elapsed() > args.time_budget_s - reserve * 0.75:
            print(f"time budget reached at step {step}; stopping", flush=True)
            log["stopped_by_budget_at"] = step
            break

        lr = lr_at(step, total, args)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = sample_batch(train_bytes, args.batch_size, args.seq_len, gen)
        with autocast():
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        balance.step()
        run_loss += loss.detach()
        run_n += 1
        step += 1

        if step % args.log_every == 0 or step == total:
            mean = (run_loss / run_n).item()
            dt = time.monotonic() - t_log
            tok_s = run_n * args.batch_size * args.seq_len / dt
            entry = {
                "step": step,
                "train_loss": round(mean, 4),
                "train_bpb": round(mean / math.log(2), 4),
                "lr": lr,
                "grad_norm": round(float(grad_norm), 3),
                "expert_max_over_mean": balance.imbalance(),
                "elapsed_s": round(elapsed(), 1),
            }
            log["train"].append(entry)
            print(
                f"step {step:5d}  loss {mean:.4f}  lr {lr:.2e}  |g| {float(grad_norm):.2f}  "
                f"{tok_s / 1e3:.0f}k tok/s  experts max/mean {entry['expert_max_over_mean']}  "
                f"{elapsed():.0f} s",
                flush=True,
            )
            run_loss, run_n, t_log = torch.zeros((), device=device), 0, time.monotonic()
    log["steps"] = step
    log["tokens"] = step * args.batch_size * args.seq_len
    bpb = bits_per_byte(model, eval_windows, args.eval_batch_size, device, autocast)
    log["evals"].append(
        {"step": step, "heldout_bpb": round(bpb, 4), "elapsed_s": round(elapsed(), 1)}
    )
    print(f"step {step:5d}  held-out {bpb:.4f} bits/byte (training precision)", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------- export


def export(model, out: Path) -> None:
    """config.json + bf16 model.safetensors (HF save_pretrained names, fp32 where V4 keeps fp32)
    + the tiny tokenizer's files with the play chat template."""
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.float() if _keep_fp32(name) else p.data.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="1GB")  # one file: the trainer returns at most 8
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    vocab = write_byte_tokenizer(
        out, chat_template=PLAY_CHAT_TEMPLATE
    )  # also the generation_config
    assert vocab == VOCAB, vocab
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_EXPORT_BYTES:
        print(
            f"WARNING: model.safetensors is {size / 2**20:.1f} MiB "
            f"(> {MAX_EXPORT_BYTES >> 20} MiB)",
            flush=True,
        )
    from tokenizers import Tokenizer

    probe = "ROMEO:\nO, she doth teach the torches to burn bright!"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(
        probe, add_special_tokens=False
    ).ids == list(probe.encode()), "the tokenizer is not byte-per-token"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers, config_cls, model_cls = require_deepseek_v4()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext
    out = Path(args.out)

    data, split = load_corpus(args.data)
    train_bytes = torch.frombuffer(bytearray(data[:split]), dtype=torch.uint8).to(device)
    heldout = data[split:]
    model = build_model(config_cls, model_cls, args.smoke, args.seed).to(device)
    counts = param_counts(model)
    est = export_bytes_estimate(model)
    if est > MAX_EXPORT_BYTES:
        sys.exit(
            f"error: the export would be {est / 2**20:.1f} MiB, "
            f"over the {MAX_EXPORT_BYTES >> 20} MiB a returned file may have; shrink the config"
        )
    log = {
        "model": MODEL_NAME,
        "args": vars(args),
        "config": model.config.to_dict(),
        "params": counts,
        "export_bytes_estimate": est,
        "data": {
            "file": "data/tinyshakespeare.txt",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "train_bytes": split,
            "heldout_bytes": len(heldout),
            "heldout_from_byte": split,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
        },
        "train": [],
        "evals": [],
    }
    print(
        f"DeepSeek-V4 demo: {counts['total'] / 1e6:.2f} M parameters "
        f"({counts['active_per_token'] / 1e6:.2f} M active per token, "
        f"indexer {counts['indexer'] / 1e6:.2f} M frozen); {split} training bytes, "
        f"{len(heldout)} held out; startup {elapsed():.1f} s on {log['environment']['device']}",
        flush=True,
    )

    eval_windows = heldout_windows(heldout, args.seq_len, args.eval_bytes)
    # the final eval reads all held-out bytes in fp32 (twice the cost of bf16 on a GPU, roughly)
    final_eval_scale = (
        len(heldout) / sum(map(len, eval_windows)) * (2 if device.type == "cuda" else 1)
    )
    t_train = time.monotonic()
    train(args, model, train_bytes, eval_windows, final_eval_scale, device, autocast, log)
    log["train_seconds"] = round(time.monotonic() - t_train, 1)

    export(model, out)
    # The card's numbers come from the exported (bf16-rounded) weights, run in fp32.
    reloaded = model_cls.from_pretrained(
        out, dtype=torch.float32, experts_implementation="eager"
    ).to(device)
    all_windows = heldout_windows(heldout, args.seq_len)
    log["final"] = {
        "heldout_bpb": bits_per_byte(
            reloaded, all_windows, args.eval_batch_size, device, contextlib.nullcontext
        ),
        "heldout_bytes": len(heldout),
        "window": args.seq_len,
        "precision": "exported bf16 weights, fp32 compute",
    }
    print(f"final held-out: {log['final']['heldout_bpb']:.4f} bits/byte (export, fp32)", flush=True)
    if args.mtp_time_budget_s > 0:  # the draft head: the main objective shifted by one
        cpu_bytes = torch.frombuffer(bytearray(data[:split]), dtype=torch.uint8)
        mtp = train_mtp(reloaded, cpu_bytes, args, log, out)
        add_to_checkpoint(out, mtp_tensors(mtp.to("cpu"), model_cls))
        mtp.to(device)
    _write_log(out, log)
    try:
        log["sample"] = {
            "prompt": "ROMEO:",
            "temperature": 0.8,
            "seed": args.seed,
            "text": sample_text(reloaded, b"ROMEO:", args.sample_tokens, 0.8, args.seed, device),
        }
        print("sample:\n" + log["sample"]["text"], flush=True)
    except Exception as e:
        log["sample"] = {"error": f"{type(e).__name__}: {e}"}
    if not args.no_engine_check:
        try:
            log["engine_check"] = engine_check(out, reloaded, all_windows[:4], device)
            print(f"engine check: {log['engine_check']}", flush=True)
        except Exception as e:
            log["engine_check"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"engine check failed: {log['engine_check']['error']}", flush=True)
    log["wall_seconds"] = round(elapsed(), 1)
    try:
        log["loss_png"] = write_loss_png(out / "loss.png", log)
    except Exception as e:
        log["loss_png"] = f"not written: {type(e).__name__}: {e}"
    write_card(out / "README.md", log)
    _write_log(out, log)
    print(
        f"wrote {out} in {elapsed():.0f} s: " + ", ".join(sorted(p.name for p in out.iterdir())),
        flush=True,
    )


def _write_log(out: Path, log: dict) -> None:
    (out / "train_log.json").write_text(json.dumps(log, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
