"""dsaserve services: router, prefill and decode workers, KV transfer, registry, CLI."""
