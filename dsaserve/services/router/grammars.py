"""Structured outputs' grammars for the router: built and compiled in processes of their own,
each under a time budget, the results kept by the request's hash.

A request's constraint (its response_format, strict tools, forced tool choice: engine.text.
chat.constraint) becomes a grammar, which is compiled for the model's tokenizer once here so
that what cannot be constrained is a 400 before any worker sees it. Building and compiling can
take as long as the schema makes them (llguidance's compile of a few hundred patternProperties
runs for tens of seconds, and nothing stops it once it started), so neither runs in the
router's process: a few child processes (`PROCESSES`) do it, one request at a time each, and a
child that has not answered within `--grammar-compile-timeout` is killed and replaced, its
request answered 400. The size of what is built is bounded too (`--max-grammar-bytes`), and
engine.text.schema_bounds refuses a schema with no finite instance. Results, grammars and
refusals alike, are kept by the hash of the request's constraint (LRU), so a schema sent again
costs nothing, a hostile one included.

The children start with the router (`start`, `dsaserve router`), or else with the first
grammar asked for (an embedded router, the tests': one that never sees one runs none); each
loads the tokenizer first (a fraction of a second) and takes no request before it is ready, so
the budget only counts the compile. The workers compile the grammar again for
their own engines, off their engines' threads (services.worker.process.compile_grammar).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from dsaserve.engine.text.chat.constraint import ReplyConstraint, reply_grammar
from dsaserve.engine.text.chat.dsml import Dialect
from dsaserve.engine.text.grammar import GrammarCompiler, GrammarError
from dsaserve.engine.text.tokenizer import Tokenizer
from dsaserve.services.router.api.errors import APIError

log = logging.getLogger(__name__)

PROCESSES = 2  # grammars compiled at once
CACHED = 256  # results kept
WAIT_S = 30.0  # the longest a grammar waits for a free process
_SPAWN = multiprocessing.get_context("spawn")  # (no fork of a process running threads)


@dataclass(frozen=True)
class GrammarJob:
    """What a reply's grammar is made from (engine.text.chat.constraint.reply_grammar)."""

    constraint: ReplyConstraint
    dialect: Dialect
    opens_reasoning: bool


class GrammarBuilder:
    def __init__(self, model_dir: str, timeout_s: float, max_bytes: int) -> None:
        self._model_dir, self._timeout_s, self._max_bytes = model_dir, timeout_s, max_bytes
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._results: OrderedDict[bytes, str | GrammarError | None] = OrderedDict()

    def start(self) -> None:
        """Start the processes (if they are not running yet)."""
        if not self._children:
            for _ in range(PROCESSES):
                self._spawn()

    async def stop(self) -> None:
        for task in self._starting:
            task.cancel()
        for child in self._children:
            child.kill()
        self._children.clear()

    async def build(self, job: GrammarJob) -> str | None:
        """The grammar of `job` (None: nothing to constrain), compiled; GrammarError naming
        what cannot be constrained, or that compiling took longer than the budget."""
        key = hashlib.sha256(pickle.dumps(job)).digest()
        if key not in self._results:
            self._results[key] = await self._compile(job)
            while len(self._results) > CACHED:
                self._results.popitem(last=False)
        self._results.move_to_end(key)
        result = self._results[key]
        if isinstance(result, GrammarError):
            raise result
        return result

    async def _compile(self, job: GrammarJob) -> str | GrammarError | None:
        self.start()
        try:  # (every process busy with other requests' grammars, or starting)
            child = await asyncio.wait_for(self._idle.get(), WAIT_S)
        except TimeoutError:
            raise APIError(
                503,
                "No grammar process was free to compile the reply's grammar; retry the request.",
                cause="grammar_busy",
                retry_after_s=1,
            ) from None
        try:
            kind, value, param = await child.ask(job, self._timeout_s)
        except TimeoutError:
            self._replace(child)
            return GrammarError(
                f"compiling the reply's grammar took longer than its {self._timeout_s:g} s "
                "budget (--grammar-compile-timeout); simplify the schema"
            )
        except (EOFError, OSError) as e:  # (the grammar library took its process down)
            log.warning("a grammar process failed (%s); starting another", e)
            self._replace(child)
            return GrammarError("the grammar library failed on this schema")
        except BaseException:  # cancelled mid-compile: its answer would go to the next job
            self._replace(child)
            raise
        self._idle.put_nowait(child)
        return GrammarError(value, param) if kind == "error" else value

    def _spawn(self) -> None:
        child = _Child(self._model_dir, self._max_bytes)
        self._children.add(child)
        task = asyncio.create_task(self._when_ready(child), name="grammar-process-start")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _when_ready(self, child: _Child) -> None:
        try:
            await child.ready()
        except (EOFError, OSError) as e:
            log.error("a grammar process did not start (%s)", e)
            child.kill()
            self._children.discard(child)
            return
        self._idle.put_nowait(child)

    def _replace(self, child: _Child) -> None:
        child.kill()
        self._children.discard(child)
        self._spawn()


class _Child:
    """One grammar process and our end of its pipe."""

    def __init__(self, model_dir: str, max_bytes: int) -> None:
        self.conn, theirs = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(
            target=_serve, args=(theirs, model_dir, max_bytes), name="dsaserve-grammar", daemon=True
        )
        self.proc.start()
        theirs.close()

    async def ready(self) -> None:
        await self._readable(None)
        if self.conn.recv() != "ready":
            raise OSError("unexpected first message")

    async def ask(self, job: GrammarJob, timeout_s: float) -> tuple[str, Any, str | None]:
        self.conn.send(job)
        await self._readable(timeout_s)
        reply: tuple[str, Any, str | None] = self.conn.recv()
        return reply

    async def _readable(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        fd = self.conn.fileno()
        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(ready, timeout_s)
        finally:
            loop.remove_reader(fd)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        with contextlib.suppress(OSError):
            self.conn.close()


def _serve(conn: Connection, model_dir: str, max_bytes: int) -> None:
    """A grammar process: build and compile each job it is sent, answer ("ok", grammar, None)
    or ("error", message, request field); ends when the router's end of the pipe closes."""
    compiler = GrammarCompiler(Tokenizer.from_pretrained(model_dir), capacity=1)
    conn.send("ready")
    while True:
        try:
            job: GrammarJob = conn.recv()
        except EOFError:
            return
        try:
            grammar = reply_grammar(
                job.constraint, compiler, job.dialect, job.opens_reasoning, max_bytes
            )
            if grammar is not None:
                compiler.check(grammar)
            conn.send(("ok", grammar, None))
        except GrammarError as e:
            conn.send(("error", str(e), e.param))
        except RecursionError:
            conn.send(("error", "the schema nests too deeply", None))
