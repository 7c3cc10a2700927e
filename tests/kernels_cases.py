"""Inputs, float64 yardsticks and error measures for the kernel tests (tests/test_kernels_*.py).

Inputs are adversarial by default: holes (-1 and out-of-range slot ids) anywhere in the index
lists, ragged lengths including 0, rows with no valid index, values with a random offset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from dsaserve import kernels
from dsaserve.kernels import kv_quant, quant


def gpu_test(fn):
    """Real-shape test: marked `gpu`, skipped without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.gpu(skip(fn))


def random_bf16(shape, seed: int, spread: float = 8.0, device: str = "cpu") -> torch.Tensor:
    """Values over many binades, so groups get very different scales."""
    g = torch.Generator(device).manual_seed(seed)
    exps = torch.randint(-int(spread), int(spread) + 1, shape, generator=g, device=device)
    return (torch.randn(shape, generator=g, device=device) * torch.exp2(exps.float())).to(
        torch.bfloat16
    )


def moe_case(
    n_exp: int,
    hidden: int,
    inter: int,
    tokens: int,
    topk: int,
    seed: int,
    skew: bool = True,
    device: str = "cpu",
):
    """FP4 experts and a routing for kernels.fp4_moe and kernels.hopper.fp4_moe: distinct
    experts per token, the last expert never used; with skew, 3/4 of the tokens route to
    expert 1 (so it spans several row blocks)."""
    g = torch.Generator(device).manual_seed(seed)
    # large enough that gate and up cross the swiglu limit of 10 on some rows
    w13, s13 = quant.quantize_fp4(
        torch.randn(n_exp, 2 * inter, hidden, generator=g, device=device) * 0.3
    )
    w2, s2 = quant.quantize_fp4(
        torch.randn(n_exp, hidden, inter, generator=g, device=device) * 0.05
    )
    x = random_bf16((tokens, hidden), seed=seed, spread=1, device=device)
    rows = []
    for t in range(tokens):
        if skew and t < tokens * 3 // 4:
            others = torch.randperm(n_exp - 3, generator=g, device=device)[: topk - 1] + 2
            rows.append(torch.cat([torch.ones(1, dtype=torch.int64, device=device), others]))
        else:
            rows.append(torch.randperm(n_exp - 1, generator=g, device=device)[:topk])
    ids = torch.stack(rows)
    wts = torch.rand(tokens, topk, generator=g, device=device) + 0.5
    return x, ids, wts, w13, s13, w2, s2


