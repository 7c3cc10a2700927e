"""Profiler ranges that name the parts of a step (scheduling, attention, indexer, MoE, ...).

Nearly free without an active profiler, and absent from replayed CUDA graphs; `engine.profile`
attributes every op and kernel of a profiled step to its innermost range (`dsaserve profile`).
`PARTS` is the vocabulary: a range of another name would be attributed nowhere.
"""

from __future__ import annotations

import torch

# part -> the part whose range encloses it (None: a step's top level)
PARTS: dict[str, str | None] = {
    "schedule": None,  # the scheduler picks the step's rows (host only)
    "inputs": None,  # the step's input tensors (positions, slab rows, token ids)
    "embed": None,  # token embedding
    "engram": None,  # V4.1's Engram: n-gram hashes, its table rows mixed into the streams
    "engram_lookup": "engram",  # the table rows: its device cache, else host memory
    "mhc": None,  # hyper-connection mixes before and after each sublayer
    "attention": None,  # projections, norm + RoPE, index lists, output projection
    "compressor": "attention",  # the CSA / HCA compressor of the layer's KV
    "indexer": "attention",  # the lightning indexer: its compressor and queries
    "indexer_topk": "indexer",  # scoring the compressed keys and selecting the top-k
    "sparse_mla": "attention",  # the sparse-MLA attention kernel
    "moe": None,  # router, routed experts, shared expert
    "head": None,  # final mHC collapse, norm, LM head
    "sample": None,  # sampling and logprobs
    "verify": None,  # speculative decoding: which drafts the target accepts, their logprobs
    "draft": None,  # speculative decoding: the draft head (MTP passes; DSpark context, blocks)
    "wait": None,  # the host waits for a step's sampled ids (async scheduling: the step before)
    "outputs": None,  # the ids to their requests: stop checks, text, listeners (host only)
}
# parts that keep what runs inside them: a draft head's layers (their mhc, attention, moe ranges)
# count as `draft`, so the report says what drafting costs, split by kernel class
WHOLE = frozenset({"draft"})
PREFIX = "dsaserve."


def profiled(part: str) -> torch.profiler.record_function:
    assert part in PARTS, part
    return torch.profiler.record_function(PREFIX + part)
