"""The router's settings: one frozen dataclass, the source of its flags and DSASERVE_* variables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dsaserve.engine.config import setting
from dsaserve.engine.text.chat.constraint import MAX_GRAMMAR_BYTES
from dsaserve.services.connections import GrpcTLS
from dsaserve.services.registry import DEFAULT_TTL_S
from dsaserve.services.router.policy import DEFAULT_BALANCE_BOUND, POLICIES


@dataclass(frozen=True)
class RouterSettings:
    """Router"""

    model_dir: str = setting(
        dataclasses.MISSING,
        "model directory (HF layout: config.json + tokenizer files)",
        flag="--model",
    )
    redis_url: str = setting("redis://127.0.0.1:6379/0", "the worker registry")
    served_model_name: str | None = setting(
        None, "model id clients send (default: the model directory's name)"
    )
    api_keys: tuple[str, ...] = setting(
        (), "accepted Bearer key (repeatable; none = no authentication)", flag="--api-key"
    )
    policy: str = setting(
        "cache_aware",
        "worker balancing policy: cache_aware sends a prompt to the prefill worker whose prefix "
        "cache holds the longest start of it (what each worker holds: a Redis stream of its "
        "cache's changes), within --balance-abs-threshold of the least load; the others balance "
        "load only",
        choices=sorted(POLICIES),
    )
    balance_abs_threshold: int = setting(
        DEFAULT_BALANCE_BOUND,
        "cache_aware: the most a worker's load (running + waiting + this router's calls) may "
        "exceed the least loaded worker's for a prefix it holds to still go there",
    )
    prefix_cache_scope: str | None = setting(
        None,
        "who shares prefix-cache hits: key (a prompt resumes only from what requests with the "
        "same API key computed, so its speed and cached_tokens tell nothing of other keys' "
        "prompts) or global (every request; the only scope without API keys); default: key "
        "when the router has API keys. A request's cache_salt (vLLM's field) partitions further",
        choices=["global", "key"],
    )
    max_inflight: int = setting(256, "requests running at once")
    max_queue: int = setting(1024, "requests waiting for a slot before 429s")
    max_queue_delay_s: float = setting(
        30.0,
        "seconds a request may wait for a slot (503 + Retry-After after); while the oldest "
        "waiter has waited half that long, new requests get a 429 at once",
        flag="--max-queue-delay",
    )
    decode_kv_threshold: float = setting(
        0.9,
        "a prompt is held back (at most --max-queue-delay, then 503 + Retry-After) while the "
        "decode workers' KV pages in use, counting the requests on their way there, exceed this "
        "fraction of their pages: no prefill computes KV that no decode worker can take "
        "(1.0: hold back only what would not fit)",
    )
    max_inflight_per_key: int | None = setting(
        None,
        "requests one API key may have running or queued at once; 429 above (default: "
        "--max-inflight, so one key never also holds the queue others wait in; 0 = no limit)",
    )
    max_request_bytes: int = setting(8 << 20, "largest request body accepted; 413 above")
    max_prompt_entries: int = setting(
        1 << 19,
        "most entries an answer may carry about its prompts, over all its generations (a prompt "
        "token counts k + 1 with prompt_logprobs: k, and with echo 1, plus k + 1 with logprobs: "
        "k), counted before any work; 400 above (the default fits 64 prompts of 2,048 tokens "
        "echoed with logprobs 1, lm-eval's loglikelihood requests at their largest)",
    )
    header_read_timeout_s: float = setting(
        10.0,
        "seconds a connection has to send a complete request head (from its opening or its "
        "previous response); closed after (slow or idle clients)",
        flag="--header-read-timeout",
    )
    body_read_timeout_s: float = setting(
        30.0,
        "seconds a client may send nothing in the middle of a request body; closed after",
        flag="--body-read-timeout",
    )
    h11_max_incomplete_event_size: int = setting(
        32 << 10,
        "largest request head (request line and header fields) in bytes; 431 above (vLLM's "
        "flag name)",
    )
    h11_max_header_count: int = setting(
        100, "most header fields a request may carry; 431 above (vLLM's flag name)"
    )
    max_connections: int | None = setting(
        None,
        "open HTTP connections at most; a new one above gets a 503 before it is read (default: "
        "--max-inflight + --max-queue + 256; 0 = no limit)",
    )
    grammar_compile_timeout_s: float = setting(
        1.5,
        "seconds a structured output's grammar may take to build and compile (in a process of "
        "its own, killed after); 400 above",
        flag="--grammar-compile-timeout",
    )
    max_grammar_bytes: int = setting(
        MAX_GRAMMAR_BYTES, "largest grammar a structured output may make, in bytes; 400 above"
    )
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's max_position_embeddings)"
    )
    cluster_token: str = setting(
        "",
        "shared secret sent to workers on every call; worker records in Redis must be signed "
        "with it (required)",
    )
    registry_ttl_s: float = setting(
        DEFAULT_TTL_S, "seconds a worker record lives without a heartbeat", flag="--registry-ttl"
    )
    request_timeout_s: float = setting(
        600.0, "seconds from a request's arrival to its last token", flag="--request-timeout"
    )
    host: str = setting(
        "127.0.0.1", "HTTP bind address (0.0.0.0: every interface; give an --api-key then)"
    )
    port: int = setting(8000, "HTTP port")
    stall_timeout_s: float = setting(
        30.0,
        "seconds a decode stream may send nothing before it is abandoned and its worker skipped, "
        "at least (20 of the decode worker's measured steps when that is longer)",
        flag="--stall-timeout",
    )
    default_thinking: bool = setting(
        False,
        "render chats in thinking mode unless a request says (chat_template_kwargs.thinking, "
        "reasoning_effort); replies then carry reasoning_content",
    )
    response_ttl_s: float = setting(
        3600.0,
        "seconds a Responses API response (store: true) stays in Redis for previous_response_id",
        flag="--response-ttl",
    )
    tls: GrpcTLS = field(default_factory=GrpcTLS)  # of the gRPC calls to workers

    def __post_init__(self) -> None:
        checks = [
            (
                bool(self.cluster_token),
                "--cluster-token (or DSASERVE_CLUSTER_TOKEN) is required: the router trusts only "
                "worker records signed with it",
            ),
            (self.max_inflight >= 1, f"max_inflight must be >= 1, got {self.max_inflight}"),
            (self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}"),
            (self.max_queue_delay_s > 0, "--max-queue-delay must be positive"),
            (
                0 < self.decode_kv_threshold <= 1,
                f"--decode-kv-threshold must be in (0, 1], got {self.decode_kv_threshold}",
            ),
            (
                self.balance_abs_threshold >= 0,
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}",
            ),
            (
                (self.max_inflight_per_key or 0) >= 0,
                f"max_inflight_per_key must be >= 0, got {self.max_inflight_per_key}",
            ),
            (
                self.prefix_cache_scope != "key" or bool(self.api_keys),
                "--prefix-cache-scope key partitions the cache by --api-key; give the router "
                "API keys",
            ),
            (
                not self.max_inflight_per_key or bool(self.api_keys),
                "max_inflight_per_key limits each --api-key; give the router API keys",
            ),
            (
                self.header_read_timeout_s > 0 and self.body_read_timeout_s > 0,
                "--header-read-timeout and --body-read-timeout must be positive",
            ),
            (
                self.h11_max_incomplete_event_size >= 1024 and self.h11_max_header_count >= 16,
                "--h11-max-incomplete-event-size must be >= 1024 and --h11-max-header-count "
                ">= 16 (a client's ordinary headers must fit)",
            ),
            (
                (self.max_connections or 0) >= 0,
                f"max_connections must be >= 0, got {self.max_connections}",
            ),
            (
                self.grammar_compile_timeout_s > 0 and self.max_grammar_bytes >= 1,
                "--grammar-compile-timeout and --max-grammar-bytes must be positive",
            ),
            (
                self.max_prompt_entries >= 1,
                f"max_prompt_entries must be >= 1, got {self.max_prompt_entries}",
            ),
            (
                self.max_request_bytes >= 1,
                f"max_request_bytes must be >= 1, got {self.max_request_bytes}",
            ),
            (
                self.stall_timeout_s > 0,
                f"stall_timeout must be positive, got {self.stall_timeout_s}",
            ),
            (self.response_ttl_s > 0, f"response_ttl must be positive, got {self.response_ttl_s}"),
            (
                self.request_timeout_s > 0,
                f"request_timeout must be positive, got {self.request_timeout_s}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 2,
                f"max_model_len must be >= 2, got {self.max_model_len}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def connection_limit(self) -> int:
        """Open HTTP connections at most (0: no limit): room for every running and queued
        request, and some for probes and clients between requests."""
        if self.max_connections is None:
            return self.max_inflight + self.max_queue + 256
        return self.max_connections

    @property
    def cache_by_key(self) -> bool:
        """Whether each API key has a prefix-cache namespace of its own."""
        return (self.prefix_cache_scope or ("key" if self.api_keys else "global")) == "key"

    @property
    def key_limit(self) -> int:
        """Requests one API key may have open at once (0: no limit)."""
        if self.max_inflight_per_key is None:
            return self.max_inflight
        return self.max_inflight_per_key
