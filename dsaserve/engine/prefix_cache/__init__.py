"""Automatic prefix caching (ARCHITECTURE.md, "Prefix caching"): a prompt that starts like an
earlier one resumes from that one's KV state.

    block_hash    content hashes of token blocks (torch-free: the router hashes prompts too)
    cache         `PrefixCache`: the tree of cached prefixes, lookup, checkpoints, LRU eviction
    checkpoint    the device copies: a step's captures, a request's restore (`CopyPlan`)
    host_tier     pinned host blocks that evicted state moves to (`--kv-offloading-size`)

The KV state itself (pools, pages, allocators, staging) is engine.kv's. This package's __init__
imports nothing, so the router can import `block_hash` without torch.
"""
