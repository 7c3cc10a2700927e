#!/usr/bin/env python3
"""Train the demo model's multi-token-prediction (MTP) layer, the draft head of speculative
decoding, on top of the trained and frozen main model, and add it to the checkpoint.

The objective is what speculative decoding checks: a draft is accepted when it is the main
model's own greedy token, on text the main model wrote itself. So the layer trains on the main
model's greedy continuations (by the engine) of --mtp-prompt-bytes of training text from random
places (bench/spec_decode.py's prompts are that long, from the held-out text, which is never
used here), --seq-len tokens in all; 1/16 more sequences are held apart to measure agreement.
The main model's streams and distributions over them are computed once (it is frozen).

At position t the layer reads the main model's last-layer streams h_t and the embedding of token
t+1, and drafts token t+2 (pass 1): the loss is the cross-entropy to the main model's greedy
token there plus (--mtp-distill) the KL to its distribution. The engine applies the layer again
for a K > 1 draft (pass 2): at t+1, fed its own pass-1 streams of t and token t+2, attending to
the pass-1 state before t+1 and to its own; training unrolls it the same way (one forward over
the pass-1 and pass-2 rows with that mask) and adds the loss of the draft of token t+3, weighted
--mtp-second-pass.

The layer is HF transformers' DeepSeek-V4 decoder layer (sliding-window attention, score-routed
MoE: the kinds the engine gives an MTP layer by default) between the release's
e_proj/h_proj/enorm/hnorm and its own mHC head and norm; the embedding and LM head are the main
model's. It starts from the main model's own pieces (attention of the sliding layer 0, MoE and
mHC of the last layer, the head's mHC collapse and norm), h_proj at identity: it starts as "what
the main model would say next" and learns the step after; or (--resume) from the checkpoint's.

The tensors are written under the release's names (`mtp.0.*`, what engine.models.deepseek_v4
loads) next to the main model's, which are not changed, and config.json gets
`num_nextn_predict_layers: 1`.

    python3 -m scripts.demo_mtp --model engine/assets/dsaserve-demo-v4 --mtp-time-budget-s 900
scripts/train_demo_model.py runs it after the main model's training (--mtp-time-budget-s).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
BOS = 256  # the demo tokenizer's (scripts/train_demo_model.py)


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

    def block(self, main, streams, ids, rope: dict, positions, mask) -> torch.Tensor:
        """One application: streams [B, N, hc, H] (the main model's, or this layer's own) and
        the ids [B, N] of the token after each row -> this layer's streams [B, N, hc, H]."""
        e = self.e_proj(self.enorm(main.model.embed_tokens(ids)))
        x = e.unsqueeze(2) + self.h_proj(self.hnorm(streams))
        return self.layer(
            x, input_ids=ids, position_embeddings=rope, position_ids=positions, attention_mask=mask
        )

    def logits(self, main, out: torch.Tensor) -> torch.Tensor:
        """This layer's streams [B, N, hc, H] -> draft logits [B, N, V]."""
        return main.lm_head(self.norm(self.hc_head(out)))

    def unrolled(
        self, main, streams, next_ids, rope: dict, second: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The engine's passes over a sequence of T rows: streams [B, T, hc, H] of the main
        model at positions t, next_ids [B, T] tokens t+1. Pass 1 -> logits [B, T, V] of tokens
        t+2. With `second`, pass 2 as the engine runs it (engine.speculative.mtp_drafter):
        at position t+1 the layer is fed its own pass-1 streams of t and token t+2,
        and attends to pass-1 rows before t+1 and to itself -> logits [B, T-2, V] of tokens
        t+3 (t < T-2); else None."""
        T = next_ids.shape[1]
        pos = torch.arange(T, device=next_ids.device)
        window = self.layer_config.sliding_window
        out1 = self.block(main, streams, next_ids, _at(rope, pos), pos[None], _mask(pos, T, window))
        if not second:
            return self.logits(main, out1), None
        rows = torch.cat([pos, pos[1:-1]])  # pass-1 rows, then pass-2 rows at 1..T-2
        both = self.block(
            main,
            torch.cat([streams, out1[:, :-2]], 1),
            torch.cat([next_ids, next_ids[:, 1:-1]], 1),
            _at(rope, rows),
            rows[None],
            _mask(rows, T, window),
        )
        return self.logits(main, both[:, :T]), self.logits(main, both[:, T:])


def _at(rope: dict, rows: torch.Tensor) -> dict:
    """The main model's RoPE tables ({kind: (cos, sin) [1, T, d]}) at positions rows [N]."""
    return {kind: (cos[:, rows], sin[:, rows]) for kind, (cos, sin) in rope.items()}


def _mask(rows: torch.Tensor, first: int, window: int) -> torch.Tensor:
    """Additive attention mask [1, 1, N, N] over rows at positions rows [N] whose first `first`
    are pass-1 rows (causal, sliding window) and the rest pass-2 rows: a pass-2 row sees the
    pass-1 rows before its position and itself (the KV state the engine's pass 2 finds)."""
    n = rows.numel()
    q, k = rows[:, None], rows[None, :]
    pass1_key = torch.arange(n, device=rows.device)[None, :] < first
    pass1_query = torch.arange(n, device=rows.device)[:, None] < first
    seen = pass1_key & (k <= q) & (pass1_query | (k < q)) & (q - k < window)
    seen |= torch.eye(n, dtype=torch.bool, device=rows.device)
    mask = torch.zeros(n, n, device=rows.device).masked_fill(~seen, float("-inf"))
    return mask[None, None]


@torch.no_grad()
def main_outputs(main, inputs: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The frozen main model over inputs [B, T]: (its last layer's streams [B, T, hc, H], its
    RoPE tables {kind: (cos, sin)}, its logits [B, T, V])."""
    seen: dict = {}

    def grab(module, args, kwargs):
        seen["rope"] = kwargs["position_embeddings"]

    def keep(module, args, kwargs, output):
        seen["streams"] = output

    last = main.model.layers[-1]
    hooks = [
        last.register_forward_pre_hook(grab, with_kwargs=True),
        last.register_forward_hook(keep, with_kwargs=True),
    ]
    try:
        logits = main(input_ids=inputs, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return seen["streams"], seen["rope"], logits


def greedy_continuations(model_dir: Path, train_bytes: torch.Tensor, n: int, args) -> torch.Tensor:
    """n sequences [n, seq_len + 1]: bos, --mtp-prompt-bytes bytes of training text from random
    places, then the main model's greedy continuation by the engine (what drafts are verified
    against, and the text the drafts are made on)."""
    from dsaserve.engine.config import EngineConfig
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine.sampling_params import SamplingParams

    prompt = _prompt_bytes(args)
    new = args.seq_len - prompt  # tokens after bos + prompt, to seq_len + 1 in all
    gen = torch.Generator().manual_seed(args.seed + 11)
    starts = torch.randint(0, train_bytes.numel() - prompt, (n,), generator=gen).tolist()
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=64, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, s in enumerate(starts):
        ids = [BOS, *train_bytes[s : s + prompt].tolist()]
        got[str(i)] = ids
        engine.add_request(str(i), ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = got[out.request_id] + out.new_token_ids
    return torch.tensor([got[str(i)] for i in range(n)])


def _prompt_bytes(args) -> int:
    """--mtp-prompt-bytes, or half the sequence where that is shorter (smoke runs)."""
    return min(args.mtp_prompt_bytes, args.seq_len // 2)


class Teacher:
    """The main model's outputs over a set of sequences [n, T + 1], computed once (the main
    model is frozen): streams [n, T, hc, H], its greedy token after each row [n, T] and its
    log-probabilities [n, T, V] (what the drafts are verified against)."""

    def __init__(self, main, sequences: torch.Tensor, batch: int) -> None:
        device = next(main.parameters()).device
        self.ids = sequences.to(device)
        streams, logp = [], []
        for i in range(0, len(sequences), batch):
            s, self.rope, logits = main_outputs(main, self.ids[i : i + batch, :-1])
            streams.append(s)
            logp.append(logits.float().log_softmax(-1))
        self.streams, self.logp = torch.cat(streams), torch.cat(logp)
        self.greedy = self.logp.argmax(-1)

    def loss(self, mtp: MTP, main, rows: torch.Tensor, args) -> tuple[torch.Tensor, list]:
        """The drafting loss of sequences `rows` and each pass's agreement with the main
        model's greedy token (on the generated rows, past the prompt)."""
        ids = self.ids[rows]
        logits1, logits2 = mtp.unrolled(
            main, self.streams[rows], ids[:, 1:], self.rope, args.mtp_second_pass > 0
        )
        first = _prompt_bytes(args) + 1  # the first generated token (bos and prompt before)
        loss, agree = 0.0, []
        for shift, logits, weight in ((1, logits1, 1.0), (2, logits2, args.mtp_second_pass)):
            if logits is None:
                continue
            # draft i of this pass is of token i + 1 + shift: the teacher's row i + shift
            # (pass 1's last row drafts past the sequence)
            draft = logits[:, : logits.shape[1] - (shift == 1)].float().log_softmax(-1)
            teacher = self.logp[rows][:, shift : shift + draft.shape[1]]
            greedy = self.greedy[rows][:, shift : shift + draft.shape[1]]
            term = F.nll_loss(draft.flatten(0, 1), greedy.flatten())
            if args.mtp_distill:
                term = term + args.mtp_distill * F.kl_div(
                    draft.flatten(0, 1), teacher.flatten(0, 1), log_target=True,
                    reduction="batchmean",
                )  # fmt: skip
            loss = loss + weight * term
            # agreement on drafts of generated tokens after the first (the target emits that
            # one itself, after the prompt), as the engine drafts them
            hit = draft.argmax(-1) == greedy
            agree.append(hit[:, first - shift :].float().mean().item())
        return loss, agree


