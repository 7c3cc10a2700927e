"""A layer's sparse-MLA index list, window and compressed entries, in one launch.

The engine builds it from ~15 tensor ops per pool group for the sliding window
(StepState.window_indices), ~10 for the HCA entries (hca_indices), ~10 per CSA layer to map the
indexer's picks to slots (positions_to_slots), then a concatenation and an int32 cast per layer.
Here a program owns BLOCK columns of one row and computes each column's slot from the row's
position, its request's page table and the step's counters: grid (N, cdiv(W + extra, BLOCK)),
fixed by the shapes, no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program

WINDOW, PICKED, ALL_ENTRIES = 0, 1, 2  # what follows the window columns


@triton.jit
def _sparse_indices_kernel(
    pos_ptr,  # [N] int64
    row_req_ptr,  # [N] int64
    req_past_ptr,  # [B] int64
    req_row0_ptr,  # [B] int64
    table_ptr,  # [B, pages] int32 (ring pages, then entry pages)
    picked_ptr,  # [N, EXTRA] int32 entry positions (PICKED)
    out_ptr,  # [N, W + EXTRA] int32
    len_ptr,  # [N] int32 (ALL_ENTRIES)
    table_stride, picked_stride, scratch_base, page_size, ring_pages, hca_ratio,
    EXTRA,  # entry columns: varies with the context in eager steps, so not a constexpr
    W: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + row)
    req = tl.load(row_req_ptr + row)
    past = tl.load(req_past_ptr + req)
    pages = table_ptr + req * table_stride
    # window columns: key position pos - W + 1 + col
    key = pos - (W - 1) + col
    in_ring = (col < W) & (key >= 0) & (key < past)
    ring = tl.where(in_ring, key, 0) % (ring_pages * page_size)
    page = tl.load(pages + ring // page_size, mask=in_ring, other=0).to(tl.int64)
    scratch = scratch_base + tl.load(req_row0_ptr + req) + (key - past)
    slot = tl.where(key >= past, scratch, page * page_size + ring % page_size)
    slot = tl.where(key >= 0, slot, -1)
    # entry columns
    j = col - W
    extra = (j >= 0) & (j < EXTRA)
    if MODE == 1:
        entry = tl.load(picked_ptr + row * picked_stride + j, mask=extra, other=-1).to(tl.int64)
    else:  # HCA: entries 0..count-1 (window-only lists have no entry columns)
        count = (pos + 1) // hca_ratio
        entry = tl.where(extra & (j < count), j, -1).to(tl.int64)
    found = entry >= 0
    e = tl.where(found, entry, 0)
    page = tl.load(pages + ring_pages + e // page_size, mask=found, other=0).to(tl.int64)
    slot = tl.where(col < W, slot, tl.where(found, page * page_size + e % page_size, -1))
    tl.store(out_ptr + row * (W + EXTRA) + col, slot.to(tl.int32), mask=col < W + EXTRA)
    if MODE == 2:
        tl.store(len_ptr + row, (count + W).to(tl.int32), mask=tl.program_id(1) == 0)


def sparse_indices(
    positions: torch.Tensor,
    row_req: torch.Tensor,
    req_past: torch.Tensor,
    req_row0: torch.Tensor,
    table: torch.Tensor,
    *,
    ring_pages: int,
    page_size: int,
    scratch_base: int,
    window: int,
    picked: torch.Tensor | None = None,
    hca_ratio: int = 0,
    hca_width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton path of kernels.sparse_indices (semantics there)."""
    assert picked is None or not hca_ratio, "one kind of entry columns per layer"
    n, dev = positions.shape[0], positions.device
    mode, extra = WINDOW, 0
    if picked is not None:
        assert picked.stride(1) == 1 and picked.shape[0] == n
        mode, extra = PICKED, picked.shape[1]
    elif hca_ratio:
        mode, extra = ALL_ENTRIES, hca_width
    assert table.stride(1) == 1
    out = torch.empty(n, window + extra, dtype=torch.int32, device=dev)
    lengths = torch.empty(n, dtype=torch.int32, device=dev) if mode == ALL_ENTRIES else None
    if n:
        _sparse_indices_kernel[(n, triton.cdiv(window + extra, BLOCK))](
            positions, row_req, req_past, req_row0, table,
            picked if picked is not None else out,
            out,
            lengths if lengths is not None else out,
            table.stride(0),
            picked.stride(0) if picked is not None else 0,
            scratch_base, page_size, ring_pages, max(hca_ratio, 1), extra,
            W=window, MODE=mode, BLOCK=BLOCK,
            num_warps=4,
        )  # fmt: skip
    return out, lengths
