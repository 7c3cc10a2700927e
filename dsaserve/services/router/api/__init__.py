"""The router's HTTP side, by dialect: what a client may send (`schemas`, `fields`, `body`), the
errors it gets (`errors`), OpenAI's envelopes, logprobs shapes and SSE (`envelopes`,
`logprobs`, `streaming`), and the other two dialects, Anthropic's Messages (`anthropic/`) and
OpenAI's Responses (`responses/`). The routes call the pipeline (services.router.generation)."""
