"""One engine: scheduling, KV pools, prefix cache, sampling, speculation, parallel ranks."""