def fp8_moe_case(
    n_exp: int, hidden: int, inter: int, tokens: int, topk: int, seed: int, device: str = "cpu"
):
    """FP8 experts (DeepSeek-V3.2's layout: 128 x 128 block scales) and a routing with distinct
    experts per token, 3/4 of the tokens on expert 1 (several row blocks), the last expert
    never used."""
    x, ids, wts, *_ = moe_case(n_exp, 128, 128, tokens, topk, seed, device=device)
    g = torch.Generator(device).manual_seed(seed)
    w13, s13 = zip(
        *(
            quant.quantize_fp8_blocks(
                torch.randn(2 * inter, hidden, generator=g, device=device) * 0.3
            )
            for _ in range(n_exp)
        ),
        strict=True,
    )
    w2, s2 = zip(
        *(
            quant.quantize_fp8_blocks(torch.randn(hidden, inter, generator=g, device=device) * 0.05)
            for _ in range(n_exp)
        ),
        strict=True,
    )
    x = random_bf16((tokens, hidden), seed=seed, spread=1, device=device)
    stacked = (torch.stack(t) for t in (w13, s13, w2, s2))
    return (x, ids, wts, *stacked)


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, H, D]
    kv: torch.Tensor  # [S, D]
    indices: torch.Tensor  # [B, K] int32
    lengths: torch.Tensor | None  # [B] int32
    sinks: torch.Tensor | None  # [H] fp32
    sm_scale: float
    d_v: int

    def run(self, fn):
        return fn(
            self.q,
            self.kv,
            self.indices,
            self.sm_scale,
            d_v=self.d_v,
            sinks=self.sinks,
            lengths=self.lengths,
        )

    def reference64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 answer on the same (already rounded) input values, computed independently
        of kernels.reference: each row's valid slots are listed explicitly, and a sink is one
        more logit in the softmax (with no value row), as DeepSeek-V4 defines it."""
        q, num_slots = self.q.double().cpu(), self.kv.shape[0]
        indices = self.indices.cpu()
        lengths = None if self.lengths is None else self.lengths.cpu()
        batch, heads, _ = q.shape
        out = torch.zeros(batch, heads, self.d_v, dtype=torch.float64)
        lse = torch.full((batch, heads), float("-inf"), dtype=torch.float64)
        for b in range(batch):
            n = indices.shape[1] if lengths is None else int(lengths[b])
            slots = [int(i) for i in indices[b, :n] if 0 <= int(i) < num_slots]
            if not slots:
                continue
            rows = self.kv[torch.tensor(slots, device=self.kv.device)].double().cpu()  # [k, D]
            logits = q[b] @ rows.T * self.sm_scale  # [H, k]
            lse[b] = torch.logsumexp(logits, dim=1)
            if self.sinks is not None:
                logits = torch.cat((logits, self.sinks.double().cpu()[:, None]), dim=1)
            probs = torch.softmax(logits, dim=1)[:, : len(slots)]
            out[b] = probs @ rows[:, : self.d_v]
        return out, lse.float()


def decode_case(
    batch: int,
    heads: int,
    dim: int,
    num_idx: int,
    *,
    slots: int = 300,
    d_v: int = 512,
    sinks: bool = True,
    ragged: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> DecodeCase:
    """Row 0 is empty (length 0 or all holes), row 1 has only holes, the rest are ragged."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g) + 0.1 * torch.randn(1, generator=g)
    kv = torch.randn(slots, dim, generator=g) + 0.1 * torch.randn(1, generator=g)
    indices = torch.randint(0, slots, (batch, num_idx), generator=g, dtype=torch.int32)
    holes = torch.rand(batch, num_idx, generator=g) < 0.2
    junk = torch.tensor([-1, -1, -1, -7, slots, slots + 5], dtype=torch.int32)
    indices[holes] = junk[torch.randint(0, len(junk), (int(holes.sum()),), generator=g)]
    indices[min(1, batch - 1)] = -1
    lengths = None
    if ragged:
        lengths = torch.randint(0, num_idx + 1, (batch,), generator=g, dtype=torch.int32)
        lengths[0] = 0
        lengths[-1] = num_idx
    else:
        indices[0] = -1
    sink = torch.randn(heads, generator=g) if sinks else None
    to = dict(device=device)
    return DecodeCase(
        q.to(dtype=dtype, **to),
        kv.to(dtype=dtype, **to),
        indices.to(**to),
        None if lengths is None else lengths.to(**to),
        None if sink is None else sink.to(**to),
        dim**-0.5,
        d_v,
    )


