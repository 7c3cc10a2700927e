"""The prefill worker: runs prompts, samples the first token, holds the KV for a decode worker."""
