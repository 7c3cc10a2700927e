"""GPU benchmark of the engine's decode step on a V4-Flash-width model slice (or a
DeepSeek-V3.2-width one: --model-type deepseek_v32).

    python -m bench.engine --out bench/results/h200-engine.json
    python -m bench.engine --experts 256 --out bench/results/h200-engine-256.json
    python -m bench.engine --smoke              # CPU: tiny widths through the same code
    python -m bench.engine --experts 256 --only classes release   # profiles at c=64 and c=1
    python -m bench.engine --write-slice DIR    # the slice as a checkpoint (bench/gpu_profile.sh)
    python -m bench.engine --model-type deepseek_v32 --out bench/results/h200-engine-v32.json

The slice has V4-Flash's real widths (hidden 4096, 64 heads x 512, q_lora 1024, 8 output
groups, indexer 64 x 128 with top-512, window 128, CSA rate 4, HCA rate 128, mHC x4, vocab
129280) and a few layers of each kind with fewer experts (all 256 with --experts 256: 38.7 B
params, 81 GB in bf16) so it fits one GPU; weights are random bf16. Requests get a synthetic
KV history of the stated context (random pool contents: attention cost does not depend on the
values), then decode with the engine's own scheduler, runner (CUDA graphs) and sampler.

One run:
1. checks the Triton path against the plain-torch reference inside the engine (prefill chunk
   and a graph-replayed decode step, logits relative error);
2. decode tokens/s at concurrency 1, 16, 64 and context 4K, 32K;
3. the "before" configuration at concurrency 64: naive decode kernel (one program per
   (request, head), no tensor cores) and an indexer that scores a buffer padded to the
   configured maximum (1M tokens = 262K compressed entries) with fp32 matmuls;
4. prefill tokens/s;
5. `dsaserve profile`'s report of one decode step at c=64, 32K (engine.profile): time by
   kernel class and model part (torch profiler) against each one's floor (bytes at the copy
   bandwidth, FLOPs at the matmul rate, both measured in the same run);
6. the same slice with the release's weight formats, quantized from the bf16 weights as the
   checkpoint stores them (FP8 e4m3 linears with 128x128 ue8m0 block scales, FP4 routed
   experts, wo_a and the rest dense) and computed as the release does (kernels.fp8_linear,
   kernels.fp4_experts): its Triton path against its plain-torch reference, its logits against
   the bf16 model's, decode tokens/s at the same concurrencies and contexts (the ratio to bf16
   in the same run), prefill tokens/s and the profile of one step.

`--write-slice DIR` writes the slice as a checkpoint instead (`--slice-format release`: the
release's formats) for `dsaserve profile --model DIR` (bench/gpu_profile.sh).

The V3.2 slice (`--model-type deepseek_v32`) has V3.2's real widths (hidden 7168, 128 heads of
MLA over a 576-wide latent row, q_lora 1536, indexer 64 x 128 with top-2048, a dense layer of
18432, grouped routing of 8 experts, vocab 129280, context up to 163840), one dense and three
MoE layers with fewer experts; every phase but 5 runs for it (the profile's floors know V4's
parts only), its release weights are FP8 linears and FP8 routed experts (kernels.fp8_experts),
and its "before" indexer scores a buffer padded to 163840 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench import naive
from bench.compare import rel_err_or_nan
from bench.fake_quant import family, layer_labels
from bench.flash_widths import FLASH_WIDTHS
from bench.harness import write_record
from bench.v32_widths import V32_WIDTHS
from dsaserve import kernels
from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.experts import Fp8Experts
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.models import FAMILIES
from dsaserve.engine.models.deepseek_v4 import config as v4_config
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.models.deepseek_v32 import config as v32_config
from dsaserve.engine.parallel.channel import Channel
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile import hardware
from dsaserve.engine.profile.decode import profile_decode
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.profile.report import format_table
from dsaserve.engine.request import Request, Status
from dsaserve.engine.runner import Model, ModelRunner
from dsaserve.engine.sampler import sample
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.scheduler import ScheduledBatch, Scheduler
from dsaserve.engine.step import RowSpan, build_step_inputs
from dsaserve.kernels.quant import quantize_fp4, quantize_fp8_blocks

V4, V32 = v4_config.MODEL_TYPE, v32_config.MODEL_TYPE
MAX_CONTEXT = 1 << 20  # V4-Flash's max_position_embeddings: the "configured maximum"
BEFORE = "before (naive kernels, indexer padded to the maximum context)"
RELEASE = {
    V4: "release weights (FP8 linears, FP4 experts)",
    V32: "release weights (FP8 linears and experts)",
}
# Each slice's KV budget: 72 requests of up to 32K tokens fit (V3.2 keeps every token's row)
KV_BYTES = {V4: 8 << 30, V32: 40 << 30}
GRAPH_SIZES = [1, 16, 64]
# --smoke: the slice at widths a CPU runs in seconds (multiples of the FP8 block where needed)
SMOKE_WIDTHS = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 128,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "sliding_window": 16,
    "moe_intermediate_size": 128,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 16,
    "max_position_embeddings": 4096,
}
# The V3.2 slice at widths a CPU runs in seconds (multiples of the FP8 block where needed)
V32_SMOKE_WIDTHS = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 16,
    "max_position_embeddings": 4096,
}
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
LAYERS = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


V32_LAYERS = ["dense", "sparse", "sparse", "sparse"]  # (mlp_layer_types)


def slice_config(num_experts: int, smoke: bool = False, model_type: str = V4) -> Any:
    """The slice's ModelConfig, of the family's type."""
    return family(model_type).ModelConfig.from_hf(slice_hf_config(num_experts, smoke, model_type))


def slice_hf_config(num_experts: int, smoke: bool = False, model_type: str = V4) -> dict:
    """The slice's config.json fields."""
    if model_type == V32:
        return {
            "model_type": V32,
            "vocab_size": 129280,
            **V32_WIDTHS,
            "num_hidden_layers": len(V32_LAYERS),
            "mlp_layer_types": V32_LAYERS,
            "n_routed_experts": num_experts,
            "num_nextn_predict_layers": 0,  # the MTP layer does not run in a decode step
            **(V32_SMOKE_WIDTHS if smoke else {}),
        }
    return {
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        **FLASH_WIDTHS,
        "num_hidden_layers": len(LAYERS),
        "layer_types": LAYERS,
        "num_hash_layers": 2,
        "n_routed_experts": num_experts,
        "max_position_embeddings": MAX_CONTEXT,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
        },
        "num_nextn_predict_layers": 0,  # the MTP layer does not run in a decode step
        **(SMOKE_WIDTHS if smoke else {}),
    }


