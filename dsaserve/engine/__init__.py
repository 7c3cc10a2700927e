"""dsaserve engine: one GPU group's runtime for DeepSeek-V4 (no networking).

The offline API is `engine.llm.LLM` with `engine.sampling_params.SamplingParams`. The torch-free
side the router imports is `engine.text` (with `config`, `load`, `sampling_params` and the
model registry `models`); importing this package itself loads nothing.
"""
