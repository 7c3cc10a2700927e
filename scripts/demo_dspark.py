#!/usr/bin/env python3
"""Train a DSpark head for the demo model on a CPU (a few minutes) and write the demo model with
it: `dsaserve-demo-v4-dspark`, the demo model's weights with a DSpark head under `mtp.*` in the
release's layout, as DeepSeek ships V4-Flash-0731 beside V4-Flash (the two heads cannot share
one checkpoint: both live under `mtp.*`).

The objective is what speculative decoding checks, as for the MTP layer (scripts/demo_mtp.py):
the drafts are the main model's own greedy tokens on text it wrote itself. So the head trains on
the main model's greedy continuations (by the engine) of --prompt-bytes of training text from
random places (bench/spec_decode.py's prompts are that long, from the held-out text, which is
never used here); the main model is frozen, its taps and distributions computed once. A block is
anchored at a generated token p: its row k is scored on the main model's greedy token at
p + k + 1 (cross-entropy plus the KL to the main model's distribution), with the Markov head fed
the accepted prefix (teacher forcing: the anchor, then the greedy tokens); the confidence head
learns whether row k's draft is that token (binary cross-entropy, detached from the rest: greedy
verification's acceptance, the chance the scheduler weighs).

The head is tests/dspark_reference.py's (the plain-torch head the engine is tested against),
initialised from the main model's own pieces: each draft layer's attention from the sliding
layer 0, its MoE and mHC from the last layer, the collapse and norm from the model's head,
main_proj the mean of the taps; the Markov head's W2 and the confidence head at zero.

    python3 scripts/demo_dspark.py   # writes dsaserve/engine/assets/dsaserve-demo-v4-dspark
    python -m bench.spec_decode --out bench/results/cpu-spec-decode.json
    python3 scripts/demo_dspark.py --record-acceptance bench/results/cpu-spec-decode.json

The demo model's card (its README, scripts/demo_model_card.py) gets a DSpark section from the
run's log and, recorded, the bench's acceptance of both heads on held-out text.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
BOS = 256
NOISE = 261  # the demo tokenizer's last chat token, never in the data: the block's filler

try:  # run as a script: its folder is on sys.path
    from demo_model_card import write_card
    from demo_mtp import greedy_continuations
except ImportError:  # loaded from the repository root
    from scripts.demo_model_card import write_card
    from scripts.demo_mtp import greedy_continuations

VARIANT_CARD = """# dsaserve-demo-v4-dspark

dsaserve's demo model (`dsaserve-demo-v4`, its README is the model card) with a DSpark draft head
instead of its MTP layer, in the layout of DeepSeek-V4-Flash-0731 (`dspark_*` config fields, the
head under `mtp.*`). Made by `scripts/demo_dspark.py`; the demo model's card gives both heads'
acceptance on held-out text. Serve it with
`--model <this directory> --speculative-config '{"method": "dspark"}'`.
"""


class Teacher:
    """The frozen main model over sequences [n, L]: its taps [n, L, 3H], its greedy next token
    [n, L] and log-probabilities [n, L, V] at every position."""

    def __init__(self, sequences: torch.Tensor, taps: torch.Tensor, logp: torch.Tensor) -> None:
        self.ids, self.taps, self.logp = sequences, taps, logp
        self.greedy = self.logp.argmax(-1)

    @classmethod
    def compute(cls, main, head, sequences: torch.Tensor, batch: int) -> Teacher:
        taps, logp = [], []
        with torch.no_grad():
            for i in range(0, len(sequences), batch):
                part = sequences[i : i + batch]
                taps.append(head.target_taps(main, part))
                logp.append(main(part).logits.float().log_softmax(-1))
        return cls(sequences, torch.cat(taps), torch.cat(logp))


def init_from_main(head, main) -> None:
    """Each draft layer from the main model's pieces (see the module docstring)."""
    layers = main.model.layers
    with torch.no_grad():
        for layer in head.layers:
            own = layer.state_dict()
            for prefix, source in (
                ("self_attn.", layers[0]), ("mlp.", layers[-1]), ("attn_hc.", layers[-1]),
                ("ffn_hc.", layers[-1]), ("input_layernorm.", layers[0]),
                ("post_attention_layernorm.", layers[-1]),
            ):  # fmt: skip
                theirs = source.state_dict()
                for name in own:
                    if name.startswith(prefix) and name in theirs:
                        own[name] = theirs[name].clone()
            layer.load_state_dict(own)
        head.hc_head.load_state_dict(main.model.hc_head.state_dict())
        head.norm.load_state_dict(main.model.norm.state_dict())
        hidden = main.config.hidden_size
        taps = len(head.taps)
        head.main_proj.weight.copy_(torch.eye(hidden).repeat(1, taps) / taps)
        head.main_norm.weight.fill_(1.0)
        head.markov_w1.weight.normal_(0, 1.0)
        head.markov_w2.weight.zero_()
        if head.confidence is not None:
            head.confidence.weight.zero_()


