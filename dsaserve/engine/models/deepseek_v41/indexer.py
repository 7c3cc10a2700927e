"""DeepSeek-V4.1's indexer: each query's top-k compressed entries, in two levels.

From DeepSeek's inference/model.py (`Indexer.forward`, `select_candidate_blocks`):
- keys: only a KV source makes them, from its compressor's latent (before RoPE):
  k = k_norm(wk(latent)), RoPE on the last rope dims at the entry's first position;
- queries: q = wq_b(q_residual) per head, RoPE at the row's position; weights =
  weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5;
- score(t, j) = sum_h relu(q[t, h] . k[j]) * weights[t, h] over the entries t sees
  (j < (t + 1) // ratio);
- the candidate source keeps, per query, the `candidate_topk_blocks` blocks of
  `candidate_block_size` entries with the highest best score (the block holding its newest
  entry always: it is partly filled), and later index sources score only inside them;
- each index source keeps the `index_topk` best (fewer when fewer are seen); the layers between
  two index sources reuse the earlier one's picks.

Scored in plain torch, request by request (a request's keys are gathered once and shared by its
rows), its rows and entries in bounded chunks. Rows that see no more entries than `index_topk`
keep all they see without a score (any order: attention is a sum). The GPU kernel of V4
(kernels.indexer_topk) fuses scoring and selection without candidates; one for two levels is
not written yet, so on a GPU this costs the torch ops' memory traffic.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.models.deepseek_v4.config import Quantization
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.step import StepState

ROW_CHUNK = 64  # query rows scored at once (their scores: ROW_CHUNK x entries fp32)


class Indexer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: Quantization | None) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.compress_ratio(layer)
        block = quant.block if quant else 0
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.dim, quant is not None, block=block)
        self.weights_proj = torch.nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.owns_keys = layer in cfg.kv_sources
        if self.owns_keys:
            self.wk = torch.nn.Linear(cfg.head_dim, self.dim, bias=False)
            self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps)
        self.candidate_source = layer == cfg.candidate_source
        self.uses_candidates = cfg.uses_candidates(layer)
        self.blocks, self.block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.scale = self.dim**-0.5 * self.heads**-0.5

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """latent [M, head_dim] (the compressor's, before RoPE) -> keys [M, Di], rotated with the
        entries' cos/sin [M, rope_dim // 2]."""
        return kernels.apply_rope(self.k_norm(self.wk(latent)), cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        step: StepState,
        rows: torch.Tensor | None,
        keys: torch.Tensor,
        group: str,
        candidates: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """x [M, hidden], q_residual [M, q_lora] of the step's rows `rows` (None: all) ->
        [M, topk] int64 entry positions (-1: none). keys: the KV source's index_k pool, `group`
        its pool group; candidates: the step's candidate blocks ("blocks" [N, B] int64 entry
        blocks, -1 none, by step row), written by the candidate source, read after it."""
        inp = step.inp
        positions = inp.positions if rows is None else inp.positions[rows]
        row_req = inp.row_req if rows is None else inp.row_req[rows]
        cos, sin = step.rope("compress")
        if rows is not None:
            cos, sin = cos[rows], sin[rows]
        q = self.wq_b(q_residual).unflatten(-1, (self.heads, self.dim))
        q = kernels.apply_rope(q, cos, sin).float()  # [M, Hi, Di]
        weights = self.weights_proj(x).float() * self.scale  # [M, Hi]
        seen = (positions + 1) // self.ratio  # [M] entries each row sees
        picks = torch.full((len(positions), self.topk), -1, dtype=torch.int64, device=x.device)
        blocks = None
        if self.candidate_source:
            most = (inp.max_position + 1) // self.ratio  # entries a row of the step may see
            width = max(1, min(self.blocks, -(-most // self.block_size)))
            blocks = torch.full((inp.num_rows, width), -1, dtype=torch.int64, device=x.device)
            candidates["blocks"] = blocks
        table = step.table(group)[:, step.pool.ring_pages :]  # [B, pages] entry pages
        for lo, hi, req in _runs(row_req):
            n = int(seen[hi - 1])  # (positions ascend in a run: its last row sees the most)
            if n == 0:
                continue
            slots = kernels.positions_to_slots(
                torch.arange(n, device=x.device)[None], table[req : req + 1], step.pool.page_size
            )[0].long()
            k = keys[slots].float()  # [n, Di]
            for a in range(lo, hi, ROW_CHUNK):
                b = min(a + ROW_CHUNK, hi)
                scores = torch.einsum("rhd,jd->rhj", q[a:b], k).relu_()
                scores = (scores * weights[a:b, :, None]).sum(1)  # [r, n]
                visible = torch.arange(n, device=x.device)[None] < seen[a:b, None]
                scores = scores.masked_fill(~visible, -torch.inf)
                if blocks is not None:
                    step_rows = torch.arange(a, b, device=x.device) if rows is None else rows[a:b]
                    blocks[step_rows] = self._blocks(scores, seen[a:b], blocks.shape[1])
                elif self.uses_candidates:
                    step_rows = torch.arange(a, b, device=x.device) if rows is None else rows[a:b]
                    scores = _in_blocks(scores, candidates["blocks"][step_rows], self.block_size)
                k_top = min(self.topk, n)
                top = scores.topk(k_top, dim=-1)
                picks[a:b, :k_top] = torch.where(top.values > -torch.inf, top.indices, -1)
        return picks

    def _blocks(self, scores: torch.Tensor, seen: torch.Tensor, width: int) -> torch.Tensor:
        """[r, n] scores -> [r, width] the blocks each row keeps (-1 past its picks)."""
        r, n = scores.shape
        pad = -n % self.block_size
        best = torch.nn.functional.pad(scores, (0, pad), value=-torch.inf)
        best = best.view(r, -1, self.block_size).amax(-1)  # [r, blocks]
        newest = ((seen - 1) // self.block_size)[:, None]  # (-1: a row that sees none)
        best = best.masked_fill(
            torch.arange(best.shape[1], device=best.device) == newest, torch.inf
        )
        keep = min(self.blocks, best.shape[1])
        top = best.topk(keep, dim=-1)
        out = torch.full((r, width), -1, dtype=torch.int64, device=scores.device)
        out[:, :keep] = torch.where(top.values > -torch.inf, top.indices, -1)
        return out


def _in_blocks(scores: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """scores [r, n] with every entry outside the rows' candidate blocks [r, B] at -inf."""
    r, n = scores.shape
    count = -(-n // block_size)
    keep = torch.zeros(r, count + 1, dtype=torch.bool, device=scores.device)  # + a "none" column
    keep.scatter_(1, torch.where(blocks >= 0, blocks, count), True)
    keep = keep[:, :count].repeat_interleave(block_size, dim=1)[:, :n]
    return scores.masked_fill(~keep, -torch.inf)


def _runs(row_req: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first, end, request) of each run of consecutive rows of one request."""
    reqs = row_req.tolist()
    out, start = [], 0
    for i in range(1, len(reqs) + 1):
        if i == len(reqs) or reqs[i] != reqs[start]:
            out.append((start, i, reqs[start]))
            start = i
    return out
