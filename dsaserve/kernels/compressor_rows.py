"""The argument of kernels.compress_decode: one compressor's decode rows and the state they update.

Written once here, where the dispatch, the Triton path (kernels.fused_compressor) and the torch
sequence (kernels.fused_reference) each took the same dozen tensors one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompressorRows:
    """kv, gate     [D, F] the new tokens' raw projections (wkv(x), wgate(x) of the D decode
                 rows), the pool dtype; rows may be strided, channels contiguous. F = head_dim,
                 or 2 * head_dim for an overlapping (CSA) compressor: [Ca | Cb].
    positions    [D] int64 position of each row's token; slab [D] int64 its request's slab row.
    ring_kv, ring_gate
                 [seqs, ROWS, F] the compressor's ring (KVPool.comp_ring / index_ring of the
                 layer: a slice of each slab row, so dense per sequence, not across them): row
                 p % ROWS holds the projections of position p. ROWS = rate, or 2 * rate with
                 overlap.
    ape          [rate, F] fp32 per-slot gate bias; norm_weight [head_dim] fp32, eps its RMS
                 norm's; inv_freq [rope_dim // 2] fp32 the RoPE table's inverse frequencies
                 (RotaryTable.inv_freq of the "compress" table).
    entry_table  [>= D, pages] int32, row b = decode row b's request: the pages holding its
                 compressed entries (the step's table of the group without its ring pages),
                 page_size entries a page."""

    kv: torch.Tensor
    gate: torch.Tensor
    positions: torch.Tensor
    slab: torch.Tensor
    ring_kv: torch.Tensor
    ring_gate: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor
    entry_table: torch.Tensor
    page_size: int

    @property
    def rate(self) -> int:
        """Tokens per compressed entry."""
        return self.ape.shape[0]

    @property
    def head_dim(self) -> int:
        return self.norm_weight.shape[0]
