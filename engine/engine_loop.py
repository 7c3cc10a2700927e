"""Runs an LLMEngine on its own thread and streams its outputs to asyncio code.

The engine is not thread-safe, so every change to it (new request, abort, reserve, join,
release) is a command executed on the engine thread between two steps; callers get the
result through a future. Outputs reach each request's asyncio queue with
`call_soon_threadsafe`, so services never block their event loop on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LoadSnapshot:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    held: int


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], object], Future]] = queue.Queue()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        free, total = engine.kv_usage()
        self._load = LoadSnapshot(running=0, waiting=0, free_blocks=free, total_blocks=total, held=0)
        self.failure: BaseException | None = None   # set if the engine thread died

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put((lambda e: None, Future()))   # wake the thread
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def load(self) -> LoadSnapshot:
        """The load after the last step (safe from any thread)."""
        return self._load

    # ---------------------------------------------------------------- commands

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run fn(engine) on the engine thread between steps."""
        fut: Future[T] = Future()
        if not self.alive:
            fut.set_exception(RuntimeError(f"the engine thread is not running ({self.failure!r})"))
        else:
            self._commands.put((fn, fut))
        return fut

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def subscribe(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """Outputs of `request_id` from now on (call before the request can produce any)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._subscribers[request_id] = (asyncio.get_running_loop(), q)
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    async def stream(self, request_id: str, q: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Yield the subscribed outputs until the finishing one; aborts the request if the
        consumer stops early (a cancelled RPC), so nothing stays allocated."""
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self.unsubscribe(request_id)
            if not finished:
                self.call(lambda e: e.abort(request_id))

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                block = not engine.has_unfinished()
                self._drain_commands(block)
                if engine.has_unfinished():
                    for out in engine.step():
                        self._publish(out)
                self._snapshot()
        except BaseException as e:  # recorded; the worker watchdog reports it
            log.exception("engine thread died")
            self.failure = e
            for loop, q in list(self._subscribers.values()):
                loop.call_soon_threadsafe(q.put_nowait, _failed_output())
        finally:
            while not self._commands.empty():
                _, fut = self._commands.get_nowait()
                fut.cancel()

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                fn, fut = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # handed to the caller
                    fut.set_exception(e)

    def _publish(self, out: RequestOutput) -> None:
        sub = self._subscribers.get(out.request_id)
        if sub is not None:
            loop, q = sub
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        free, total = self.engine.kv_usage()
        self._load = LoadSnapshot(running=len(sched.running), waiting=len(sched.waiting), free_blocks=free,
                                  total_blocks=total, held=self.engine.num_held)


def _failed_output() -> RequestOutput:
    return RequestOutput(request_id="", new_token_ids=[], text="", finished=True, finish_reason="abort",
                         prompt_tokens=0, completion_tokens=0)
