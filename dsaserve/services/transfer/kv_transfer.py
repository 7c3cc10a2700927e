"""KVTransfer: one NIXL agent per worker process, pulling KV from peers with NIXL READs.

Pull model: the prefill worker holds a request's KV under a lease; the decode worker reserves
its own pages, then pulls. Two ways, by where the peer holds the KV (why: engine.kv.staging):
- `pull`: the peer packed it into staging blocks; they come a chunk per READ (one descriptor
  per run of blocks, from descriptor lists prepared once per peer) into a ring of our own
  blocks, and a callback scatters each landed chunk while the next ones are in flight.
- `read`: the peer still holds it in its pages; they come in ONE batched READ, one descriptor
  per run of pages consecutive on both sides.
Either may end with a notification for the peer, polled with `notifications`.

Threading: NIXL is not guaranteed thread-safe, so one KVTransfer must be used from one thread at
a time (the services call it from a single dedicated thread). Overlapping calls raise
RuntimeError instead of corrupting the agent. `descriptor()` and `agent_name` are the exception:
computed once at start, they are safe from any thread (the Describe RPC reads them).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import descs, layout, nixl_binding
from .errors import TransferError
from .layout import Descriptor, Region, RegionInfo

# Poll backoff while a READ is in flight: short enough to add little to a sub-millisecond GPU
# transfer, long enough to leave the GIL and a core to the rest of the process.
_POLL_MIN_S = 10e-6
_POLL_MAX_S = 20e-6
# The NIXL progress thread's longest wait for a UCX event (nixl_binding.agent): an idle worker
# costs ~0% of a core instead of a whole one.
PROGRESS_WAIT_US = 10_000
# Linux stretches a thread's short sleeps by its timer slack, 50 us by default (most of the READ
# of a pull's chunk on a GPU): polling threads ask for 1 us (prctl PR_SET_TIMERSLACK, in ns).
_PR_SET_TIMERSLACK, _TIMER_SLACK_NS = 29, 1000
_libc = ctypes.CDLL(None, use_errno=True)
Pages = Mapping[str, Sequence[int]]  # group -> page ids
OnChunk = Callable[[int, int], None]  # (chunk of the stream, ring slot it landed in)


@dataclass
class TransferStats:
    bytes: int
    descriptors: int  # after merging consecutive pages (or blocks), summed over regions
    seconds: float  # validation + descriptor build + post + completion (+ on_chunk calls)


@dataclass
class _Peer:
    raw: bytes  # its descriptor as received
    desc: Descriptor
    blocks: dict[str, Any] = field(default_factory=dict)  # group -> its prepared block list


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
        self._peers: dict[str, _Peer] = {}
        self._blocks: dict[str, Any] = {}  # group -> our prepared block list
        self._busy = threading.Lock()
        self._agent = nixl_binding.agent(agent_name, PROGRESS_WAIT_US)
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
            if known is not None and known.raw == descriptor:
                return desc.agent
            if known is not None:
                self._forget(desc.agent)
            load = self._agent.add_remote_agent
            name = _text(self._call("load the NIXL metadata of", desc.agent, load, desc.metadata))
            if name != desc.agent:
                self._agent.remove_remote_agent(name)
                raise TransferError(f"descriptor of {desc.agent!r} holds NIXL metadata of {name!r}")
            self._peers[name] = _Peer(descriptor, desc)
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
            desc = self._peer(peer).desc
            local, remote = self._rows(desc, remote_pages, local_pages)  # [n, 3] each
            if local.shape[0] == 0:
                if notify:  # nothing to move, but the peer waits for its notification
                    self._call("notify", peer, self._agent.send_notif, peer, notify)
            else:
                self._read(peer, desc.mem, local, remote, notify, timeout_s)
            nbytes = int(local[:, 1].sum())
            return TransferStats(nbytes, local.shape[0], time.perf_counter() - start)

    def pull(
        self,
        peer: str,
        group: str,
        remote_blocks: Sequence[int],
        ring: Sequence[Sequence[int]],
        nbytes: int,
        on_chunk: OnChunk,
        *,
        timeout_s: float,
        notify: bytes = b"",
    ) -> TransferStats:
        """Pull a stream of `nbytes` that `peer` holds in `remote_blocks` (stream order) of its
        region of `group` (a group of one region), a chunk of len(ring[0]) blocks per READ,
        through our blocks: chunk j lands in slot ring[j % len(ring)], and a READ per slot is in
        flight. Once chunk j has landed, on_chunk(j, slot) runs on this thread; it must be done
        with the slot when it returns. Then the peer gets `notify` (if not empty).

        Raises TransferError on a validation failure (nothing posted), an error, a dead peer or
        the timeout (over the whole pull), or what on_chunk raised; READs still in flight are
        released in every case.
        """
        with self._use():
            start = time.perf_counter()
            known = self._peer(peer)
            ours, theirs = self._block_regions(known.desc, group)
            remote = descs.page_ids(remote_blocks, theirs.pages, f"group {group!r} remote")
            slots = [descs.page_ids(s, ours.pages, f"group {group!r} local") for s in ring]
            chunk = slots[0].size if slots else 0
            if chunk == 0 or any(s.size != chunk for s in slots):
                raise TransferError(f"ring slots of {[s.size for s in slots]} blocks")
            if np.unique(np.concatenate(slots)).size != chunk * len(slots):
                raise TransferError("a block of our ring repeats")
            if nbytes <= 0 or remote.size != -(-nbytes // ours.page_bytes):
                raise TransferError(
                    f"{remote.size} blocks of {ours.page_bytes} bytes cannot hold {nbytes} bytes"
                )
            local_list, remote_list = self._prepared(peer, known, group, ours, theirs)
            chunks, descriptors = -(-remote.size // chunk), 0
            agent, inflight = self._agent, deque[Any]()  # NIXL transfer handles
            _sharp_sleeps()

            def post(j: int) -> None:
                nonlocal descriptors
                picked = remote[j * chunk : (j + 1) * chunk]
                into = slots[j % len(slots)][: picked.size]
                handle = self._call(
                    "start a READ from",
                    peer,
                    agent.make_prepped_xfer,
                    "READ",
                    local_list,
                    into.astype(np.int32),
                    remote_list,
                    picked.astype(np.int32),
                )
                inflight.append(handle)
                if self._call("post a READ to", peer, agent.transfer, handle) == "ERR":
                    raise TransferError(f"READ from {peer!r} failed as it was posted")
                descriptors += descs.runs(picked, into)[0].size  # as NIXL merges them

            try:
                for j in range(min(len(slots), chunks)):
                    post(j)
                for j in range(chunks):
                    self._wait(peer, inflight[0], start + timeout_s, timeout_s)
                    _release(inflight.popleft())
                    on_chunk(j, j % len(slots))
                    if j + len(slots) < chunks:
                        post(j + len(slots))
            finally:
                # Releasing an unfinished READ cancels it; on a GPU, a copy the transport has
                # already started ends within microseconds, long before the ring is used again.
                for handle in inflight:
                    _release(handle)
            if notify:
                self._call("notify", peer, agent.send_notif, peer, notify)
            moved = remote.size * ours.page_bytes
            return TransferStats(moved, descriptors, time.perf_counter() - start)

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
            for handle in self._blocks.values():
                self._agent.release_dlist_handle(handle)
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

    def _peer(self, peer: str) -> _Peer:
        known = self._peers.get(peer)
        if known is None:
            raise TransferError(f"unknown peer {peer!r}: add_peer(its descriptor) first")
        return known

    def _forget(self, peer: str) -> None:
        for handle in self._peers.pop(peer).blocks.values():
            self._agent.release_dlist_handle(handle)
        self._call("disconnect from", peer, self._agent.remove_remote_agent, peer)

    def _block_regions(self, desc: Descriptor, group: str) -> tuple[RegionInfo, RegionInfo]:
        """Our region of `group` and the peer's (layouts match, so it has the same one)."""
        ours = self._by_group.get(group, [])
        if len(ours) != 1:
            raise TransferError(f"group {group!r} has {len(ours)} regions here; a pull needs one")
        return ours[0], next(r for r in desc.regions if r.name == ours[0].name)

    def _prepared(
        self, peer: str, known: _Peer, group: str, ours: RegionInfo, theirs: RegionInfo
    ) -> tuple[Any, Any]:
        """Descriptor lists of every block of our region of `group` and of the peer's, prepared
        on first use: a READ then picks blocks by index (NIXL merges consecutive ones into one
        descriptor) with no per-READ preparation."""
        prep = self._agent.prep_xfer_dlist
        if group not in self._blocks:
            rows = descs.every_page(ours)
            self._blocks[group] = self._call(
                "prepare our blocks for", peer, prep, "", rows, ours.mem
            )
        if group not in known.blocks:
            rows = descs.every_page(theirs)
            known.blocks[group] = self._call(
                "prepare the blocks of", peer, prep, peer, rows, theirs.mem
            )
        return self._blocks[group], known.blocks[group]

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
        _sharp_sleeps()
        try:
            if self._call("post a READ to", peer, agent.transfer, handle) == "ERR":
                raise TransferError(f"READ from {peer!r} failed as it was posted")
            self._wait(peer, handle, deadline, timeout_s)
        finally:
            _release(handle)

    def _wait(self, peer: str, handle: Any, deadline: float, timeout_s: float) -> None:
        """Poll a posted READ until DONE; TransferError on an error or past `deadline`."""
        check = self._agent.check_xfer_state
        state, pause = self._call("complete a READ from", peer, check, handle), _POLL_MIN_S
        while state == "PROC":
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TransferError(f"READ from {peer!r} did not finish within {timeout_s:g} s")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _POLL_MAX_S)
            state = self._call("complete a READ from", peer, check, handle)
        if state != "DONE":
            raise TransferError(f"READ from {peer!r} failed (NIXL state {state})")

    @staticmethod
    def _call(action: str, peer: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call NIXL, turning its exceptions (they share no base class) into TransferError."""
        try:
            return fn(*args)
        except Exception as e:
            raise TransferError(f"could not {action} {peer!r}: {type(e).__name__}: {e}") from e


def _release(handle: Any) -> None:
    # Releasing an unfinished READ cancels it. If NIXL cannot, the handle stays on the agent's
    # leak list until the agent is destroyed; the READ's own error matters more.
    try:
        handle.release()
    except Exception:
        pass


def _sharp_sleeps() -> None:
    _libc.prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)


def _text(name: str | bytes) -> str:
    # NIXL returns agent names as bytes from some calls and str from others.
    return name.decode() if isinstance(name, bytes) else name
