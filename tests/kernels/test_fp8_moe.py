"""kernels.fp8_moe (DeepSeek-V3.2's routed FP8 experts; the interpreter on CPU, compiled on
CUDA) against kernels.quant.fp8_experts_reference, the release's expert loop."""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.kernels import quant
from dsaserve.kernels.fp8_moe import fp8_moe, stack_fp8_experts
from tests.kernels_cases import fp8_moe_case, gpu_test, random_bf16


def test_fp8_moe_matches_the_release_experts():
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(6, 256, 256, 24, 2, seed=11)
    assert int((ids == 1).sum()) > 16  # expert 1's rows span two blocks of 16
    out = fp8_moe(x, ids, wts, w13, s13, w2, s2)
    ref = quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)
    assert out.dtype == torch.float32 and out.shape == (24, 256)
    assert rel_err(out, ref) < 1e-3
    assert (out == ref).float().mean().item() > 0.9  # mostly the very same fp32 values


def test_fp8_experts_add_every_slot_of_a_repeated_expert():
    """As the FP4 experts: a repeated expert id adds once per slot, kernel and reference."""
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(6, 128, 128, 5, 3, seed=14)
    ids[:, 1] = ids[:, 0]
    ref = quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)
    per_slot = sum(
        quant.fp8_experts_reference(x, ids[:, j : j + 1], wts[:, j : j + 1], w13, s13, w2, s2)
        for j in range(3)
    )
    torch.testing.assert_close(ref, per_slot, rtol=1e-6, atol=1e-6)
    assert rel_err(fp8_moe(x, ids, wts, w13, s13, w2, s2), ref) < 1e-3


def test_fp8_moe_int32_ids_and_prefill_blocks():
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(8, 128, 128, 40, 3, seed=12)
    ref = quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)
    assert rel_err(fp8_moe(x, ids.int(), wts, w13, s13, w2, s2, block_m=32), ref) < 1e-3


def test_fp8_expert_ranges_add_up_to_all_experts():
    """Expert parallelism: a rank holds experts [start, stop) and gets ids - start; ids outside
    its range add nothing, so the ranks' outputs sum to the whole layer's."""
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(6, 128, 128, 12, 2, seed=13)
    whole = quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)
    parts = {"reference": [], "triton": []}
    for start, stop in ((0, 3), (3, 6)):
        local = (w13[start:stop], s13[start:stop], w2[start:stop], s2[start:stop])
        parts["reference"].append(quant.fp8_experts_reference(x, ids - start, wts, *local))
        parts["triton"].append(fp8_moe(x, ids - start, wts, *local))
    assert torch.equal(parts["reference"][0] + parts["reference"][1], whole)
    assert rel_err(parts["triton"][0] + parts["triton"][1], whole) < 1e-3


def test_stack_fp8_experts_and_bad_layouts():
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(4, 128, 256, 3, 2, seed=14)
    inter_blocks = 2
    w13s, s13s, w2s, s2s = stack_fp8_experts(
        [w[:256] for w in w13], [s[:inter_blocks] for s in s13],
        [w[256:] for w in w13], [s[inter_blocks:] for s in s13],
        list(w2), list(s2),
    )  # fmt: skip
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((w13s, w13), (s13s, s13), (w2s, w2), (s2s, s2)))  # fmt: skip
    with pytest.raises(ValueError, match="w2"):
        fp8_moe(x, ids, wts, w13, s13, w2[:, :, :128], s2, block_m=16)
    with pytest.raises(ValueError, match="s13 must be"):
        fp8_moe(x, ids, wts, w13, s13[:, :1], w2, s2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_moe(x, ids, wts, w13.float(), s13, w2, s2)
    with pytest.raises(ValueError, match="weights"):
        fp8_moe(x, ids, wts[:, :1], w13, s13, w2, s2)


def test_dispatch_uses_the_reference_on_cpu_and_can_be_forced():
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(4, 128, 128, 5, 2, seed=15)
    ref = quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)
    assert torch.equal(kernels.fp8_experts(x, ids, wts, w13, s13, w2, s2), ref)
    with kernels.use_backend("triton"):
        assert rel_err(kernels.fp8_experts(x, ids, wts, w13, s13, w2, s2), ref) < 1e-3


@gpu_test
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_cuda_fp8_moe_at_v32_widths(tokens):
    """Hidden 7168, intermediate 2048, top-8 of 32 experts (V3.2's widths, fewer experts)."""
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(32, 7168, 2048, tokens, 8, seed=23, device="cuda")
    out = fp8_moe(x, ids, wts, w13, s13, w2, s2)
    assert rel_err(out, quant.fp8_experts_reference(x, ids, wts, w13, s13, w2, s2)) < 4e-3


@gpu_test
def test_cuda_fp8_moe_graph_replay_follows_new_inputs():
    x, ids, wts, w13, s13, w2, s2 = fp8_moe_case(16, 512, 256, 8, 6, seed=26, device="cuda")
    fp8_moe(x, ids, wts, w13, s13, w2, s2)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_moe(x, ids, wts, w13, s13, w2, s2)
    x.copy_(random_bf16((8, 512), seed=27, device="cuda"))
    ids.copy_(torch.stack([torch.randperm(16, device="cuda")[:6] for _ in range(8)]))
    graph.replay()
    assert torch.equal(y, fp8_moe(x, ids, wts, w13, s13, w2, s2))
