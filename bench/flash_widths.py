"""DeepSeek-V4-Flash's per-layer widths (its config.json), which the benches' slices keep while
they cut layers, experts and context: what a slice's step costs per layer is the real one's."""

FLASH_WIDTHS = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
}
