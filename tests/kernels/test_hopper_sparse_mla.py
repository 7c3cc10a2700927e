"""kernels.hopper.sparse_mla: the Gluon sparse-MLA decode for sm_90, against float64.

Gluon has no interpreter, so every case here needs an sm_90 GPU (marked gpu); the CPU side of
the same contract is tested on the Triton kernel (tests/kernels/test_sparse_mla.py). The cases
hold holes (-1 and ids outside the pool), ragged lengths, a row with no entry, sinks, index
counts that are not a multiple of the 64-row tile, and forced split counts.
"""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.kernels import hopper
from tests.kernels_cases import decode_case

needs_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and hopper.available(torch.device("cuda"))),
    reason="needs an sm_90 GPU with Gluon",
)
pytestmark = [pytest.mark.gpu, needs_sm90]


def check(case, out, lse) -> None:
    ref_out, ref_lse = case.reference64()
    assert out.dtype == case.q.dtype and out.shape == ref_out.shape
    assert rel_err(out, ref_out) < 1e-2  # P is rounded to bf16 before P.V
    assert rel_err(lse, ref_lse) < 1e-4  # fp32 sums of bf16 products
    empty = torch.isneginf(ref_lse)
    assert bool(empty.any()), "case should hold rows without a valid index"
    assert torch.equal(out.cpu()[empty].float(), torch.zeros_like(out.cpu()[empty].float()))


def gluon(splits: int | None = None):
    from dsaserve.kernels.hopper import sparse_mla as hop

    def run(q, kv, indices, sm_scale, *, d_v, sinks, lengths):
        assert hop.supports(q, kv, d_v)
        return hop.sparse_mla_decode(
            q, kv, indices, sm_scale, d_v=d_v, sinks=sinks, lengths=lengths, num_splits=splits
        )

    return run


@pytest.mark.parametrize(
    "batch,heads,dim,num_idx,splits",
    [
        (1, 64, 512, 640, None),
        (64, 64, 512, 640, None),
        (64, 64, 512, 640, 1),
        (7, 64, 512, 1000, 3),
        (3, 128, 576, 2048, None),
        (9, 128, 576, 2047, 7),
        (300, 64, 512, 640, None),
        (4, 64, 576, 1, 1),
    ],
)
@pytest.mark.parametrize("sinks", [True, False])
def test_gluon_matches_float64(batch, heads, dim, num_idx, splits, sinks):
    case = decode_case(
        batch, heads, dim, num_idx, slots=1 << 14, sinks=sinks, dtype=torch.bfloat16,
        device="cuda", seed=batch + num_idx,
    )  # fmt: skip
    check(case, *case.run(gluon(splits)))


def test_gluon_fp16_and_dispatch():
    """fp16 runs too; the public entry point takes the Gluon kernel for these shapes."""
    case = decode_case(5, 128, 512, 100, slots=4096, dtype=torch.float16, device="cuda")
    check(case, *case.run(gluon(2)))
    check(case, *case.run(kernels.sparse_mla_decode))


def test_gluon_graph_replay_follows_new_inputs():
    """No host sync: the call captures into a graph, and replays read the new inputs."""
    case = decode_case(8, 64, 512, 640, slots=1 << 14, dtype=torch.bfloat16, device="cuda")
    run = gluon()
    case.run(run)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = case.run(run)
    fresh = decode_case(8, 64, 512, 640, slots=1 << 14, dtype=torch.bfloat16, device="cuda", seed=3)
    for name in ("q", "kv", "indices", "lengths", "sinks"):
        getattr(case, name).copy_(getattr(fresh, name))
    graph.replay()
    check(fresh, out, lse)