def block_loss(head, main, teacher: Teacher, rows: torch.Tensor, anchors: torch.Tensor, args):
    """(loss, accepted prefix lengths [B, A]) of blocks at anchors [B, A] of sequences `rows`."""
    gamma = args.gamma
    ids, taps = teacher.ids[rows], teacher.taps[rows]
    h, base = head(main, taps, ids, anchors, gamma)  # [B, A, gamma, H], [B, A, gamma, V]
    at = anchors[..., None] + torch.arange(gamma)  # the position each row's token follows
    b = torch.arange(len(rows))[:, None, None]
    label = teacher.greedy[rows][b, at]  # [B, A, gamma]
    target_logp = teacher.logp[rows][b, at]  # [B, A, gamma, V]
    prev = torch.cat([ids.gather(1, anchors)[..., None], label[..., :-1]], dim=-1)
    logits = head.markov(base, prev)
    logp = logits.log_softmax(-1)
    loss = F.nll_loss(logp.flatten(0, 2), label.flatten())
    kl = F.kl_div(logp.flatten(0, 2), target_logp.flatten(0, 2), log_target=True,
                  reduction="batchmean")  # fmt: skip
    hit = (logits.argmax(-1) == label).float()
    conf = head.confidence_logit(h.detach(), prev)
    bce = F.binary_cross_entropy_with_logits(conf, hit)
    accepted = hit.cumprod(-1).sum(-1)
    return loss + args.distill * kl + args.confidence * bce, accepted


def sample_anchors(n: int, first: int, last: int, per: int, gen: torch.Generator) -> torch.Tensor:
    """[n, per] anchor positions in [first, last], distinct and sorted per sequence."""
    draws = torch.rand(n, last - first + 1, generator=gen).argsort(-1)[:, :per]
    return (draws + first).sort(-1).values


@torch.no_grad()
def heldout_acceptance(head, main, teacher: Teacher, rows: torch.Tensor, args) -> dict:
    """Greedy drafting as the engine does (the Markov head fed its own drafts) at every anchor
    of the held-apart sequences: mean acceptance length (1 + accepted) and per position."""
    first, last = args.prompt_bytes + 1, teacher.ids.shape[1] - 1 - args.gamma
    anchors = torch.arange(first, last + 1)
    total, per_pos, blocks = 0.0, torch.zeros(args.gamma), 0
    for r in rows.split(4):
        a = anchors.expand(len(r), -1)
        h, base = head(main, teacher.taps[r], teacher.ids[r], a, args.gamma)
        flat_h, flat_base = h.flatten(0, 1), base.flatten(0, 1)
        drafts, _ = head.draft(flat_h, flat_base, teacher.ids[r].gather(1, a).flatten(), 262)
        at = a[..., None] + torch.arange(args.gamma)
        label = teacher.greedy[r][torch.arange(len(r))[:, None, None], at].flatten(0, 1)
        ok = (drafts == label).float().cumprod(-1)
        total += ok.sum().item()
        per_pos += ok.sum(0)
        blocks += ok.shape[0]
    return {
        "mean_acceptance_length": round(1 + total / blocks, 4),
        "acceptance_per_position": [round(v / blocks, 4) for v in per_pos.tolist()],
        "blocks": blocks,
    }


