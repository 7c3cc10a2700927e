"""kernels.hopper.fp4_moe: the Gluon FP4 MoE for sm_90.

On the CPU (Triton's interpreter) everything but the Gluon GEMM runs: the slot table, the
MMA-ordered activations, SwiGLU and the finish, with the GEMM written out in torch on the same
buffers (``mma_gemm``), against the release's expert arithmetic. On an sm_90 GPU (marked gpu)
the whole path runs against the same reference at V4-Flash widths.
"""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve import kernels  # noqa: F401  (picks the interpreter on CPU)
from dsaserve.kernels import hopper, quant
from dsaserve.kernels.hopper import fp4_decode, fp4_gemm, moe_rows
from dsaserve.kernels.hopper import fp4_moe as hop
from tests.kernels_cases import gpu_test, moe_case

LIMIT = 10.0


def tolerance(cfg: hop.HopperMoeConfig) -> float:
    """The bf16 decodes sum exact products (rel. error ~2e-4 from bf16 rounding); the "fp8"
    one sums in the tensor cores' FP8 accumulators inside each 32-group, as the release's own
    fp4_gemm does on Hopper, and the bf16 and e4m3 roundings between the two GEMMs amplify that
    (~2e-3, up to 4.3e-3 measured)."""
    return 8e-3 if cfg.decode == "fp8" else 4e-3


