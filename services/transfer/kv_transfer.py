"""KVTransfer: one NIXL agent per worker process, pulling KV pages from peers with one READ.

Pull model: the prefill worker holds a request's pages under a lease; the decode worker reserves
its own pages, then `read`s the prefill worker's pages in ONE batched NIXL READ (which may carry
a notification for the peer, polled with `notifications`).

Threading: NIXL is not guaranteed thread-safe, so one KVTransfer must be used from one thread at
a time (the services call it from a single dedicated thread). Overlapping calls raise
RuntimeError instead of corrupting the agent. `descriptor()` and `agent_name` are the exception:
computed once at start, they are safe from any thread (the Redis heartbeat reads them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _nixl, descs, layout
from .errors import TransferError
from .layout import Descriptor, Region, RegionInfo

# Poll backoff while a READ is in flight: short enough to add little to a sub-millisecond GPU
# transfer, long enough to leave the GIL and a core to the rest of the process.
_POLL_MIN_S = 10e-6
_POLL_MAX_S = 50e-6

Pages = Mapping[str, Sequence[int]]  # group -> page ids


@dataclass
class TransferStats:
    bytes: int
    descriptors: int  # after merging consecutive pages, summed over regions
    seconds: float  # validation + descriptor build + post + completion


class KVTransfer:
    """A worker's NIXL agent (UCX backend) with all its KV regions registered once."""

    def __init__(self, agent_name: str, regions: Sequence[Region]) -> None:
        self._name = agent_name
        self._regions = layout.describe(regions)
        self._by_group: dict[str, list[RegionInfo]] = {}
        for r in self._regions:
            self._by_group.setdefault(r.group, []).append(r)
        self._mem = self._regions[0].mem
        self._tensors = [r.tensor for r in regions]  # keeps the registered memory alive
        self._peers: dict[str, tuple[bytes, Descriptor]] = {}  # name -> (raw, decoded)
        self._busy = threading.Lock()
        self._agent = _nixl.nixl_agent(agent_name, _nixl.nixl_agent_config(backends=[]))
        # "peer" error handling makes UCX fail an in-flight READ when the peer dies
        # (NIXL_ERR_REMOTE_DISCONNECT); with "none" such a READ can hang forever.
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        spans = [(r.addr, r.page_bytes * r.pages, r.device, "") for r in self._regions]
        self._registered = self._agent.register_memory(spans, self._mem)
        metadata = self._agent.get_agent_metadata()
        self._descriptor = layout.encode(agent_name, metadata, self._regions)

    @property
    def agent_name(self) -> str:
        return self._name

    def descriptor(self) -> bytes:
        """Everything a peer needs to read from us: NIXL metadata + region table (JSON)."""
        return self._descriptor

    def add_peer(self, descriptor: bytes) -> str:
        """Load a peer's descriptor (idempotent); returns its agent name.

        Raises TransferError if the descriptor is malformed or the peer's layout differs from
        ours (naming the first difference). A changed descriptor under a known name (the peer
        restarted) replaces the old one.
        """
        with self._use():
            desc = layout.decode(descriptor)
            if desc.agent == self._name:
                raise TransferError(f"the peer descriptor carries our own name {self._name!r}")
            diff = layout.first_difference(self._regions, desc.regions)
            if diff is not None:
                raise TransferError(f"layout mismatch with peer {desc.agent!r}: {diff}")
            known = self._peers.get(desc.agent)
            if known is not None and known[0] == descriptor:
                return desc.agent
            if known is not None:
                self._forget(desc.agent)
            load = self._agent.add_remote_agent
            name = _text(self._call("load the NIXL metadata of", desc.agent, load, desc.metadata))
            if name != desc.agent:
                self._agent.remove_remote_agent(name)
                raise TransferError(f"descriptor of {desc.agent!r} holds NIXL metadata of {name!r}")
            self._peers[name] = (descriptor, desc)
            return name

    def read(
        self,
        peer: str,
        remote_pages: Pages,
        local_pages: Pages,
        *,
        timeout_s: float,
        notify: bytes = b"",
    ) -> TransferStats:
        """Pull pages of `peer` into our pages with one READ; the peer gets `notify` (if not
        empty) when it is done.

        remote_pages / local_pages: group -> page ids, same groups and lengths; position i of
        remote goes to position i of local, in every region of the group. Blocks until the READ
        is DONE; raises TransferError on a validation failure (nothing posted), an error, a dead
        peer or the timeout (the transfer handle is released in every case).
        """
        with self._use():
            start = time.perf_counter()
            desc = self._peer(peer)
            local, remote = self._rows(desc, remote_pages, local_pages)  # [n, 3] each
            if local.shape[0] == 0:
                if notify:  # nothing to move, but the peer waits for its notification
                    self._call("notify", peer, self._agent.send_notif, peer, notify)
            else:
                self._read(peer, desc.mem, local, remote, notify, timeout_s)
            nbytes = int(local[:, 1].sum())
            return TransferStats(nbytes, local.shape[0], time.perf_counter() - start)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications since the last call: (peer agent, message), in order per peer."""
        with self._use():
            notes = self._call("poll", "notifications", self._agent.get_new_notifs)
            return [(_text(peer), m) for peer, msgs in notes.items() for m in msgs]

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and disconnect from it; unknown peers are ignored."""
        with self._use():
            if peer in self._peers:
                self._forget(peer)

    def close(self) -> None:
        """Disconnect from every peer and deregister our memory. Idempotent."""
        with self._busy:
            if self._agent is None:
                return
            for peer in list(self._peers):
                self._forget(peer)
            self._agent.deregister_memory(self._registered)
            self._agent = None
            self._tensors.clear()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    @contextmanager
    def _use(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"KVTransfer {self._name!r} used from two threads at once")
        try:
            if self._agent is None:
                raise TransferError(f"KVTransfer {self._name!r} is closed")
            yield
        finally:
            self._busy.release()

    def _peer(self, peer: str) -> Descriptor:
        known = self._peers.get(peer)
        if known is None:
            raise TransferError(f"unknown peer {peer!r}: add_peer(its descriptor) first")
        return known[1]

    def _forget(self, peer: str) -> None:
        del self._peers[peer]
        self._call("disconnect from", peer, self._agent.remove_remote_agent, peer)

    def _rows(
        self, desc: Descriptor, remote_pages: Pages, local_pages: Pages
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validated, merged descriptor rows (addr, bytes, device): local and remote [n, 3]."""
        if set(remote_pages) != set(local_pages):
            raise TransferError(
                f"remote groups {sorted(remote_pages)} != local groups {sorted(local_pages)}"
            )
        theirs = {r.name: r for r in desc.regions}
        local_rows, remote_rows = [], []
        for group in remote_pages:
            ours = self._by_group.get(group)
            if ours is None:
                raise TransferError(f"unknown group {group!r}; groups: {sorted(self._by_group)}")
            peer_pages = theirs[ours[0].name].pages  # layouts match, so the names exist
            r_ids = descs.page_ids(remote_pages[group], peer_pages, f"group {group!r} remote")
            l_ids = descs.page_ids(local_pages[group], ours[0].pages, f"group {group!r} local")
            if r_ids.size != l_ids.size:
                raise TransferError(
                    f"group {group!r}: {r_ids.size} remote pages but {l_ids.size} local pages"
                )
            if np.unique(l_ids).size != l_ids.size:
                raise TransferError(f"group {group!r}: a local page id repeats")
            r_start, l_start, lengths = descs.runs(r_ids, l_ids)
            for region in ours:
                local_rows.append(descs.rows(region, l_start, lengths))
                remote_rows.append(descs.rows(theirs[region.name], r_start, lengths))
        empty = np.zeros((0, 3), np.uint64)
        return np.concatenate([empty, *local_rows]), np.concatenate([empty, *remote_rows])

    def _read(
        self,
        peer: str,
        remote_mem: str,
        local: np.ndarray,
        remote: np.ndarray,
        notify: bytes,
        timeout_s: float,
    ) -> None:
        agent = self._agent
        deadline = time.perf_counter() + timeout_s
        local_descs = agent.get_xfer_descs(local, self._mem)
        remote_descs = agent.get_xfer_descs(remote, remote_mem)
        handle = self._call(
            "start a READ from",
            peer,
            agent.initialize_xfer,
            "READ",
            local_descs,
            remote_descs,
            peer,
            notify,
        )
        try:
            state = self._call("post a READ to", peer, agent.transfer, handle)
            pause = _POLL_MIN_S
            while state == "PROC":
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TransferError(f"READ from {peer!r} did not finish within {timeout_s:g} s")
                time.sleep(min(pause, left))
                pause = min(2 * pause, _POLL_MAX_S)
                state = self._call("complete a READ from", peer, agent.check_xfer_state, handle)
            if state != "DONE":
                raise TransferError(f"READ from {peer!r} failed (NIXL state {state})")
        finally:
            # Releasing an unfinished READ cancels it. If NIXL cannot, the handle stays on the
            # agent's leak list until the agent is destroyed; the READ's own error matters more.
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                pass

    @staticmethod
    def _call(action: str, peer: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call NIXL, turning its exceptions (they share no base class) into TransferError."""
        try:
            return fn(*args)
        except Exception as e:
            raise TransferError(f"could not {action} {peer!r}: {type(e).__name__}: {e}") from e


def _text(name: str | bytes) -> str:
    # NIXL returns agent names as bytes from some calls and str from others.
    return name.decode() if isinstance(name, bytes) else name