def write_slice(
    out: str, num_experts: int, fmt: str = "dense", smoke: bool = False, model_type: str = V4
) -> Path:
    """The slice as a checkpoint in `out` (the family's tiny writer: random weights, the byte
    tokenizer; the vocabulary stays 129280 rows wide, the tokenizer's tokens are the ones
    sampled); returns its path."""
    tiny = importlib.import_module(f"{FAMILIES[model_type]}.tiny")
    config = slice_hf_config(num_experts, smoke, model_type)
    overrides = {k: v for k, v in config.items() if k != "model_type"}
    return tiny.make_tiny_model(out, fmt=fmt, overrides=overrides)


def random_model(cfg: Any, dev: torch.device, tp: TensorParallel = SINGLE) -> Model:
    """Random bf16 weights (this rank's shard under tensor parallelism)."""
    model = family(cfg.family).build_model(cfg, torch.bfloat16, dev, tp=tp)
    fill_random(model, torch.Generator(dev).manual_seed(0))
    return model


@torch.no_grad()
def fill_random(model: Any, gen: torch.Generator, skip: frozenset[str] = frozenset()) -> None:
    """Random values in every parameter but `skip`'s: matrices normal with std fan_in^-0.5,
    vectors with std 0.1 (norms and scales as built); hash routers' token tables random
    distinct experts per token."""
    for name, p in model.named_parameters():
        if name in skip:
            continue
        if p.dim() >= 2:
            p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
        elif not name.endswith("scale") and "norm" not in name:
            p.normal_(0, 0.1, generator=gen)
    for layer in model.layers:
        gate = getattr(layer.ffn, "gate", None)  # (V3.2's dense layers have none)
        if getattr(gate, "hashed", False):  # V4's token-id hash: a table, not weights
            # distinct experts per token, as the release's tables (a repeated one would run
            # twice in the kernels and once in the release's loop: bench.release_numerics
            # saw its hash layers 2.5x over the floor from that alone)
            vocab, k = gate.tid2eid.shape
            draws = torch.rand(
                vocab, model.cfg.num_experts, device=gate.tid2eid.device, generator=gen
            )
            gate.tid2eid.copy_(draws.argsort(dim=1)[:, :k])


