"""GPU benchmark of DeepSeek-V4.1's decode step on a V4.1-Flash-width slice, its Engram tables
in host memory.

    python -m bench.v41_slice --out bench/results/h200-v41-slice.json
    python -m bench.v41_slice --smoke          # CPU: tiny widths through the same code

The slice has V4.1-Flash's widths (hidden 5120, 64 heads x 512, q_lora 1280, o_lora 1024 in 8
groups, window 128, indexer 32 x 128 with top-512 inside 2048 candidate blocks of 8, MoE 2304
wide with top-6, mHC x4, vocab 129280; Engram 2-4-grams x 8 heads of 256-wide rows;
shared/reference/v41-dspark.md section 1.3) and each of its kinds of layer, eight of forty: two
window-only layers (Engram on the second, as on V4.1's layer 1), a ratio-2 KV source and a layer
reading its entries, a second ratio-2 source with Engram (as layer 14), the ratio-1 source that
picks the candidate blocks (as layer 20), then the decoder: an index source scoring inside the
candidates (as 24) and a layer reusing its picks. Fewer routed experts (--experts), random bf16
weights (a GPU computes V4.1 dequantized: engine.models.deepseek_v41.weights says why).

Engram's tables hold --engram-rows rows each (V4.1-Flash's hold 384 M, 98 GB apiece: more than
this machine's host memory for two) in the release's format (FP8 rows, a ue8m0 scale per 32), in
host memory behind the device cache of hot rows, attached as the loader attaches a checkpoint's
(weights.attach_engram): every lookup of the step goes through the serving path. Tokens are a
Zipfian stream (exponent --zipf over a random ranking of the vocabulary), prompts and decoded
tokens alike: a decode step feeds the stream's next token, not the random model's sample, so the
n-grams recur as text's do; each request's prompt is looked up once before it decodes (the cache
as its prefill would leave it; the pool's KV history is synthetic, as in bench.engine).

Phases:
1. correctness: the slice's decode and prefill logits, Triton path against the plain-torch
   reference backend (bench.engine.check_against_reference).
2. decode: tokens/s and ms per step at concurrency 1, 16, 64 and context 8K, 32K (eager: V4.1's
   decode steps are not captured).
3. engram: `dsaserve profile` of a decode step at c=64, 32K: the share of the step in Engram's
   lookups (the `engram_lookup` range: the target is <= 10%) and in all of Engram (hashes, rows,
   gates), the cache's hit rate over the profiled steps; then the same with the device cache off
   (every row read across PCIe: the worst case).
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from bench.engine import Bench, check_against_reference
from bench.fake_quant import layer_labels
from bench.harness import prologue, write_record
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.models.deepseek_v41.engram import bucket_primes
from dsaserve.engine.models.deepseek_v41.engram_table import (
    DEVICE_CACHE_BYTES,
    SCALE_GROUP,
    cache_slots,
)
from dsaserve.engine.models.deepseek_v41.model import DeepseekV41
from dsaserve.engine.models.deepseek_v41.weights import attach_engram
from dsaserve.engine.profile import hardware
from dsaserve.engine.profile.decode import profile_decode
from dsaserve.engine.profile.report import format_table
from dsaserve.engine.request import Request

# DeepSeek-V4.1-Flash's text_config widths (shared/reference/v41-dspark.md section 1.3)
V41_WIDTHS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "moe_intermediate_size": 2304,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1 << 20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
}
# Its kinds of layer, eight of forty (the module docstring)
TOPOLOGY: dict[str, Any] = {
    "num_hidden_layers": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 6],
    "candidate_source_layer_id": 5,
    "engram_layer_ids": [1, 4],
}
# --smoke: widths a CPU runs in seconds
SMOKE_WIDTHS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "moe_intermediate_size": 128,
    "num_experts_per_tok": 2,
    "sliding_window": 16,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 16,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 8,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "engram_compressed_vocab_size": 800,
}
KV_BYTES = 8 << 30  # 64 requests of 32K tokens need ~5.4 GB of the slice's pages
MAX_SEQS = 72


def slice_config(num_experts: int, engram_rows: int, smoke: bool = False) -> ModelConfig:
    """The slice's config: V4.1-Flash's widths (or the smoke ones), TOPOLOGY, `num_experts`
    routed experts and Engram tables of about `engram_rows` rows (the hash's primes sized to
    them; each table exactly its buckets, as the release's)."""
    text = V41_WIDTHS | TOPOLOGY | (SMOKE_WIDTHS if smoke else {})
    text["n_routed_experts"] = num_experts
    cols = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
    # cols primes just above engram_vocab_size fill a table of about engram_rows
    text["engram_vocab_size"] = engram_rows // cols - 2 * cols
    text["engram_num_embeddings"] = [0, 0]  # (the layout's sizes, filled in from its primes)
    layout = ModelConfig.from_hf({"model_type": "deepseek_v41", "text_config": text}).engram
    assert layout is not None
    text["engram_num_embeddings"] = [sum(p) for p in bucket_primes(layout)]
    return ModelConfig.from_hf({"model_type": "deepseek_v41", "text_config": text})


def host_tables(cfg: ModelConfig, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random Engram tables in the release's format, in host memory: per Engram layer, codes
    [rows, head_dim] uint8 (e4m3 bits, NaN codes left out) and scales [rows, head_dim / 32]
    uint8 (ue8m0 around 2^-4). One random block of rows is drawn and repeated: the bytes a
    lookup reads do not change its cost."""
    engram = cfg.engram
    assert engram is not None
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (1 << 16, engram.head_dim), dtype=torch.uint8, generator=gen)
    block[(block & 0x7F) == 0x7F] -= 1  # (e4m3's NaNs)
    tables = []
    for rows in engram.num_embeddings:
        codes = torch.empty(rows, engram.head_dim, dtype=torch.uint8)
        for r0 in range(0, rows, block.shape[0]):
            codes[r0 : r0 + block.shape[0]] = block[: rows - r0]
        scales = torch.randint(
            119, 125, (rows, engram.head_dim // SCALE_GROUP), dtype=torch.uint8, generator=gen
        )
        tables.append((codes, scales))
    return tables


def token_map(cfg: ModelConfig) -> list[int]:
    """A compressed map of the config's size for the random model (the real one normalizes
    the tokenizer's pieces: engine.models.deepseek_v41.engram.compressed_token_map)."""
    assert cfg.engram is not None
    return [i % cfg.engram.compressed_vocab_size for i in range(cfg.vocab_size)]


class ZipfStream:
    """Token ids drawn from a Zipfian law: rank k has weight k^-s, ranks a random permutation
    of the vocabulary (text's n-grams recur; uniform tokens' would not)."""

    def __init__(self, vocab: int, exponent: float, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.weights = torch.arange(1, vocab + 1, dtype=torch.float64) ** -exponent
        self.ranking = torch.randperm(vocab, generator=self.gen)

    def draw(self, n: int) -> list[int]:
        if not n:
            return []
        ranks = torch.multinomial(self.weights, n, replacement=True, generator=self.gen)
        return self.ranking[ranks].tolist()

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from self.draw(4096)


class EngramBench(Bench):
    """bench.engine's Bench with Zipfian tokens: prompts drawn from the stream (each looked up
    once, as its prefill would), and decode steps fed its next tokens."""

    def __init__(
        self, cfg: ModelConfig, stream: ZipfStream, dev: torch.device, kv_bytes: int = KV_BYTES
    ) -> None:
        super().__init__(cfg, MAX_SEQS, kv_bytes, dev)
        self.stream, self.tokens = stream, iter(stream)
        assert isinstance(self.model, DeepseekV41)
        self.tables = host_tables(cfg)
        attach_engram(self.model, self.tables, token_map(cfg))
        self.v41: DeepseekV41 = self.model

    def requests(self, n: int, context: int) -> list[Request]:
        reqs = super().requests(n, context)
        for r in reqs:
            r.prompt_token_ids = self.stream.draw(context)
            self.look_up(r.prompt_token_ids)
        return reqs

    def decode_step(self) -> None:
        super().decode_step()
        for r in self.scheduler.running:
            r.output_token_ids[-1] = next(self.tokens)  # (the sampled token replaced)

    @torch.inference_mode()
    def look_up(self, tokens: list[int], chunk: int = 1 << 16) -> None:
        """Every Engram lookup of a prompt's rows, `chunk` rows at a time."""
        hasher = self.v41.hasher
        assert hasher is not None
        depth = self.cfg.token_lookback
        for start in range(0, len(tokens), chunk):
            ids = torch.tensor(tokens[start : start + chunk], device=self.dev)
            before = tokens[max(0, start - depth) : start]
            lookback = torch.tensor([[-1] * (depth - len(before)) + before], device=self.dev)
            zero = torch.zeros(1, dtype=torch.int64, device=self.dev)
            hashes = hasher(
                ids,
                torch.arange(start, start + len(ids), device=self.dev),
                torch.zeros_like(ids),
                zero + start,
                zero,
                lookback,
            )  # [N, Engram layers, cols]
            for i, engram in enumerate(self.v41.engrams()):
                assert engram.table is not None
                engram.table.lookup(hashes[:, i].reshape(-1))

    def engram_stats(self) -> tuple[int, int]:
        """(lookups, hits) of every table so far."""
        stats = [e.table.stats() for e in self.v41.engrams() if e.table is not None]
        return sum(s[0] for s in stats), sum(s[1] for s in stats)

    def set_engram_cache(self, cache_bytes: int | None) -> None:
        """Empty device caches of `cache_bytes` each (None: the serving default)."""
        budget = DEVICE_CACHE_BYTES.get(self.dev.type, 0) if cache_bytes is None else cache_bytes
        for e in self.v41.engrams():
            assert e.table is not None
            e.table.set_cache(
                cache_slots(e.table.rows, e.table.cache.element_size() * e.table.dim, budget)
            )


def engram_profile(
    bench: EngramBench, n: int, context: int, hw: hardware.Hardware | None, label: str
) -> dict:
    """dsaserve profile of a decode step of n requests at `context`: Engram's share, hit rate."""
    reqs = bench.requests(n, context)
    try:
        before = bench.engram_stats()
        report = profile_decode(
            bench.decode_step,
            bench.runner,
            concurrency=n,
            context=context,
            steps=3,
            hardware=hw,
            setup={"model": "V4.1-Flash-width slice", "dtype": "bf16", "engram cache": label},
        ).as_dict()
        lookups, hits = (a - b for a, b in zip(bench.engram_stats(), before, strict=True))
    finally:
        bench.release(reqs)
    parts, wall = report["parts"], report["profiled_step_ms"]

    def ms(part: str) -> float:
        return parts.get(part, {}).get("ms", 0.0)

    return {
        "step_ms": report["step_ms"],
        "profiled_step_ms": wall,
        "engram_lookup_ms": ms("engram_lookup"),
        "engram_lookup_share": ms("engram_lookup") / wall,
        "engram_ms": ms("engram") + ms("engram_lookup"),
        "engram_share": (ms("engram") + ms("engram_lookup")) / wall,
        "lookups": lookups,  # (of the profiled steps and their warm-up)
        "cache_hit_rate": hits / lookups if lookups else None,
        "profile": report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--engram-rows", type=int, default=1 << 25, help="rows of each table")
    parser.add_argument("--zipf", type=float, default=1.1, help="the token stream's exponent")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny widths: every phase runs, times mean nothing",
    )
    parser.add_argument("--only", nargs="+", choices=("correctness", "decode", "engram"))
    args = parser.parse_args()
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    contexts, concurrency = ((64, 256), (1, 4)) if smoke else ((8192, 32768), (1, 16, 64))
    profile_at = (4, 256) if smoke else (64, 32768)
    rows = 1 << 12 if smoke else args.engram_rows
    cfg = slice_config(args.experts, rows, smoke)
    hw = None if smoke else hardware.measure(dev)
    kv_bytes = (64 << 20) if smoke else KV_BYTES
    bench = EngramBench(cfg, ZipfStream(cfg.vocab_size, args.zipf), dev, kv_bytes)
    steps = 2 if smoke else args.steps
    assert cfg.engram is not None
    result: dict[str, Any] = {
        **prologue(dev),
        "hardware": hw.as_dict() if hw else {},
        "config": {
            "layers": layer_labels(cfg),
            "engram_layers": list(cfg.engram.layer_ids),
            "experts": args.experts,
            "params_B": sum(p.numel() for p in bench.model.parameters()) / 1e9,
            "engram_table_rows": list(cfg.engram.num_embeddings),
            "engram_host_GB": sum(c.numel() + s.numel() for c, s in bench.tables) / 1e9,
            "engram_cache_slots": [e.table.slots for e in bench.v41.engrams() if e.table],
            "zipf_exponent": args.zipf,
        },
        "decode": [],
        "errors": {},
    }

    def phase(name: str, fn: Any) -> None:
        """One part; a failure is recorded and the rest still runs (one GPU call, all answers)."""
        try:
            fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{result['errors'][name]}", flush=True)
        write_record(args.out, result, indent=2)

    def correctness() -> None:
        result["correctness"] = check_against_reference(
            bench, *((200, 200) if smoke else (3000, 2048))
        )
        print("correctness:", result["correctness"], flush=True)

    def decode() -> None:
        for context in contexts:
            for n in concurrency:
                tok_s, ms = bench.decode_tokens_per_s(n, context, steps)
                row = {"concurrency": n, "context": context, "tok_s": tok_s, "step_ms": ms}
                result["decode"].append(row)
                print(row, flush=True)

    def engram() -> None:
        for key, cache_bytes in (("engram", None), ("engram_no_cache", 0)):
            bench.set_engram_cache(cache_bytes)
            result[key] = engram_profile(bench, *profile_at, hw, key)
            print(
                f"\n{key}: lookups {result[key]['engram_lookup_share']:.1%} of the step, Engram "
                f"{result[key]['engram_share']:.1%}, hit rate {result[key]['cache_hit_rate']}\n"
                + format_table(result[key]["profile"]),
                flush=True,
            )
        bench.set_engram_cache(None)

    phases = {"correctness": correctness, "decode": decode, "engram": engram}
    for name, fn in phases.items():
        if not args.only or name in args.only:
            phase(name, fn)
    print(f"failed phases: {sorted(result['errors']) or 'none'}")


if __name__ == "__main__":
    main()