def _stored(name: str, t: torch.Tensor) -> torch.Tensor:
    """bf16 as V4 stores matrices; fp32 where the release keeps fp32 (mHC, sinks, norms,
    biases, the confidence head)."""
    keep = ("hc_", "attn_sink", "gate.bias", "norm", "confidence_head")
    fp32 = any(s in name for s in keep) or t.dtype == torch.int64
    return t.contiguous() if t.dtype == torch.int64 else (
        t.float() if fp32 else t.to(torch.bfloat16)).contiguous()  # fmt: skip


def write_checkpoint(src: Path, out: Path, head, fields: dict, log: dict) -> None:
    """The demo model's files with the head's tensors (and no MTP layer), its config's
    dspark_* fields, and the run's log."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in (
            "model.safetensors",
            "config.json",
            "README.md",
            "train_log.json",
            "loss.png",
        ):  # fmt: skip  (the tokenizer's files, generation config)
            shutil.copy(f, out / f.name)
    main = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
            if not k.startswith("mtp.")}  # fmt: skip
    tensors = {k: _stored(k, v) for k, v in head.release_tensors().items()}
    save_file({**main, **tensors}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text()) | fields
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")


def record(main_dir: Path, variant: Path, bench_json: Path | None) -> None:
    """The demo model's log and card: the DSpark run (the variant's log) and, when given,
    bench/spec_decode.py's acceptance of both heads (its DSpark rows and MTP's K=2)."""
    run = json.loads((variant / "train_log.json").read_text())
    config = json.loads((variant / "config.json").read_text())
    summary = {
        "args": run["args"], "data": run["data"], "heldout": run["heldout"],
        "steps": run["steps"], "train_s": run["train_s"], "runs": run.get("runs", []),
        "taps": config["dspark_target_layer_ids"],
        "noise_token_id": config["dspark_noise_token_id"],
    }  # fmt: skip
    log = json.loads((main_dir / "train_log.json").read_text())
    if bench_json is not None:
        bench = json.loads(bench_json.read_text())
        names = {"K=2": "MTP, K = 2", "dspark g=5": "DSpark, gamma 5, whole block",
                 "dspark g=5 conf": "DSpark, gamma 5, by confidence"}  # fmt: skip
        summary["acceptance"] = {
            "command": f"`python -m bench.spec_decode`, {bench['args']['prompts']} prompts of "
            f"{bench['args']['prompt_bytes']} bytes, {bench['args']['max_tokens']} tokens each",
            "rows": {names[k]: bench["rows"][k] for k in names},
        }
    elif "acceptance" in log.get("dspark", {}):
        summary["acceptance"] = log["dspark"]["acceptance"]
    log["dspark"] = summary
    (main_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    write_card(main_dir / "README.md", log)


def main(argv: list[str] | None = None) -> None:
    from transformers import DeepseekV4ForCausalLM

    try:
        from tests.dspark_reference import DSparkReference
    except ImportError:  # run as a script: the repository root is not on sys.path
        import sys

        sys.path.insert(0, str(REPO))
        from tests.dspark_reference import DSparkReference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "dsaserve/engine/assets/dsaserve-demo-v4"))
    p.add_argument("--out", default=str(REPO / "dsaserve/engine/assets/dsaserve-demo-v4-dspark"))
    p.add_argument("--data", default=str(REPO / "data" / "tinyshakespeare.txt"))
    p.add_argument("--layers", type=int, default=1, help="draft layers (V4-Flash's head: 3)")
    p.add_argument("--gamma", type=int, default=5, help="block size (the release's: 5)")
    p.add_argument("--rank", type=int, default=64, help="the Markov head's rank")
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--heldout", type=int, default=16, help="sequences held apart to measure")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompt-bytes", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--anchors", type=int, default=12, help="blocks per sequence per step")
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--time-budget-s", type=float, default=240.0, help="of training alone")
    p.add_argument(
        "--data-cache",
        help="a file the greedy continuations and the model's outputs over them are kept in "
        "(made if missing): runs that only change the training (or --resume) reuse them",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--distill", type=float, default=1.0, help="weight of the KL to the model")
    p.add_argument("--confidence", type=float, default=0.3, help="weight of the confidence loss")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--resume", action="store_true", help="go on from the head already in --out, if any"
    )
    p.add_argument(
        "--record-acceptance",
        metavar="BENCH_JSON",
        help="no training: put bench/spec_decode.py's figures into the demo model's card",
    )
    args = p.parse_args(argv)
    if args.record_acceptance:
        record(Path(args.model), Path(args.out), Path(args.record_acceptance))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    src, out = Path(args.model), Path(args.out)
    target = DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    target.requires_grad_(False)
    n_layers = target.config.num_hidden_layers
    taps = list(range(max(0, n_layers - 3), n_layers))
    head = DSparkReference(target.config, args.layers, taps, args.rank, NOISE)
    init_from_main(head, target)
    before: dict = {}
    if args.resume and (out / "model.safetensors").exists():
        head.load_release(out)
        before = json.loads((out / "train_log.json").read_text())
        print(f"resuming from the head in {out} ({before.get('steps', 0)} steps)", flush=True)
    data = Path(args.data).read_bytes()
    split = len(data) - int(len(data) * 0.05)  # the main model's held-out 5 %, never used here
    train_bytes = torch.frombuffer(bytearray(data[:split]), dtype=torch.uint8)
    gen_args = argparse.Namespace(
        seq_len=args.seq_len, mtp_prompt_bytes=args.prompt_bytes, seed=args.seed
    )
    cache = Path(args.data_cache) if args.data_cache else None
    if cache is not None and cache.exists():
        teacher = Teacher(**torch.load(cache))
    else:
        n = args.sequences + args.heldout
        sequences = greedy_continuations(src, train_bytes, n, gen_args)
        teacher = Teacher.compute(target, head, sequences, 16)
        if cache is not None:
            torch.save({"sequences": sequences, "taps": teacher.taps, "logp": teacher.logp}, cache)
    sequences = teacher.ids
    n_train = args.sequences
    held = torch.arange(n_train, n_train + args.heldout)
    log: dict = {"args": vars(args), "train": [], "heldout": []}
    log["data"] = {"sequences": n_train, "heldout_sequences": args.heldout,
                   "prepared_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    print(f"data {log['data']}", flush=True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 5)
    first, last = args.prompt_bytes + 1, sequences.shape[1] - 1 - args.gamma
    t1, step = time.monotonic(), 0
    budget = args.time_budget_s
    while time.monotonic() - t1 < budget and step < args.steps:
        done = max(step / args.steps, (time.monotonic() - t1) / budget)
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * done))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.randint(0, n_train, (args.batch_size,), generator=gen)
        anchors = sample_anchors(len(rows), first, last, args.anchors, gen)
        loss, accepted = block_loss(head, target, teacher, rows, anchors, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            entry = {"step": step, "loss": round(loss.item(), 4),
                     "acceptance_length": round(1 + accepted.mean().item(), 3),
                     "elapsed_s": round(time.monotonic() - t1, 1)}  # fmt: skip
            log["train"].append(entry)
            print(entry, flush=True)
    head.eval()
    log["heldout"] = heldout_acceptance(head, target, teacher, held, args)
    # (a resumed run adds to the runs before it: steps and seconds count all of them)
    run = {"steps": step, "train_s": round(time.monotonic() - t1, 1), "resumed": bool(before)}
    log["runs"] = [*before.get("runs", []), run]
    log["train"] = before.get("train", []) + log["train"]
    log["steps"] = sum(r["steps"] for r in log["runs"])
    log["train_s"] = round(sum(r["train_s"] for r in log["runs"]), 1)
    log["total_s"] = round(time.monotonic() - t0, 1)
    print(f"heldout {log['heldout']}", flush=True)
    fields = {
        "dspark_block_size": args.gamma,
        "dspark_markov_rank": args.rank,
        "dspark_noise_token_id": NOISE,
        "dspark_target_layer_ids": taps,
        "dspark_num_layers": args.layers,
        "num_nextn_predict_layers": 1,  # (as V4-Flash-0731's config says; dspark_* decide)
    }
    write_checkpoint(src, out, head, fields, log)
    (out / "README.md").write_text(VARIANT_CARD)
    record(src, out, None)
    print(f"written to {out}; {src / 'README.md'} has its figures", flush=True)


if __name__ == "__main__":
    main()