def train_mtp(main, train_bytes: torch.Tensor, args, log: dict, model_dir: Path):
    """Train an MTP layer for `main` (frozen; its checkpoint in model_dir, which the engine
    continues text with) on greedy continuations of train_bytes (uint8, on the CPU); returns
    it. args: mtp_time_budget_s, mtp_steps, mtp_lr, mtp_distill, mtp_second_pass,
    mtp_sequences, mtp_prompt_bytes, batch_size, seq_len, seed, and resume + model (a
    checkpoint to go on from)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    t0 = time.monotonic()
    for p in main.parameters():
        p.requires_grad_(False)
    main.eval()
    device = next(main.parameters()).device
    mtp = MTP(main, m.DeepseekV4DecoderLayer, m.DeepseekV4HyperHead, m.DeepseekV4RMSNorm)
    log["mtp"] = {"train": [], "heldout": []}
    if getattr(args, "resume", False) and resume(mtp, m.DeepseekV4ForCausalLM, Path(args.model)):
        print("resuming from the checkpoint's MTP layer", flush=True)
        log["mtp"]["resumed"] = True
    mtp = mtp.to(device)
    # Every sequence is seen about once when the steps bound the run (smoke runs), a few
    # times in a long one; 1/16 more (at least one batch) is kept apart to measure agreement.
    n_train = max(1, min(args.mtp_sequences, args.mtp_steps * args.batch_size))
    n_held = max(args.batch_size, n_train // 16)
    sequences = greedy_continuations(model_dir, train_bytes, n_train + n_held, args)
    teacher = Teacher(main, sequences, args.batch_size)
    rows_held = torch.arange(n_train, n_train + n_held, device=device)
    log["mtp"]["data"] = {
        "sequences": n_train,
        "heldout_sequences": n_held,
        "prompt_bytes": _prompt_bytes(args),
        "tokens": args.seq_len + 1,
        "prepared_s": round(time.monotonic() - t0, 1),
    }
    print(f"mtp data {log['mtp']['data']}", flush=True)
    params = [p for n, p in mtp.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(params, lr=args.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 7)
    t1, step = time.monotonic(), 0
    budget = args.mtp_time_budget_s - (t1 - t0)
    while time.monotonic() - t1 < budget and step < args.mtp_steps:
        # linear warm-up, then cosine to a tenth over the steps or the time, whichever ends first
        done = max(step / args.mtp_steps, (time.monotonic() - t1) / budget)
        lr = args.mtp_lr * min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * done))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.randint(0, n_train, (args.batch_size,), generator=gen).to(device)
        loss, agree = teacher.loss(mtp, main, rows, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                # how often pass 1 (pass 2) drafts the main model's own greedy token
                "agrees_with_main": [round(a, 4) for a in agree],
                "elapsed_s": round(time.monotonic() - t1, 1),
            }
            log["mtp"]["train"].append(entry)
            print(f"mtp {entry}", flush=True)
        if step % args.mtp_eval_every == 0:
            _heldout(mtp, main, teacher, rows_held, args, log["mtp"]["heldout"], step)
    if not log["mtp"]["heldout"] or log["mtp"]["heldout"][-1]["step"] != step:
        _heldout(mtp, main, teacher, rows_held, args, log["mtp"]["heldout"], step)
    log["mtp"]["steps"] = step
    return mtp


@torch.no_grad()
def _heldout(
    mtp: MTP, main, teacher: Teacher, rows: torch.Tensor, args, into: list, step: int
) -> None:
    """Appends to `into` the agreement of each pass with the main model's greedy token on the
    held-apart sequences."""
    sums: list[float] = []
    batches = rows.split(args.batch_size)
    for batch in batches:
        _, agree = teacher.loss(mtp, main, batch, args)
        sums = [s + a for s, a in zip(sums, agree, strict=True)] if sums else agree
    into.append({"step": step, "agrees_with_main": [round(s / len(batches), 4) for s in sums]})
    print(f"mtp heldout {into[-1]}", flush=True)


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
        help="weight of the KL to the main model's distribution (0: its greedy token only)",
    )
    p.add_argument(
        "--mtp-second-pass",
        type=float,
        default=0.5,
        help="weight of the second draft's loss (the layer fed its own streams; 0: not trained)",
    )
    p.add_argument(
        "--mtp-sequences",
        type=int,
        default=1024,
        help="greedy continuations to train on (at most steps x batch; 1/16 more held apart)",
    )
    p.add_argument(
        "--mtp-prompt-bytes",
        type=int,
        default=64,
        help="training text each continuation starts from (bench/spec_decode.py's prompts)",
    )
    p.add_argument("--mtp-eval-every", type=int, default=100, help="steps between agreements")


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
    p.add_argument("--model", default=str(REPO / "dsaserve/engine/assets/dsaserve-demo-v4"))
    p.add_argument("--data", default=str(REPO / "data" / "tinyshakespeare.txt"))
    add_mtp_args(p, 900)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
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
    mtp = train_mtp(main_model, train_bytes, args, log, out)
    add_to_checkpoint(out, mtp_tensors(mtp, DeepseekV4ForCausalLM))
    train_log = out / "train_log.json"
    full = json.loads(train_log.read_text()) if train_log.exists() else {}
    before = full.get("mtp", {}) if log["mtp"].get("resumed") else {}
    run = {"steps": log["mtp"]["steps"], "resumed": bool(log["mtp"].get("resumed"))}
    full["mtp"] = {
        **log["mtp"],
        "train": before.get("train", []) + log["mtp"]["train"],  # (steps count on from before)
        "steps": before.get("steps", 0) + log["mtp"]["steps"],
        "runs": [  # each run's arguments, the earlier ones' too
            *before.get("runs", []),
            {**run, "args": {k: v for k, v in vars(args).items() if k != "model"}},
        ],
    }
    train_log.write_text(json.dumps(full, indent=2) + "\n")
    print(f"MTP layer written to {out}", flush=True)


if __name__ == "__main__":
    main()
