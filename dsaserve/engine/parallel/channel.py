"""Rank 0 -> the other ranks of a group: the calls that keep every rank's runner in step.

A `Call` names a `ModelRunner` method, its arguments (a step's RowSpans, page ids: small host
data, never tensors) and the page-table writes rank 0's scheduler made since the last call;
each follower applies the writes, then runs the same method on its own shard. Those writes
and the steps' own KV writes are the only changes to KV state: frees need no message (a slab
row's page table is rewritten when the row is given out again, a page's contents by its next
owner's steps). Messages are
pickled and broadcast over a gloo group (TCP on this host): one broadcast of a fixed-size head
carries a whole decode step or most prefill chunks, a second one the rest of a longer message.
Followers wait in that broadcast while the engine idles, so the group's timeout is unbounded; a
rank that dies closes its sockets, and the broadcasts of the others raise.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

HEAD_BYTES = 1 << 16  # one broadcast up to here (a 64-request decode step pickles to ~2 KB)
_LEN = 8  # the head starts with the message's length, int64


class Call(NamedTuple):
    method: str  # a ModelRunner method every rank runs
    args: tuple[Any, ...]
    table_writes: list[tuple[int, str, int, list[int]]]  # KVPool.write_page_table arguments


class Channel:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.src = dist.get_global_rank(group, 0)  # the group's rank 0 (data parallel: not 0)
        self._head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)

    def send(self, message: Call | None) -> None:
        """Rank 0: hand `message` to every other rank (None: stop serving)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        fits = min(len(data), HEAD_BYTES - _LEN)
        self._head[:_LEN].view(torch.int64)[0] = len(data)
        self._head[_LEN : _LEN + fits] = torch.frombuffer(bytearray(data[:fits]), dtype=torch.uint8)
        dist.broadcast(self._head, src=self.src, group=self.group)
        if fits < len(data):
            rest = torch.frombuffer(bytearray(data[fits:]), dtype=torch.uint8)
            dist.broadcast(rest, src=self.src, group=self.group)

    def recv(self) -> Call | None:
        """Another rank: the next message from rank 0 (blocks until it comes)."""
        dist.broadcast(self._head, src=self.src, group=self.group)
        size = int(self._head[:_LEN].view(torch.int64)[0])
        fits = min(size, HEAD_BYTES - _LEN)
        data = self._head[_LEN : _LEN + fits].numpy().tobytes()
        if fits < size:
            rest = torch.empty(size - fits, dtype=torch.uint8)
            dist.broadcast(rest, src=self.src, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)
