"""Token compressors of CSA/HCA layers: softmax-gated pooling of `rate` tokens into one entry.

Each token contributes raw projections (kv, gate). Entry w pools the tokens of window w
(positions w*rate .. (w+1)*rate-1) with softmax(gate + ape) weights, then RMS-normalises it
and applies RoPE at the window's first position. Overlapping compressors (CSA main and
indexer) produce 2*head_dim features per token: the first half (Ca) feeds the NEXT window's
entry, the second half (Cb) the token's own window, so entry w pools 2*rate slots.

The last tokens' raw projections live in the request's slab ring (`KVPool.comp_ring` /
`index_ring`), so a window can close in a later step than the one that started it; a prefix-cache
checkpoint inside a chunk gets the ring as of its position in a slab row of its own.
Entries are written straight into the pool at their entry slots.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.step import StepState
from dsaserve.kernels.fused_reference import pool_windows


class Compressor(torch.nn.Module):
    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        feats = 2 * head_dim if overlap else head_dim
        self.wkv = torch.nn.Linear(hidden, feats, bias=False)
        self.wgate = torch.nn.Linear(hidden, feats, bias=False)
        self.ape = torch.nn.Parameter(
            torch.zeros(rate, feats, dtype=torch.float32)
        )  # per-slot gate bias
        self.norm = RMSNorm(head_dim, eps)
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap

    def forward(
        self,
        x: torch.Tensor,
        step: StepState,
        ring: tuple[torch.Tensor, torch.Tensor],
        target: torch.Tensor,
        group: str,
        trash_slot: int,
    ) -> None:
        """Compress this step's rows x [N, hidden]; write the entries they complete into
        target [slots, head_dim] (or its FP8 pages: quantized on write)."""
        kv, gate = self.wkv(x), self.wgate(x)  # [N, feats]
        ring_kv, ring_gate = ring  # [seqs, ring_rows, feats]
        inp, D = step.inp, step.inp.num_decode
        if D:  # one fused launch: ring update, pooling, norm, RoPE, the entry's write
            decode_rows = kernels.CompressorRows(
                kv=kv[:D],
                gate=gate[:D],
                positions=inp.positions[:D],
                slab=inp.slab[:D],
                ring_kv=ring_kv,
                ring_gate=ring_gate,
                ape=self.ape,
                norm_weight=self.norm.weight,
                eps=self.norm.eps,
                inv_freq=step.rope_tables["compress"].inv_freq,
                entry_table=step.table(group)[:, step.pool.ring_pages :],
                page_size=step.pool.page_size,
            )
            kernels.compress_decode(decode_rows, target, trash_slot)
        rows = ring_kv.shape[1]
        for seg in inp.segments:
            s, e = seg.start, seg.start + seg.num_rows
            chunk = slice(seg.row0, seg.row0 + seg.num_rows)
            first_w, last_w = s // self.rate, e // self.rate - 1  # windows that close in this chunk
            if last_w >= first_w:
                base_w = max(first_w - 1, 0) if self.overlap else first_w
                past = torch.arange(base_w * self.rate, s, device=x.device).remainder(rows)
                seq_kv = torch.cat(
                    (ring_kv[seg.slab, past], kv[chunk])
                )  # positions base_w*rate .. e-1
                seq_gate = torch.cat((ring_gate[seg.slab, past], gate[chunk]))
                n_win = last_w + 1 - base_w
                win_kv = seq_kv[: n_win * self.rate].view(n_win, self.rate, -1)
                win_gate = seq_gate[: n_win * self.rate].view(n_win, self.rate, -1)
                windows = torch.arange(first_w, last_w + 1, device=x.device)
                if self.overlap:
                    if first_w == 0:  # window 0 has no predecessor: pad with a masked one
                        win_kv = torch.cat((torch.zeros_like(win_kv[:1]), win_kv))
                        win_gate = torch.cat((torch.zeros_like(win_gate[:1]), win_gate))
                    prev = (win_kv[:-1], win_gate[:-1], windows >= 1)
                    cur = (win_kv[1:], win_gate[1:])
                else:
                    prev, cur = None, (win_kv, win_gate)
                entries = self._pool(cur, prev, windows * self.rate, step)
                req = torch.full_like(windows, seg.req)
                step.pool.write(target, step.entry_slots(group, req, windows), entries)
            # Keep the newest ring rows for windows that close in later steps; a checkpoint
            # inside the chunk keeps the ring as of its position (engine.prefix_cache.checkpoint).
            for end, row in ((e, seg.slab), *((c.position, c.slab) for c in seg.captures)):
                keep = torch.arange(max(s, end - rows), end, device=x.device)
                ring_kv[row, keep.remainder(rows)] = kv[chunk][keep - s]
                ring_gate[row, keep.remainder(rows)] = gate[chunk][keep - s]

    def _pool(
        self,
        cur: tuple[torch.Tensor, torch.Tensor],
        prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        first_pos: torch.Tensor,
        step: StepState,
    ) -> torch.Tensor:
        """cur = (kv, gate) [M, rate, feats] of the closing windows; prev = the windows before
        them plus a [M] validity mask (overlap only) -> entries [M, head_dim]."""
        inv_freq = step.rope_tables["compress"].inv_freq
        return pool_windows(
            cur, prev, self.ape, self.norm.weight, self.norm.eps, inv_freq, first_pos
        )
