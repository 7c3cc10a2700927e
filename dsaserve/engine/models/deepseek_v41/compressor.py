"""A DeepSeek-V4.1 KV source's compressor: the entries its layer and the layers after it read.

From DeepSeek's inference/model.py `Compressor`:
- ratio 1: entry p = RMSNorm(wkv(x_p)), in the model dtype (nothing to pool: no gate);
- ratio 2: entry j pools positions 2j and 2j + 1 in fp32: sum over the two of
  softmax(wgate(x))[t] * wkv(x)[t], per feature (no slot bias, no overlap: V4's `ape` and
  overlapping windows are gone), then RMSNorm in the model dtype.
The entry is the latent before RoPE: the indexer's keys are made from it, then it is rotated at
its first position (j * ratio) and stored (the source layer's attention does both).

A ratio-2 pair can close in a later step than the one that opened it: the raw (kv, score) of the
last two positions wait in the request's slab row (`KVPool.comp_ring`, position p at row p % 2),
as V4's rings: the open position's, and the one before it, which a request resumed from a
prefix-cache checkpoint at c recomputing position c - 1 needs (a checkpoint inside a chunk gets
the rows as of its position).
"""

from __future__ import annotations

import torch

from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.step import StepState


class Compressor(torch.nn.Module):
    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        # the release promotes a pooling compressor's projections to fp32 (its softmax is fp32)
        dtype = torch.float32 if ratio > 1 else None
        self.wkv = torch.nn.Linear(hidden, head_dim, bias=False, dtype=dtype)
        self.wgate = (
            torch.nn.Linear(hidden, head_dim, bias=False, dtype=dtype) if ratio > 1 else None
        )
        self.norm = RMSNorm(head_dim, eps)
        self.ratio = ratio

    def forward(
        self, x: torch.Tensor, step: StepState, ring: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The entries this step's rows x [N, hidden] complete: (latents [M, head_dim] before
        RoPE, the request of each [M], its entry index [M]). A decode row that completes none
        yields an entry at index -1 (the caller writes it to the trash row): decode steps keep
        static shapes."""
        inp, decode = step.inp, step.inp.num_decode
        if self.ratio == 1:
            return self.norm(self.wkv(x)), inp.row_req, inp.positions
        assert self.wgate is not None and ring is not None
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)  # [N, D] fp32
        ring_kv, ring_score = ring  # [slab rows, 2, D]: position p at row p % 2
        latents, reqs, entries = [], [], []
        if decode:
            slab, positions = inp.slab[:decode], inp.positions[:decode]
            before = (positions - 1) % 2  # (an even position pools nothing: its entry is -1)
            pair = (
                torch.stack((ring_kv[slab, before].float(), kv[:decode]), 1),
                torch.stack((ring_score[slab, before].float(), score[:decode]), 1),
            )
            latents.append(_pool(*pair))
            reqs.append(inp.row_req[:decode])
            entries.append(torch.where(positions % 2 == 1, positions // 2, -1))
            ring_kv[slab, positions % 2] = kv[:decode].to(ring_kv.dtype)
            ring_score[slab, positions % 2] = score[:decode].to(ring_score.dtype)
        for seg in inp.segments:
            s, e = seg.start, seg.start + seg.num_rows
            chunk = slice(seg.row0, seg.row0 + seg.num_rows)
            first, last = s // 2, e // 2 - 1  # the pairs that close in this chunk
            if last >= first:
                pending = slice((s - 1) % 2, (s - 1) % 2 + s % 2)  # (a pair opened earlier)
                head_kv = ring_kv[seg.slab, pending].float()
                head_score = ring_score[seg.slab, pending].float()
                rows = 2 * (last + 1 - first)
                pairs_kv = torch.cat((head_kv, kv[chunk]))[:rows].view(-1, 2, kv.shape[1])
                pairs_score = torch.cat((head_score, score[chunk]))[:rows].view(-1, 2, kv.shape[1])
                latents.append(_pool(pairs_kv, pairs_score))
                windows = torch.arange(first, last + 1, device=x.device)
                reqs.append(torch.full_like(windows, seg.req))
                entries.append(windows)
            # the last two positions of the chunk, and of each checkpoint inside it
            for end, row in ((e, seg.slab), *((c.position, c.slab) for c in seg.captures)):
                keep = torch.arange(max(s, end - 2), end, device=x.device)
                ring_kv[row, keep % 2] = kv[chunk][keep - s].to(ring_kv.dtype)
                ring_score[row, keep % 2] = score[chunk][keep - s].to(ring_score.dtype)
        if not latents:
            empty = torch.empty(0, dtype=torch.int64, device=x.device)
            return torch.empty(0, kv.shape[1], dtype=x.dtype, device=x.device), empty, empty
        pooled = torch.cat(latents)  # [M, D] fp32
        return self.norm(pooled.to(x.dtype)), torch.cat(reqs), torch.cat(entries)


def _pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """[M, 2, D] fp32 positions of each pair -> [M, D]: the softmax-gated sum over the pair."""
    return (kv * score.softmax(dim=1)).sum(dim=1)