# The formats each family's release stores: V4's FP8 linears and FP4 experts, V3.2's FP8 linears
RELEASE_QUANTIZATION = {
    V4: v4_config.Quantization(expert_dtype="fp4"),
    V32: v32_config.Quantization(),
}


@torch.no_grad()
def release_model(dense: Any) -> Any:
    """The model with the release checkpoint's formats, quantized from `dense`'s weights as the
    checkpoint's producer would (kernels.quant: power-of-two scales, round to nearest even),
    one tensor (one expert) at a time; dense parameters are copied."""
    cfg = dataclasses.replace(dense.cfg, quantization=RELEASE_QUANTIZATION[dense.cfg.family])
    device = dense.embed.weight.device
    model = family(cfg.family).build_model(cfg, torch.bfloat16, device, quantized=True, tp=dense.tp)
    done = set()
    for name, module in model.named_modules():
        source = dense.get_submodule(name)
        if isinstance(module, Fp8Linear):
            for dst, src in zip(
                (module.weight, module.scale), quantize_fp8_blocks(source.weight), strict=True
            ):
                dst.copy_(src)
        elif isinstance(module, Fp4Experts):
            for e in range(module.w13.shape[0]):  # (this rank's experts)
                for codes, scales, weight in (
                    (module.w13, module.s13, source.w13),
                    (module.w2, module.s2, source.w2),
                ):
                    q, s = quantize_fp4(weight[e])
                    codes[e].copy_(q)
                    scales[e].copy_(s)
            module.note_scales()  # as the checkpoint loader does
        elif isinstance(module, Fp8Experts):
            for e in range(module.w13.shape[0]):  # (this rank's experts)
                for codes, scales, weight in (
                    (module.w13, module.s13, source.w13),
                    (module.w2, module.s2, source.w2),
                ):
                    q, s = quantize_fp8_blocks(weight[e])
                    codes[e].copy_(q)
                    scales[e].copy_(s)
        else:
            continue
        done |= {f"{name}.{p}" for p, _ in module.named_parameters()}
    dense_state = dict(dense.named_parameters()) | dict(dense.named_buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in done:
            t.copy_(dense_state[name])
    return model.eval()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Bench:
    def __init__(
        self,
        cfg: Any,
        max_seqs: int,
        kv_bytes: int,
        dev: torch.device,
        tp: TensorParallel = SINGLE,
        channel: Channel | None = None,
        model: Any = None,
        graph_sizes: list[int] = GRAPH_SIZES,
    ) -> None:
        """tp, channel: this rank's group and, on rank 0, its line to the others (bench.tp);
        model: the weights to run (None: random bf16 ones); graph_sizes: the decode batch sizes
        captured as CUDA graphs."""
        self.cfg, self.dev, self.max_context = cfg, dev, cfg.max_position_embeddings
        self.channel, self.graph_sizes = channel, graph_sizes
        self.pool = KVPool(
            cfg,
            KVCacheConfig(
                memory_bytes=kv_bytes,
                page_size=64,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=8192,
            ),
            dtype=torch.bfloat16,
            device=dev,
            max_context=self.max_context,
        )
        gen = torch.Generator(dev).manual_seed(1)
        for group in self.pool.groups.values():  # a synthetic history: any values will do
            for t in list(group.kv.values()) + list(group.index_k.values()):
                t.normal_(0, 1, generator=gen)
        self.scheduler = Scheduler(self.pool, 8192)
        self.use(random_model(cfg, dev, tp) if model is None else model)

    def use(self, model: Any) -> None:
        """Run `model` from now on, on the same pool (its layout does not depend on the weights),
        with decode graphs captured for it on the GPU."""
        self.model = model
        self.runner = ModelRunner(model, self.pool, self.dev, self.max_context, self.channel)
        if self.dev.type == "cuda":
            self.runner.capture_decode_graphs(self.graph_sizes)

    def requests(self, n: int, context: int) -> list[Request]:
        """n requests that have `context` tokens computed and one sampled token to decode next."""
        reqs = []
        for i in range(n):
            r = Request(
                request_id=f"r{i}",
                prompt_token_ids=[7] * context,
                params=GREEDY,
                max_tokens=1 << 20,
                text=None,
                eos_token_ids=frozenset(),
            )
            if not self.scheduler.try_allocate(r, context + 1):
                self.release(reqs)  # (a failed allocation holds nothing: no pages are left)
                raise AssertionError(f"KV pool too small for {n} requests of {context} tokens")
            r.num_computed, r.output_token_ids, r.status = context, [11], Status.RUNNING
            self.scheduler.running.append(r)
            self.scheduler.requests[r.request_id] = r
            reqs.append(r)
        return reqs

    def release(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.scheduler.finish(r, "abort")

    def decode_step(self) -> None:
        """One step as LLMEngine.step takes it (its profiler ranges included), without the
        text and logprobs."""
        with profiled("schedule"):
            batch = self.scheduler.schedule()
        samplers, _, logits, _ = self.runner.execute(batch)
        with profiled("sample"):
            tokens = sample(logits, [r.params for r in samplers], [0] * len(samplers)).tolist()
        for r, t in zip(samplers, tokens, strict=True):
            r.output_token_ids.append(t)

    def decode_tokens_per_s(self, n: int, context: int, steps: int) -> tuple[float, float]:
        # Only these n requests may run: one left behind by an earlier phase widens every step
        # (65 rows at c=64: past the largest graph, so each step ran eagerly, 5x slower)
        assert not self.scheduler.running, f"{len(self.scheduler.running)} requests left running"
        reqs = self.requests(n, context)
        try:
            for _ in range(3):
                self.decode_step()
            _sync(self.dev)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                self.decode_step()  # ends in the sampler's host sync
                times.append(time.perf_counter() - t0)
        finally:
            self.release(reqs)
        step_s = statistics.median(times)
        return n / step_s, step_s * 1e3


def decode_logits(bench: Bench, reqs: list[Request], eager: bool = False) -> torch.Tensor:
    """Logits of one decode step of `reqs`, graph-replayed where graphs are captured (eager:
    run the model, in the current kernel backend); their state is kept, so another model or
    backend can run the same step on the same history."""
    specs = [RowSpan(r.num_computed, 1, r.slab, [11]) for r in reqs]
    graphs = bench.runner.graphs
    if graphs and not eager:
        return graphs[min(b for b in graphs if b >= len(specs))].run(specs).clone()
    inp = build_step_inputs(bench.pool, specs, len(specs), bench.dev)
    return bench.model(bench.pool, inp, torch.arange(len(specs), device=bench.dev))


def check_against_reference(bench: Bench, context: int, prefill: int) -> dict:
    """Logits of the Triton path vs the plain-torch reference on the same state."""
    out = {}
    reqs = bench.requests(4, context)
    with kernels.use_backend("reference"):
        ref = decode_logits(bench, reqs, eager=True)
    out["decode_graph_vs_reference_rel_err"] = rel_err_or_nan(decode_logits(bench, reqs), ref)
    bench.release(reqs)
    [r] = bench.requests(1, 0)
    try:  # (a check that fails must not leave its request in the scheduler's running list)
        r.prompt_token_ids = torch.randint(
            0, bench.cfg.vocab_size, (prefill,), generator=torch.Generator().manual_seed(3)
        ).tolist()
        assert bench.scheduler.try_allocate(r, prefill + 1)
        spec = [RowSpan(0, prefill, r.slab, r.prompt_token_ids)]
        inp = build_step_inputs(bench.pool, spec, 0, bench.dev)
        last = torch.tensor([prefill - 1], device=bench.dev)
        with kernels.use_backend("reference"):
            ref, ref_layers = _with_layer_outputs(bench.model, bench.pool, inp, last)
        got, got_layers = _with_layer_outputs(bench.model, bench.pool, inp, last)
    finally:
        bench.release([r])
    out[f"prefill_{prefill}_vs_reference_rel_err"] = rel_err_or_nan(got, ref)
    # Where the two paths part: a jump at one layer kind is a bug, steady growth is bf16
    # rounding amplified through the random model.
    out[f"prefill_{prefill}_per_layer_rel_err"] = [
        f"{kind}: {rel_err_or_nan(a, b):.4f}"
        for kind, a, b in zip(layer_labels(bench.cfg), got_layers, ref_layers, strict=True)
    ]
    return out


def _with_layer_outputs(model, pool, inp, rows) -> tuple[torch.Tensor, list[torch.Tensor]]:
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda m, args, out: outputs.append(out.clone()))
        for layer in model.layers
    ]
    try:
        return model(pool, inp, rows), outputs
    finally:
        for h in hooks:
            h.remove()


