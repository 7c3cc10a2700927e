"""Speculative decoding with the demo model's draft heads on a CPU (or a GPU): acceptance, steps.

    python -m bench.spec_decode --out bench/results/cpu-spec-decode.json
    python -m bench.spec_decode --device cuda --out bench/results/h200-spec-decode.json

For K = 0 (no speculation), 1, 2, 3 (and the adaptive rule at K = 3) with the MTP layer, and
gamma = 5 with the DSpark head (dsaserve-demo-v4-dspark: the same main model), its whole block
verified every step ("fixed") and verified by confidence ("adaptive"), the demo model continues
held-out Shakespeare greedily, one request at a time (prompts: the first --prompt-bytes of
held-out windows, --max-tokens each): the mean acceptance length (tokens a verifying step emits:
1 + accepted drafts, vLLM's figure), the acceptance rate of each draft position, decode steps
per output token (target forward steps after the prompt's, over the tokens after the first) and
wall time per output token, each against K = 0 in the same run. Greedy tokens must equal K = 0's
on the CPU (the run fails otherwise); in bf16 on a GPU their agreement is reported. Wall times
on a CPU say little about a GPU (the MTP layer is a fifth of this model's layers, and a step's
fixed costs dominate at this size): the steps are the figure that carries over.

    python -m bench.spec_decode --served 2

The same prompts through `dsaserve up --speculative-config '{"method": "mtp",
"num_speculative_tokens": 2}'` (every other flag at its default), one request at a time: the
acceptance the decode worker's `dsaserve_spec_decode_*` counters give (vLLM's figure, 1 +
accepted / drafts), and the greedy tokens of K = 0, offline.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import openai

from bench.harness import prologue, write_record
from bench.numerics import BOS, greedy_agreement, heldout_windows
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_DSPARK_MODEL_DIR, DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams
from loadtest.up_stack import UpStack


def run(spec: dict | None, prompts: list[list[int]], max_tokens: int, device: str = "cpu") -> dict:
    model = DEMO_DSPARK_MODEL_DIR if spec and spec["method"] == "dspark" else DEMO_MODEL_DIR
    engine = LLMEngine(
        model,
        EngineConfig(
            device=device,
            dtype="float32" if device == "cpu" else "bfloat16",
            max_num_seqs=4,
            # (a fixed budget: the default share of free memory read 0 MiB on an H200 just after
            # bench.full_depth's process had held 110 GB of it)
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
            speculative_config=json.dumps(spec) if spec else None,
        ),
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens, steps, outputs, seconds = [], 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        got: list[int] = []
        first = True
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_token_ids
            if first:  # the prompt's step(s) end with the first token
                first = not got
                t0 = time.perf_counter() if got else t0
                continue
            steps += 1
        seconds += time.perf_counter() - t0
        outputs += len(got) - 1
        tokens.append(got)
    row = {
        "decode_steps_per_output_token": round(steps / outputs, 4),
        "seconds_per_output_token": round(seconds / outputs, 5),
        "tokens": tokens,
    }
    spec_stats = engine.speculator.stats if engine.speculator else None
    if spec_stats is not None:
        row["mean_acceptance_length"] = round(spec_stats.mean_acceptance_length, 4)
        row["acceptance_per_position"] = [
            round(a / max(spec_stats.num_drafts, 1), 4) for a in spec_stats.accepted_per_pos
        ]
        row["verified_per_position"] = list(spec_stats.drafts_per_pos)
        row["drafts"] = spec_stats.num_drafts
    return row


def served(k: int, prompts: list[list[int]], max_tokens: int, want: list[list[int]]) -> dict:
    """Greedy completions through `dsaserve up` speculating with K = k: the acceptance its
    decode worker counts. Its tokens must be `want` (the run fails otherwise)."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    with tempfile.TemporaryDirectory() as logs:
        with UpStack(["--speculative-config", spec], Path(logs) / "up.log") as stack:
            with openai.OpenAI(base_url=stack.url + "/v1", api_key="none") as client:
                for prompt, tokens in zip(prompts, want, strict=True):
                    r = client.completions.create(
                        model=DEMO_MODEL_DIR.name,
                        prompt=prompt,
                        max_tokens=max_tokens,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    text = bytes(t for t in tokens if t < 256).decode(errors="replace")
                    assert r.choices[0].text == text, "greedy tokens differ"
            drafts = stack.metric("decode", "dsaserve_spec_decode_num_drafts_total")
            name = "dsaserve_spec_decode_num_accepted_tokens_per_pos_total"
            per_pos = [stack.metric("decode", name, position=str(i)) for i in range(k)]
    return {
        "mean_acceptance_length": round(1 + sum(per_pos) / drafts, 4),
        "acceptance_per_position": [round(a / drafts, 4) for a in per_pos],
        "drafts": drafts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-bytes", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--device",
        default="cpu",
        help="cuda: bf16 on the GPU (K=0 replays CUDA graphs, drafts and verifies run eagerly); "
        "bf16 tokens may part from K=0's at a near-tie, so there they are compared, not asserted",
    )
    p.add_argument("--served", type=int, default=0, help="K through dsaserve up (0: offline)")
    args = p.parse_args()
    prompts = [[BOS, *w[: args.prompt_bytes]] for w in heldout_windows(args.prompts)]
    if args.served:
        want = run(None, prompts, args.max_tokens)["tokens"]
        row = served(args.served, prompts, args.max_tokens, want)
        print(
            f"dsaserve up, K={args.served}: acceptance length {row['mean_acceptance_length']:.3f}, "
            f"by position {row['acceptance_per_position']}, {row['drafts']:.0f} drafts"
        )
        record = {**prologue("cpu"), "bench": "spec_decode", "args": vars(args), "served": row}
        write_record(args.out, record)
        return
    configs: list[tuple[str, dict | None]] = [("K=0", None)] + [
        (f"K={k}", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)
    ]
    configs.append(
        ("adaptive K<=3", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True})
    )
    dspark = {"method": "dspark", "num_speculative_tokens": 5}
    configs += [("dspark g=5", dspark), ("dspark g=5 conf", {**dspark, "adaptive": True})]
    rows = {}
    for name, spec in configs:
        rows[name] = run(spec, prompts, args.max_tokens, args.device)
        same = greedy_agreement(rows[name]["tokens"], rows["K=0"]["tokens"])
        rows[name]["greedy_agreement_vs_k0"] = same
        assert same == 1.0 or args.device != "cpu", f"{name}: greedy tokens differ"
    base = rows["K=0"]
    print(f"{'config':>15} {'accept len':>10} {'per position':>38} {'steps/token':>11} "
          f"{'s/token':>9} {'vs K=0':>7}")  # fmt: skip
    for name, row in rows.items():
        ratio = row["seconds_per_output_token"] / base["seconds_per_output_token"]
        row["seconds_vs_k0"] = round(ratio, 3)
        print(
            f"{name:>15} {row.get('mean_acceptance_length', 1.0):>10.3f} "
            f"{str(row.get('acceptance_per_position', '-')):>38} "
            f"{row['decode_steps_per_output_token']:>11.3f} "
            f"{row['seconds_per_output_token']:>9.4f} {ratio:>7.3f}"
        )
    for row in rows.values():
        del row["tokens"]
    write_record(
        args.out,
        {
            **prologue(args.device),
            "bench": "spec_decode",
            "args": vars(args),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
