"""Locust load test: users chatting with a dsaserve router over streaming OpenAI chat.

    DSASERVE_API_KEY=... locust --config loadtest/disagg.conf            # headless, topology disagg
    DSASERVE_API_KEY=... locust -f loadtest/locustfile.py -H http://127.0.0.1:8000   # web UI

Each user sends one request after another (closed loop), so `-u N` is the concurrency. Locust's
own timer stops at the response headers of a stream, so each request measures itself and reports
  "chat (stream)"   end-to-end latency, response_length = output tokens, failures with the cause
  "ttft"            time to first token (METRIC)
  "itl"             mean gap between tokens of the request, i.e. TPOT (METRIC)
A 200 whose stream carries `data: {"error": ...}`, ends without `data: [DONE]`, or (with
ignore_eos) produces other than --max-tokens tokens counts as a failure.

Prompt length: without --tokenizer, the first user sends two 1-token probes ("prompt calibration")
and sizes every prompt from the server's token counts, as bench_serving.py does. Without --model,
the first user asks the server's GET /v1/models which model it serves.

A user whose request failed waits before the next one (the server's Retry-After, else a backoff
doubling from 0.5 s to 10 s), so a broken server is not hammered with thousands of retries.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from gevent.lock import Semaphore
from locust import FastHttpUser, events, task

try:
    from loadtest.openai_stream import StreamRecord, auth_headers, chat_payload
    from loadtest.prompts import PROBE_WORDS, calibrated_words, load_tokenizer, make_prompt
except (
    ImportError
):  # `locust -f loadtest/locustfile.py` puts this folder, not the repo, on sys.path
    from openai_stream import StreamRecord, auth_headers, chat_payload  # type: ignore[no-redef]
    from prompts import PROBE_WORDS, calibrated_words, load_tokenizer, make_prompt  # type: ignore[no-redef]

log = logging.getLogger(__name__)
_calibration = Semaphore()
_prompt_words: int | None = None  # set once per Locust process by the first user
_served_model: str | None = None  # likewise, when --model is not given
BACKOFF_S = (0.5, 10.0)  # first and longest wait after a failed request


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group(
        "dsaserve chat", "request shape (also settable in a --config file)"
    )
    group.add_argument(
        "--model",
        default="",
        env_var="DSASERVE_SERVED_MODEL_NAME",
        help="served model name (default: the one GET /v1/models lists)",
    )
    group.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens")
    group.add_argument(
        "--max-tokens", type=int, default=64, help="output length (exact unless --no-ignore-eos)"
    )
    group.add_argument(
        "--tokenizer", default="", help="tokenizer.json or model folder, for exact prompt lengths"
    )
    group.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let the model stop at EOS; short outputs are fine",
    )
    group.add_argument("--chat-path", default="/v1/chat/completions")


def _lines(stream: Any) -> Iterator[str]:
    # readline returns as soon as one line is in; read(n) would wait for n bytes and smear TTFT.
    while line := stream.readline(b"\n"):
        yield line.decode("utf-8", "replace")


def _metric(name: str, seconds: float, length: int = 0) -> None:
    events.request.fire(
        request_type="METRIC",
        name=name,
        response_time=seconds * 1000.0,
        response_length=length,
        exception=None,
        context={},
    )


class ChatStreamUser(FastHttpUser):
    # Long generations outlast Locust's 60 s default; a retry would hide a failure and skew load.
    network_timeout = 600.0
    connection_timeout = 10.0
    max_retries = 0

    def on_start(self) -> None:
        self.opts = self.environment.parsed_options
        # The key comes from the environment, never the command line (visible in `ps`).
        self.headers = {
            **auth_headers(os.environ.get("DSASERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")),
            # Locust asks for gzip by default; a compressed SSE body could not be read line by line.
            "Accept-Encoding": "identity",
        }
        self.rng = random.Random()
        self.backoff = 0.0  # seconds to wait before the next request (0 after a success)
        self.model = self.opts.model or self._served_model()
        self.tokenizer = load_tokenizer(self.opts.tokenizer) if self.opts.tokenizer else None
        self.words = self.opts.prompt_tokens if self.tokenizer else self._calibrated_words()

    def wait_time(self) -> float:
        return self.backoff

    def _failed(self, retry_after: str | None = None) -> None:
        try:
            wait = float(retry_after) if retry_after else 2 * self.backoff
        except ValueError:
            wait = 2 * self.backoff
        self.backoff = min(max(wait, BACKOFF_S[0]), BACKOFF_S[1])

    def _served_model(self) -> str:
        global _served_model
        with _calibration:
            if _served_model is None:
                with self.client.get(
                    "/v1/models", headers=self.headers, catch_response=True, name="models"
                ) as resp:
                    models = resp.json().get("data") if resp.status_code == 200 else None
                    if not models:
                        resp.failure(f"HTTP {resp.status_code}: no model listed")
                        raise RuntimeError("GET /v1/models lists no model; pass --model")
                    _served_model = models[0]["id"]
            return _served_model

    def _calibrated_words(self) -> int:
        global _prompt_words
        with _calibration:  # one user probes, the others wait for its answer
            if _prompt_words is None:
                probes = []
                for words in PROBE_WORDS:
                    record = self._stream(make_prompt(words, self.rng), 1, "prompt calibration")
                    if not record.ok or record.prompt_tokens is None:
                        log.warning(
                            "no prompt calibration (%s): --prompt-tokens counts words",
                            record.error or "no usage",
                        )
                        _prompt_words = self.opts.prompt_tokens
                        break
                    probes.append((words, record.prompt_tokens))
                else:
                    _prompt_words = calibrated_words(self.opts.prompt_tokens, probes)
            return _prompt_words

    def _stream(self, prompt: str, max_tokens: int, name: str) -> StreamRecord:
        """One streamed request, reported under `name` with its end-to-end time."""
        ignore_eos = not self.opts.no_ignore_eos
        payload = chat_payload(self.model, prompt, max_tokens, ignore_eos=ignore_eos)
        record = StreamRecord(start=time.perf_counter())
        with self.client.post(
            self.opts.chat_path,
            json=payload,
            headers=self.headers,
            stream=True,
            catch_response=True,
            name=name,
        ) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
                resp.failure(record.error)
                self._failed(resp.headers.get("Retry-After"))
                return record
            try:
                for line in _lines(resp.stream):
                    record.feed(line, time.perf_counter())
                    if record.error:
                        break
            except Exception as e:  # connection dropped mid-stream
                record.error = f"{type(e).__name__}: {e}"
            record.finish(time.perf_counter())
            # Report the whole request, not time-to-headers.
            resp.request_meta["response_time"] = (record.latency or 0.0) * 1000.0
            resp.request_meta["response_length"] = record.output_tokens
            if record.ok and ignore_eos and record.output_tokens != max_tokens:
                record.error = f"got {record.output_tokens} tokens, asked for exactly {max_tokens}"
            if record.error:
                resp.failure(record.error)
                self._failed()
            else:
                resp.success()
                self.backoff = 0.0
        return record

    @task
    def chat(self) -> None:
        prompt = make_prompt(self.words, self.rng, self.tokenizer)
        record = self._stream(prompt, self.opts.max_tokens, "chat (stream)")
        if not record.ok:
            return
        if record.ttft is not None:
            _metric("ttft", record.ttft, record.prompt_tokens or 0)
        if record.itl:
            _metric("itl", sum(record.itl) / len(record.itl), record.output_tokens)