def fp8_decode_case(case: DecodeCase, page_size: int) -> tuple[DecodeCase, DecodeCase]:
    """(case reading an FP8 pool, the same case on the pool's exact dequantization): every slot
    of case.kv is quantized into pages of page_size slots, so slot ids keep their meaning; the
    format follows the rows' width (512: V4's, 576: V3.2's)."""
    num_slots, dim = case.kv.shape
    assert num_slots % page_size == 0, "whole pages, so the junk ids stay out of range"
    width = page_size * kv_quant.kv_token_bytes(dim)
    pool = torch.zeros(num_slots // page_size, width, dtype=torch.uint8, device=case.kv.device)
    slots = torch.arange(num_slots, device=case.kv.device)
    with kernels.use_backend("reference"):
        kernels.store_kv_fp8(pool, slots, case.kv)
    return replace(case, kv=pool), replace(case, kv=kv_quant.gather_kv(pool, slots, dim))


@dataclass
class IndexerCase:
    q: torch.Tensor  # [B, Hi, Di]
    weights: torch.Tensor  # [B, Hi] fp32
    k_cache: torch.Tensor  # [num_pages, P, Di]
    page_table: torch.Tensor  # [B, max_pages] int32
    lengths: torch.Tensor  # [B] int32
    topk: int
    scale: float

    def run(self, fn):
        return fn(
            self.q,
            self.weights,
            self.k_cache,
            self.page_table,
            self.lengths,
            self.topk,
            scale=self.scale,
        )

    def scores64(self) -> torch.Tensor:
        """float64 scores of every position up to the page table's width, [B, W], computed
        independently of kernels.reference: key j of row b is read page by page through the
        table, and score = sum_h weight[h] * relu(q[h] . key) * scale. Positions past a row's
        length are -inf (their table entries may name pages that do not exist)."""
        batch, max_pages = self.page_table.shape
        page_size = self.k_cache.shape[1]
        out = torch.full((batch, max_pages * page_size), float("-inf"), dtype=torch.float64)
        q, weights, k_cache = self.q.double().cpu(), self.weights.double().cpu(), self.k_cache.cpu()
        for b in range(batch):
            n = int(self.lengths[b])
            if n == 0:
                continue
            pages = self.page_table[b, : -(-n // page_size)].tolist()
            keys = torch.cat([k_cache[p].double() for p in pages])[:n]  # [n, D]
            dots = (q[b] @ keys.T).clamp(min=0)  # [H, n]
            out[b, :n] = (weights[b][:, None] * dots).sum(dim=0) * self.scale
        return out


def indexer_case(
    lengths: list[int],
    *,
    topk: int,
    heads: int = 16,
    head_dim: int = 32,
    page_size: int = 4,
    max_pages: int | None = None,
    spare_pages: int = 7,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> IndexerCase:
    """Each row gets distinct random pages of a shared pool; table entries past a row's
    pages point at random pages too (they must never be read)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    max_pages = max_pages or max(1, -(-max(lengths) // page_size))
    num_pages = batch * max_pages + spare_pages
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages)
    q = torch.randn(batch, heads, head_dim, generator=g)
    weights = torch.randn(batch, heads, generator=g)
    k_cache = torch.randn(num_pages, page_size, head_dim, generator=g)
    to = dict(device=device)
    return IndexerCase(
        q.to(dtype=dtype, **to),
        weights.to(**to),
        k_cache.to(dtype=dtype, **to),
        table.to(dtype=torch.int32, **to),
        torch.tensor(lengths, dtype=torch.int32, **to),
        topk,
        head_dim**-0.5,
    )


def fp8_indexer_case(case: IndexerCase) -> tuple[IndexerCase, IndexerCase]:
    """(case reading an FP8 key pool, the same case on the pool's exact dequantization)."""
    num_pages, page_size, head_dim = case.k_cache.shape
    pool = kv_quant.index_pool(num_pages, page_size, head_dim, case.k_cache.device)
    slots = torch.arange(num_pages * page_size, device=pool.device)
    kv_quant.store_index_k_reference(pool, slots, case.k_cache.reshape(-1, head_dim))
    keys = kv_quant.gather_index_k(pool, slots, head_dim).view(case.k_cache.shape)
    return replace(case, k_cache=pool), replace(case, k_cache=keys)


def check_topk(idx: torch.Tensor, case: IndexerCase, tol: float) -> None:
    """Rows with length <= topk: exactly 0..len-1 then -1. Longer rows: topk distinct positions
    below the length whose scores are the top-topk scores (ties may pick either entry)."""
    scores = case.scores64()
    assert idx.shape == (len(case.lengths), case.topk) and idx.dtype == torch.int32
    for b, n in enumerate(case.lengths.tolist()):
        row = idx[b].cpu().long()
        if n <= case.topk:
            want = torch.where(torch.arange(case.topk) < n, torch.arange(case.topk), -1)
            assert torch.equal(row, want), f"row {b} (len {n}): {row.tolist()}"
            continue
        assert row.min() >= 0 and row.max() < n and row.unique().numel() == case.topk, b
        got = scores[b, row].sort().values
        want = scores[b, :n].topk(case.topk).values.sort().values
        err = (got - want).abs().max().item() / want.abs().max().clamp(min=1e-30).item()
        assert err <= tol, f"row {b} (len {n}): picked scores off by {err:.2e}"
