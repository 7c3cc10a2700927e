"""Runs an LLMEngine on its own thread and streams its outputs to asyncio code.

The engine is not thread-safe, so every change to it (new request, abort, reserve, join,
release) is a command executed on the engine thread between two steps: a call of one of the
engine's methods (`loop.call(engine.abort, request_id)`); callers get the result through a
future. Each request carries its own listener (an `OutputQueue`), which the
engine calls with the request's outputs; the queue hands them to its event loop with
`call_soon_threadsafe`, so services never block their event loop on the model. `stream` merges a
request's outputs to `interval` tokens each (a decode worker's --stream-interval), so the router,
gRPC and the client's SSE parsing pay per N tokens, not per token.

The loop also measures the step time a worker reports (engine.load.Load.step_ms). An engine that
must step while idle (data-parallel lockstep) steps every LOCKSTEP_IDLE_S (20 ms): a request
arriving at an idle group waits at most that for its first step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import ParamSpec, TypeVar

from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.load import Load
from dsaserve.engine.request import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
IDLE_WAIT_S = 0.5  # how long an idle engine thread waits for a command before looking again
# An idle engine of a data-parallel group steps this often (its peers may compute and need it;
# a request that arrives while every engine idles waits up to this long for its first step).
LOCKSTEP_IDLE_S = 0.02
STEP_TIME_WEIGHT = 0.2  # the newest step's weight in the measured step time (a moving average)


class OutputQueue:
    """One request's outputs, from the engine thread to the event loop that made this queue."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def __call__(self, out: RequestOutput) -> None:  # on the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def get(self) -> RequestOutput:
        return await self._queue.get()


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._load = engine.load()
        self._step_s = 0.0  # moving average of the steps that computed something
        self.failure: BaseException | None = None  # set if the engine thread died

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put((lambda: None, Future()))  # wake the thread
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread runs, and so does every rank of its tensor-parallel group."""
        return self._thread.is_alive() and self.failure is None and self.engine.group_alive()

    def load(self) -> Load:
        """The load after the last step (safe from any thread)."""
        return self._load

    # ---------------------------------------------------------------- commands

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run fn(*args, **kwargs) (a method of the engine or of one of its parts) on the engine
        thread between steps.

        The command runs even if nobody awaits its future any more (a cancelled RPC), so a
        cleanup sent this way (abort, release) always happens.
        """
        fut: Future[T] = Future()
        if not self.alive:
            fut.set_exception(RuntimeError(f"the engine thread is not running ({self.failure!r})"))
        else:
            self._commands.put((functools.partial(fn, *args, **kwargs), fut))
        return fut

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Await `call(fn, ...)`. Shielded: if the awaiting task is cancelled (its RPC was), the
        command still runs, so an abort or a release is never lost half way."""
        return await asyncio.shield(asyncio.wrap_future(self.call(fn, *args, **kwargs)))

    async def stream(
        self, request_id: str, outputs: OutputQueue, interval: int = 1
    ) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until the finishing one, each carrying at least `interval`
        new tokens (but the last: SGLang's and vLLM's --stream-interval); aborts the request if
        the consumer stops early (a cancelled RPC), so nothing stays allocated."""
        finished = False
        try:
            pending: RequestOutput | None = None  # outputs not yet yielded, merged
            while not finished:
                out = await outputs.get()
                finished = out.finished
                pending = out if pending is None else merge_outputs(pending, out)
                if finished or len(pending.new_token_ids) >= interval:
                    yield pending
                    pending = None
        finally:
            if not finished:
                self.call(self.engine.abort, request_id)

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.bind_thread()
            idle_wait = LOCKSTEP_IDLE_S if engine.steps_when_idle else IDLE_WAIT_S
            while not self._stopping.is_set():
                self._drain_commands(block=not engine.has_unfinished(), timeout=idle_wait)
                if engine.has_unfinished():
                    start = time.perf_counter()
                    engine.step()  # outputs reach each request's listener
                    self._measured(time.perf_counter() - start)
                elif engine.steps_when_idle:  # (a lockstep pad: not a step time)
                    engine.step()
                self._load = dataclasses.replace(engine.load(), step_ms=round(self._step_s * 1000))
        except BaseException as e:  # recorded; the worker watchdog reports it
            log.exception("engine thread died")
            self.failure = e
            engine.fail_all()
        finally:
            while not self._commands.empty():
                _, fut = self._commands.get_nowait()
                fut.cancel()

    def _measured(self, step_s: float) -> None:
        first = self._step_s == 0.0
        self._step_s = (
            step_s if first else self._step_s + STEP_TIME_WEIGHT * (step_s - self._step_s)
        )

    def _drain_commands(self, block: bool, timeout: float) -> None:
        while True:
            try:
                if block:
                    fn, fut = self._commands.get(timeout=timeout)
                else:
                    fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # handed to the caller
                    fut.set_exception(e)


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: their tokens, text and logprobs."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = [*(first.logprobs or ()), *(then.logprobs or ())]
    return dataclasses.replace(
        then,
        new_token_ids=[*first.new_token_ids, *then.new_token_ids],
        text=first.text + then.text,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
    )
