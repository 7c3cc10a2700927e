"""The engine's text side, torch-free: what the router imports.

Tokenizer (`tokenizer`), chat templates (`template`), incremental detokenizing with stop
strings (`text_stream`), the tiny model's byte tokenizer (`byte_tokenizer`), a lower bound on a
text's token count (`token_bound`), which chat format a checkpoint gets (`chat_format`) and
DeepSeek-V4's own chat encoder and reply parser (`chat/`). Nothing here imports torch; the
router's import test keeps it so.
"""
