"""The offline API over data-parallel engines: `LLM(..., data_parallel_size=N)` runs engine 0 in
this process and engines 1..N-1 in processes of their own (each with its tensor-parallel ranks),
sends each request to the engine with the fewest unfinished ones, and gathers their outputs.

Every engine steps whenever engine 0 does (engine.parallel.lockstep): the others step in a loop
that takes requests from their inbox and puts outputs in a shared outbox, and block in the
lockstep while this process does not step. Engine 0's `close` stops them all.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
from typing import Any

import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm_engine import GroupStopped, LLMEngine
from dsaserve.engine.parallel.launch import STOP_TIMEOUT_S, die_with_parent
from dsaserve.engine.ports import free_port
from dsaserve.engine.request import RequestOutput
from dsaserve.engine.sampling_params import SamplingParams


class DataParallelEngines:
    """What LLM asks of an engine (add_request, abort, step, score, close), over N engines."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig) -> None:
        if config.master_port == 0:
            config = dataclasses.replace(config, master_port=free_port(config.master_addr))
        spawn = multiprocessing.get_context("spawn")
        self._outbox: Any = spawn.Queue()  # every other engine's RequestOutputs
        self._inboxes: list[Any] = []  # engine r's commands at [r - 1]
        self._processes = []
        for rank in range(1, config.data_parallel_size):
            self._inboxes.append(spawn.Queue())
            self._processes.append(
                spawn.Process(
                    target=serve_engine,
                    args=(
                        str(model_dir),
                        dataclasses.replace(config, data_parallel_rank=rank),
                        self._inboxes[-1],
                        self._outbox,
                    ),
                    name=f"dsaserve-dp-rank{rank}",
                    daemon=False,  # (it starts its tensor-parallel ranks; dies with this one)
                )
            )
        for p in self._processes:
            p.start()
        self.local = LLMEngine(model_dir, config)
        self.tokenizer, self.model_dir = self.local.tokenizer, self.local.model_dir
        self._owner: dict[str, int] = {}  # unfinished request -> its engine

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Queue a request on the engine with the fewest unfinished ones (ties: the lowest)."""
        self.local.new_request(request_id, prompt, params)  # every engine checks alike
        counts = [0] * (len(self._inboxes) + 1)
        for rank in self._owner.values():
            counts[rank] += 1
        rank = counts.index(min(counts))
        self._owner[request_id] = rank
        if rank == 0:
            self.local.add_request(request_id, prompt, params)
        else:
            self._inboxes[rank - 1].put(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> bool:
        rank = self._owner.pop(request_id, None)
        if rank is None:
            return False
        if rank == 0:
            return self.local.abort(request_id)
        self._inboxes[rank - 1].put(("abort", request_id))
        return True

    def step(self) -> list[RequestOutput]:
        """One step of every engine; engine 0's outputs and those the others have sent."""
        outputs = self.local.step()
        while True:
            try:
                outputs.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] from engine 0 (the others run padded steps meanwhile)."""
        return self.local.score(token_ids)

    def close(self) -> None:
        self.local.close()  # (its lockstep stop ends the others' loops)
        for p in self._processes:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()


def serve_engine(model_dir: str, config: EngineConfig, inbox: Any, outbox: Any) -> None:
    """Engine r's process: step in lockstep with the others, taking commands from `inbox`,
    until engine 0 stops the group."""
    die_with_parent()
    engine = LLMEngine(model_dir, config)
    try:
        while True:
            while True:
                try:
                    command = inbox.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    engine.add_request(*command[1:])
                else:
                    engine.abort(command[1])
            for out in engine.step():
                outbox.put(out)
    except GroupStopped:
        pass
    finally:
        engine.close()
