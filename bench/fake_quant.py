"""The release's arithmetic in fp32, as the judge of a release-format model: how much of a GPU
path's error is the format's own cost and how much is ours.

    ref = reference_model(model)              # fp32 copy; FP8/FP4 codes and scales as they are
    ref_prompt = OnePrompt(ref, ids, memory_bytes=...)
    with kernels.use_backend("reference"):
        want = ref_prompt.run()               # Trace: each layer's input and output, logits
    got = OnePrompt(model, ids, ...).run(teacher=want)
    report = compare(got, want, layer_labels(model.cfg))

`reference_model` is the model under the release's own arithmetic with every other stage in
fp32: each FP8/FP4 linear and each expert quantizes its activations to e4m3 per 128 values with
ue8m0 scales and sums exact block products in fp32 into a bf16 output, exactly as the release's
act_quant / fp8_gemm / fp4_gemm / Expert do (kernels.quant, run by the "reference" backend; on
the CPU that is the default); norms, attention, mHC, the router and the rest run in fp32 (plain
torch). tests/release_reference.py restates the same linear() and Expert arithmetic from the
release's bytes in float64 and holds kernels.quant to it.

Teacher forcing (`run(teacher=...)`) feeds every layer of the model under test the reference's
input to that layer, so a layer's error is its own: with free-running layers the error of layer
k also carries every earlier layer's, amplified. Quantization makes each linear discontinuous:
an input that moves by one bf16 ulp can move an e4m3 code by one of its (16x coarser) ulps, so a
bf16 path differs from the fp32 reference by more than bf16 rounding even with exact kernels.
`compare` therefore reports the model against the reference beside a floor: the same model
computed by plain torch in the model's dtype against the same reference (what bf16 rounding
costs through the release's arithmetic); a kernel of ours that errs shows above that floor.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from bench.compare import rel_err_or_nan
from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.experts import Fp8Experts
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.models import FAMILIES
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.request import Request
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.scheduler import Scheduler
from dsaserve.engine.step import RowSpan, build_step_inputs

QUANTIZED = (Fp8Linear, Fp4Experts, Fp8Experts)


def family(model_type: str) -> Any:
    """The engine.models package of a family (engine.models.FAMILIES)."""
    return importlib.import_module(FAMILIES[model_type])


def layer_labels(cfg: Any) -> list[str]:
    """A label per layer of a model: its attention kind (V4) or its MLP kind (V3.2)."""
    return list(cfg.layer_types if cfg.family == "deepseek_v4" else cfg.mlp_layer_types)


def is_quantized(model: torch.nn.Module) -> bool:
    return any(isinstance(m, QUANTIZED) for m in model.modules())


@torch.no_grad()
def reference_model(model: Any, device: torch.device | None = None) -> Any:
    """`model` rebuilt in fp32 on `device` (default: its own): FP8/FP4 codes and e8m0 scales
    copied bit for bit, every other parameter and buffer widened to fp32 (exact)."""
    cfg = model.cfg
    device = device or next(model.parameters()).device
    ref = family(cfg.family).build_model(
        cfg, torch.float32, device, quantized=is_quantized(model), tp=model.tp
    )
    source = model.state_dict()
    for name, t in ref.state_dict().items():
        assert source[name].shape == t.shape, name
        t.copy_(source[name])  # (same dtype for codes and scales; bf16 -> fp32 is exact)
    for m in ref.modules():
        if isinstance(m, Fp4Experts):
            m.note_scales()  # as the checkpoint loader does
    return ref.eval()


@dataclass
class Trace:
    """What one step computed: each layer's input and output (fp32 copies) and the logits."""

    inputs: list[torch.Tensor]  # per layer: V4 streams [N, hc_mult, hidden], V3.2 [N, hidden]
    outputs: list[torch.Tensor]  # per layer, as inputs
    logits: torch.Tensor  # fp32 [rows, vocab]


class OnePrompt:
    """One request on a KV pool of its own (the model's dtype, `memory_bytes` of it): `run`
    computes its prompt as one prefill chunk, each `decode` one more token."""

    def __init__(self, model: Any, prompt: list[int], memory_bytes: int) -> None:
        self.model, self.prompt = model, list(prompt)
        p = next(model.parameters())
        self.device = p.device
        dtype = next(t.dtype for t in model.parameters() if t.is_floating_point() and t.dim() > 1)
        cfg = model.cfg
        self.pool = KVPool(
            cfg,
            KVCacheConfig(
                memory_bytes=memory_bytes,
                page_size=64,
                max_num_seqs=1,
                max_num_batched_tokens=max(len(prompt), 64),
            ),
            dtype=dtype,
            device=self.device,
            max_context=cfg.max_position_embeddings,
        )
        self.request = Request(
            request_id="r",
            prompt_token_ids=self.prompt,
            params=SamplingParams(max_tokens=1, temperature=0),
            max_tokens=1,
            text=None,
            eos_token_ids=frozenset(),
        )
        self.scheduler = Scheduler(self.pool, max(len(prompt), 64))
        self.computed = 0

    def run(self, teacher: Trace | None = None) -> Trace:
        """The prompt's prefill; logits of its last row."""
        assert self.computed == 0, "the prompt runs once"
        return self._step(self.prompt, teacher)

    def decode(self, token: int, teacher: Trace | None = None) -> Trace:
        """One decode row after what ran before."""
        assert self.computed > 0, "the prompt runs first"
        return self._step([token], teacher)

    def _step(self, tokens: list[int], teacher: Trace | None) -> Trace:
        start, n = self.computed, len(tokens)
        assert self.scheduler.try_allocate(self.request, start + n), "KV pool too small"
        spans = [RowSpan(start, n, self.request.slab, tokens)]
        inputs = build_step_inputs(self.pool, spans, 1 if start else 0, self.device)
        last = torch.tensor([n - 1], device=self.device)
        trace = layer_trace(self.model, self.pool, inputs, last, teacher)
        self.computed += n
        return trace


def layer_trace(
    model: Any, pool: KVPool, inputs: Any, logit_rows: torch.Tensor, teacher: Trace | None = None
) -> Trace:
    """One forward step of `model` with every layer's input and output recorded; with a
    teacher, each layer takes the teacher's input to it (in the model's dtype) instead of the
    previous layer's output."""
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def before(i: int):
        def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
            x = args[0] if teacher is None else teacher.inputs[i].to(args[0].dtype)
            ins.append(x.float().clone())
            return None if teacher is None else (x, *args[1:])

        return hook

    hooks = [layer.register_forward_pre_hook(before(i)) for i, layer in enumerate(model.layers)]
    hooks += [
        layer.register_forward_hook(lambda m, args, out: outs.append(out.float().clone()))
        for layer in model.layers
    ]
    try:
        logits = model(pool, inputs, logit_rows)
    finally:
        for h in hooks:
            h.remove()
    return Trace(ins, outs, logits.float())


def compare(got: Trace, ref: Trace, labels: list[str]) -> dict:
    """Per layer: `got`'s output against `ref`'s (rel. error); the logits' rel. error and
    whether their argmax agrees."""
    return {
        "layers": [
            {"layer": i, "kind": kind, "rel_err": rel_err_or_nan(a, b)}
            for i, (kind, a, b) in enumerate(zip(labels, got.outputs, ref.outputs, strict=True))
        ],
        "logits_rel_err": rel_err_or_nan(got.logits, ref.logits),
        "argmax_agrees": bool(
            (got.logits.argmax(-1).cpu() == ref.logits.argmax(-1).cpu()).all().item()
        ),
    }