def prefill_tokens_per_s(bench: Bench, length: int) -> float:
    [r] = bench.requests(1, 0)
    r.prompt_token_ids = torch.randint(0, bench.cfg.vocab_size, (length,)).tolist()
    r.output_token_ids = []
    assert bench.scheduler.try_allocate(r, length + 1)
    batch = ScheduledBatch(prefill=[(r, length)])
    bench.runner.execute(batch)  # warm-up (compiles the prefill shapes)
    _sync(bench.dev)
    r.num_computed = 0
    t0 = time.perf_counter()
    bench.runner.execute(batch)
    _sync(bench.dev)
    dt = time.perf_counter() - t0
    bench.release([r])
    return length / dt


def _weight_gb(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny widths: every phase runs, times mean nothing",
    )
    parser.add_argument(
        "--write-slice",
        metavar="DIR",
        help="only write the slice as a checkpoint (random weights, the byte tokenizer) into "
        "DIR, for `dsaserve profile --model DIR` (bench/gpu_profile.sh)",
    )
    parser.add_argument(
        "--slice-format",
        choices=("dense", "release"),
        default="dense",
        help="with --write-slice: fp32 weights, or the release's FP8 linears and FP4 experts",
    )
    parser.add_argument(
        "--model-type",
        choices=(V4, V32),
        default=V4,
        help="the slice's family: V4-Flash's widths, or DeepSeek-V3.2's",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("correctness", "decode", "release", "classes", "prefill", "before"),
        help="run only these phases",
    )
    args = parser.parse_args()
    smoke = args.smoke
    if args.write_slice:
        print(
            write_slice(args.write_slice, args.experts, args.slice_format, smoke, args.model_type)
        )
        return
    dev = torch.device("cpu" if smoke else "cuda")
    contexts, concurrency = ((64, 256), (1, 4)) if smoke else ((4096, 32768), (1, 16, 64))
    check_context, check_prefill = (200, 200) if smoke else (3000, 2048)
    steps = 2 if smoke else args.steps
    hw = None if smoke else hardware.measure(dev)  # in this run, as every bench here
    cfg = slice_config(args.experts, smoke, args.model_type)
    kv_bytes = (64 << 20) if smoke else KV_BYTES[args.model_type]
    bench = Bench(cfg, max_seqs=72, kv_bytes=kv_bytes, dev=dev)
    bf16 = bench.model
    result: dict = {
        "hardware": hw.as_dict() if hw else {},
        "config": {
            "model_type": args.model_type,
            "layers": layer_labels(cfg),
            "experts": args.experts,
            "params_B": sum(p.numel() for p in bf16.parameters()) / 1e9,
            "weights_GB": {"bf16": _weight_gb(bf16)},
            "max_context": cfg.max_position_embeddings,
        },
        "decode": [],
        "errors": {},
    }

    def phase(name: str, fn) -> None:
        """Run one part; a failure is recorded and the rest still runs (one GPU call, all
        answers)."""
        try:
            fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{result['errors'][name]}", flush=True)

    def correctness(key: str = "correctness") -> None:
        result[key] = check_against_reference(bench, check_context, check_prefill)
        print(f"{key}:", result[key], flush=True)

    def decode(config: str, concurrency: tuple[int, ...], steps: int) -> None:
        for context in contexts:
            for n in concurrency:
                tps, ms = bench.decode_tokens_per_s(n, context, steps)
                result["decode"].append(
                    {
                        "config": config,
                        "concurrency": n,
                        "context": context,
                        "tok_s": tps,
                        "step_ms": ms,
                    }
                )
                print(result["decode"][-1], flush=True)

    def classes(prefix: str = "") -> None:
        """dsaserve profile's report of one decode step at c=64 (key "profile") and at c=1
        ("profile_c1"), 32K context (smoke: c=4 and 1, 256)."""
        context = 256 if smoke else 32768
        for n, suffix in ((4 if smoke else 64, ""), (1, "_c1")):
            reqs = bench.requests(n, context)
            try:
                report = profile_decode(
                    bench.decode_step,
                    bench.runner,
                    concurrency=n,
                    context=context,
                    steps=3,
                    hardware=hw,
                    setup={
                        "model": f"V4-Flash-width slice, {args.experts} experts",
                        "dtype": "bf16",
                    },
                )
            finally:
                bench.release(reqs)
            result[f"{prefix}profile{suffix}"] = report.as_dict()

    def prefill(key: str = "prefill_tok_s") -> None:
        lengths = (200,) if smoke else (2048, 8192)
        result[key] = {str(n): prefill_tokens_per_s(bench, n) for n in lengths}
        print(f"{key}:", result[key], flush=True)

    def release() -> None:
        """The same slice with the release's formats, on the same pool, then back to bf16."""
        model = release_model(bf16)
        result["config"]["weights_GB"]["release"] = _weight_gb(model)
        bf16_runner = bench.runner
        reqs = bench.requests(4, check_context)
        ref = decode_logits(bench, reqs)
        try:
            bench.use(model)
            result["release_vs_bf16_decode_logits_rel_err"] = rel_err_or_nan(
                decode_logits(bench, reqs), ref
            )
            bench.release(reqs)
            print("release vs bf16:", result["release_vs_bf16_decode_logits_rel_err"], flush=True)
            phase("release correctness", lambda: correctness("release_correctness"))
            phase("release decode", lambda: decode(RELEASE[args.model_type], concurrency, steps))
            phase("release prefill", lambda: prefill("release_prefill_tok_s"))
            if "classes" in phases:
                phase("release classes", lambda: classes("release_"))
        finally:
            bench.release([r for r in reqs if r.request_id in bench.scheduler.requests])
            bench.model, bench.runner = bf16, bf16_runner

    def before() -> None:
        fast_runner = bench.runner
        bench.runner = ModelRunner(bf16, bench.pool, dev, bench.max_context)
        try:
            with naive.in_engine():
                bench.runner.capture_decode_graphs([64])
                decode(BEFORE, (64,), max(3, args.steps // 4))
        finally:
            bench.runner = fast_runner

    phases = {
        "correctness": correctness,
        "decode": lambda: decode("dsaserve", concurrency, steps),
        "release": release,
        "classes": classes,
        "prefill": prefill,
        "before": before,
    }
    if smoke:  # the naive kernels' graphs need the GPU
        del phases["before"]
    if args.model_type != V4:  # engine.profile's floors know V4's parts only
        del phases["classes"]
    for name, fn in phases.items():
        if not args.only or name in args.only:
            phase(name, fn)
    summarize(result)
    write_record(args.out, result, indent=2)
    print_table(result)


def summarize(result: dict) -> None:
    """Ratios between rows of the same run."""

    def tok_s(config: str, n: int, context: int) -> float | None:
        return next(
            (
                r["tok_s"]
                for r in result["decode"]
                if (r["config"], r["concurrency"], r["context"]) == (config, n, context)
            ),
            None,
        )

    for context in (4096, 32768):
        after, naive = tok_s("dsaserve", 64, context), tok_s(BEFORE, 64, context)
        if after and naive:
            result[f"speedup_vs_before_c64_{context}"] = after / naive
    ratios = {}
    for r in result["decode"]:
        base = tok_s("dsaserve", r["concurrency"], r["context"])
        if r["config"] in RELEASE.values() and base:
            ratios[f"c{r['concurrency']}_ctx{r['context']}"] = r["tok_s"] / base
    if ratios:
        result["release_vs_bf16_tok_s"] = ratios


def print_table(result: dict) -> None:
    hw = result["hardware"]
    machine = (
        f"{hw['name']}: copy {hw['copy_GBps']:.0f} GB/s, "
        f"bf16 matmul {hw['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
        if hw
        else "smoke run on the CPU (times mean nothing)"
    )
    weights = {k: round(v, 2) for k, v in result["config"]["weights_GB"].items()}
    print(
        f"\n{machine}; slice {result['config']['params_B']:.2f} B params, weights GB {weights}; "
        f"correctness {result.get('correctness')}; "
        f"failed phases: {sorted(result['errors']) or 'none'}"
    )
    print(f"{'config':52s} {'conc':>4s} {'ctx':>6s} {'tok/s':>9s} {'step ms':>8s}")
    for r in result["decode"]:
        print(
            f"{r['config']:52s} {r['concurrency']:4d} {r['context']:6d} "
            f"{r['tok_s']:9.1f} {r['step_ms']:8.3f}"
        )
    print(
        "speed-up vs before at c=64:",
        {k: round(v, 1) for k, v in result.items() if k.startswith("speedup")},
    )
    print("prefill tok/s:", {k: round(v) for k, v in result.get("prefill_tok_s", {}).items()})
    if "release_vs_bf16_decode_logits_rel_err" in result:

        def rounded(key: str, digits: int) -> dict:
            return {k: round(v, digits) for k, v in result.get(key, {}).items()}

        print(
            f"release weights: decode logits vs bf16 rel. error "
            f"{result['release_vs_bf16_decode_logits_rel_err']:.4f}; "
            f"Triton vs reference {result.get('release_correctness')}; "
            f"tok/s / bf16 {rounded('release_vs_bf16_tok_s', 2)}; "
            f"prefill tok/s {rounded('release_prefill_tok_s', 0)}"
        )
    for key, title in (
        ("profile", "bf16 weights"),
        ("profile_c1", "bf16 weights, c=1"),
        ("release_profile", "release weights"),
        ("release_profile_c1", "release weights, c=1"),
    ):
        if key in result:
            print(f"\n{title}:\n{format_table(result[key])}")


if __name__ == "__main__":
    main()
