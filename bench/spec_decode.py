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
"""

from __future__ import annotations

import argparse
import json
import time

from bench.harness import prologue, write_record
from bench.numerics import BOS, greedy_agreement, heldout_windows
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_DSPARK_MODEL_DIR, DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams


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
    args = p.parse_args()
    prompts = [[BOS, *w[: args.prompt_bytes]] for w in heldout_windows(args.prompts)]
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