@pytest.mark.parametrize("decode", fp4_decode.DECODES)
def test_mma_columns_permute_each_32_group(decode):
    cols = fp4_decode.mma_columns(4096, decode)
    k = torch.arange(4096)
    assert torch.equal(torch.sort(cols).values, k)  # a permutation ...
    assert torch.equal(cols // 32, k // 32)  # ... that keeps every value in its scale group
    first = {
        "table": [0, 1, 8, 9, 16, 17, 24, 25, 2, 3],
        "shift": [0, 4, 8, 12, 16, 20, 24, 28, 1, 5],
        "fp8": [0, 2, 4, 6, 8, 10, 12, 14, 16, 18],
    }
    assert cols[:10].tolist() == first[decode]
    x = torch.randn(3, 256)  # the kernels' mma_order_block writes the same order
    assert torch.equal(fp4_decode.to_mma_order(x, decode), x[:, cols[:256]])


@pytest.mark.parametrize("rows", [37, moe_rows.SMALL_ROUTE + 5])  # one program; torch's sort
def test_plan_sorts_rows_and_covers_each_experts_rows_once(rows):
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(-2, 9, (rows, 3), generator=g)  # -2, -1, 8: other ranks' experts
    ids[: rows // 2, 0] = 4  # one expert over several slots
    p = moe_rows.plan(ids, 8, block_t=8)
    flat = ids.reshape(-1)
    local = torch.where((flat >= 0) & (flat < 8), flat, 8)
    assert torch.equal(torch.sort(p.order.long()).values, torch.arange(flat.numel()))
    assert bool((local[p.order.long()].diff() >= 0).all())  # grouped by expert, others last
    assert torch.equal(p.inv.long()[p.order.long()], torch.arange(flat.numel()))
    assert p.row_end.tolist() == torch.cumsum(torch.bincount(local, minlength=9)[:8], 0).tolist()
    table, real = p.table.tolist(), p.nslot.item()
    assert all(e == 8 for e, _, _ in table[real:])  # past the last block: no expert
    covered = torch.zeros(flat.numel(), dtype=torch.int64)
    for e, row0, end in table[:real]:
        assert 0 <= e < 8 and row0 < end
        r = torch.arange(row0, min(row0 + 8, end))
        assert bool((local[p.order.long()][r] == e).all())
        covered[r] += 1
    n = int((local < 8).sum())
    assert covered[:n].tolist() == [1] * n and covered[n:].sum() == 0


def mma_gemm(w, s, xg, xs, p: moe_rows.MoePlan, *, gate_up: bool, split: int, cfg) -> torch.Tensor:
    """What the Gluon GEMM computes, in torch: for each real slot's valid rows and each K
    slice, the activations (MMA order; "fp8": codes times their scales, which carry the
    weights' 2^6) times the expert's dequantized weights put in MMA order."""
    n_exp, n_w, half = w.shape
    k = 2 * half
    x = xg.double()
    if cfg.decode == "fp8":
        x = x * xs.double().repeat_interleave(128, dim=1) / 64
    out = torch.zeros(split, xg.shape[0], n_w, dtype=torch.float32)
    order = fp4_decode.mma_columns(k, cfg.decode)
    for e, row0, end in p.table.tolist()[: p.nslot.item()]:
        rows = torch.arange(row0, min(row0 + cfg.block_t, end))
        wm = quant.dequantize_fp4(w[e], s[e]).double()[:, order]  # column c holds input P(c)
        for sp in range(split):
            ks = slice(sp * k // split, (sp + 1) * k // split)
            out[sp, rows] = (x[rows][:, ks] @ wm[:, ks].T).float()
    return out


@pytest.mark.parametrize(
    "tokens,topk,block_t,split,skew,experts,decode",
    [
        (5, 2, 8, (1, 1), True, (0, 6), "table"),
        (9, 3, 16, (2, 2), True, (0, 6), "shift"),
        (4, 2, 8, (1, 2), False, (2, 5), "shift"),
        (7, 3, 8, (2, 1), True, (1, 6), "fp8"),
    ],
)
def test_hopper_path_with_the_gemm_in_torch_matches_the_release(
    tokens, topk, block_t, split, skew, experts, decode
):
    x, ids, wts, w13, s13, w2, s2 = moe_case(6, 1024, 512, tokens, topk, seed=tokens, skew=skew)
    start, stop = experts  # expert parallelism: ids outside [start, stop) add nothing
    local = (w13[start:stop], s13[start:stop], w2[start:stop], s2[start:stop])
    ids = ids - start
    cfg = hop.HopperMoeConfig(block_t, 2, split, decode)
    p = moe_rows.plan(ids, stop - start, block_t)
    xg, xs = moe_rows.gather_activations(x, p, topk, decode)
    up = mma_gemm(local[0], local[1], xg, xs, p, gate_up=True, split=split[0], cfg=cfg)
    hg, hs = moe_rows.swiglu(up, p, wts.reshape(-1).float().contiguous(), LIMIT, decode)
    down = mma_gemm(local[2], local[3], hg, hs, p, gate_up=False, split=split[1], cfg=cfg)
    out = moe_rows.finish(down, p, tokens, topk)
    ref = quant.fp4_experts_reference(x, ids, wts, *local, LIMIT)
    assert rel_err(out, ref) < 1e-4  # exact products; fp32 sums in another order


def test_supported_shapes_and_default_configs():
    assert hop.supported(4096, 2048) and not hop.supported(4096, 384)
    one = hop.default_config(6, 256, 4096, 2048, sms=132)  # a decode step of one token
    assert one.block_t == 8 and one.split_k[0] > 1 and one.split_k[1] > 1
    busy = hop.default_config(64 * 6, 256, 4096, 2048, sms=132)
    assert busy.block_t == 8 and busy.split_k == (1, 1)
    prefill = hop.default_config(4096 * 6, 256, 4096, 2048, sms=132)
    assert prefill.block_t == 64 and prefill.split_k == (1, 1) and prefill.decode == "table"
    assert one.decode == busy.decode == "fp8"  # decode-sized slots, any scale
    narrow = hop.default_config(4096 * 6, 256, 4096, 2048, 132, narrow_scales=True)
    assert narrow.decode == "shift"
    for cfg in (one, busy, prefill):
        assert cfg.stages * fp4_gemm.stage_bytes(cfg.block_t, cfg.decode) <= fp4_gemm.SMEM_BUDGET


hopper_test = pytest.mark.skipif(
    not hopper.available(torch.device("cuda")), reason="needs an sm_90 GPU and Gluon"
)


@gpu_test
@hopper_test
@pytest.mark.parametrize(
    "tokens,cfg",
    [
        (1, None),
        (64, None),
        (64, hop.HopperMoeConfig(16, 4, (2, 4), "shift")),
        (64, hop.HopperMoeConfig(8, 5, (1, 1), "shift")),
        (64, hop.HopperMoeConfig(8, 5, (1, 1), "fp8")),
        (1, hop.HopperMoeConfig(8, 5, (4, 4), "fp8")),
        (300, None),
        (300, hop.HopperMoeConfig(64, 2, (1, 1), "shift")),
        (300, hop.HopperMoeConfig(32, 3, (1, 1), "fp8")),
    ],
)
def test_cuda_hopper_fp4_moe_v4_flash(tokens, cfg):
    x, ids, wts, w13, s13, w2, s2 = moe_case(
        32, 4096, 2048, tokens, 6, seed=31, skew=tokens > 64, device="cuda"
    )
    out = hop.fp4_moe_hopper(x, ids, wts, w13, s13, w2, s2, LIMIT, config=cfg)
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, LIMIT)
    used = cfg or hop.default_config(tokens * 6, 32, 4096, 2048, 132)
    assert rel_err(out, ref) < tolerance(used)


@gpu_test
@hopper_test
def test_cuda_hopper_fp4_moe_expert_ranges_and_odd_widths():
    x, ids, wts, w13, s13, w2, s2 = moe_case(7, 1536, 512, 5, 3, seed=32, device="cuda")
    for start, stop in ((0, 7), (0, 3), (3, 7)):
        local = (w13[start:stop], s13[start:stop], w2[start:stop], s2[start:stop])
        out = hop.fp4_moe_hopper(x, ids - start, wts, *local, LIMIT)
        ref = quant.fp4_experts_reference(x, ids - start, wts, *local, LIMIT)
        used = hop.default_config(15, stop - start, 1536, 512, 132)
        assert rel_err(out, ref) < tolerance(used), (start, stop)


@gpu_test
@hopper_test
def test_cuda_hopper_fp4_moe_graph_replay_follows_new_inputs():
    x, ids, wts, w13, s13, w2, s2 = moe_case(
        16, 1024, 512, 8, 6, seed=33, skew=False, device="cuda"
    )
    hop.fp4_moe_hopper(x, ids, wts, w13, s13, w2, s2, LIMIT)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = hop.fp4_moe_hopper(x, ids, wts, w13, s13, w2, s2, LIMIT)
    x2, ids2, wts2, *_ = moe_case(16, 1024, 512, 8, 6, seed=34, skew=False, device="cuda")
    x.copy_(x2), ids.copy_(ids2), wts.copy_(wts2)
    graph.replay()
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, LIMIT)
    assert rel_err(y, ref) < tolerance(hop.default_config(48, 16, 1024, 512, 132))
