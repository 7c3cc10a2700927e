"""KV transfer over real NIXL (UCX, host memory, loopback) between two processes.

The "prefill" side is a spawned process holding CPU pools with seeded contents; it hands its
descriptor to the test (as the Prefill service's Describe hands it to a decode worker) and
forwards every notification it gets. The test process is the "decode" side: it loads the
descriptor and READs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsaserve.services.transfer import KVTransfer, Region, TransferError

pytestmark = pytest.mark.e2e  # NIXL transfers between two processes

# Region name -> (group, page shape); bf16 throughout. Pages per group differ per worker, as pools
# are sized per worker.
LAYOUT = {
    "swa.0.kv": ("swa", (64, 32)),  # page: 64 rows x 32 = 4 KiB
    "csa.0.kv": ("csa", (64, 32)),  # 4 KiB
    "csa.0.idx": ("csa", (64, 8)),  # 1 KiB, indexed by the same csa page ids
    "slab": ("slab", (96,)),  # one per-request state row, 192 B
    "staging": ("staging", (256,)),  # a staging block, 512 B
}
PREFILL_UNITS = {"swa": 8, "csa": 16, "slab": 4, "staging": 24}
DECODE_UNITS = {"swa": 6, "csa": 12, "slab": 3, "staging": 12}
BLOCK = 512
PREFILL_SEED, DECODE_SEED = 1, 2
WAIT_S = 60.0  # bound on process start-up and on any notification


def _pools(seed: int, pages: dict[str, int], layout: dict = LAYOUT) -> dict[str, torch.Tensor]:
    """Pools with seeded random bytes, so either process can rebuild the other's contents."""
    g = torch.Generator().manual_seed(seed)
    pools = {}
    for name, (group, shape) in layout.items():
        t = torch.empty((pages[group], *shape), dtype=torch.bfloat16)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        pools[name] = t
    return pools


def _regions(pools: dict[str, torch.Tensor], layout: dict = LAYOUT) -> list[Region]:
    return [Region(name, layout[name][0], pools[name]) for name in layout]


def _prefill_main(agent: str, commands: mp.Queue, events: mp.Queue) -> None:
    """The prefill side: send its descriptor, then forward notifications until told to stop (or
    2 min pass)."""
    with KVTransfer(agent, _regions(_pools(PREFILL_SEED, PREFILL_UNITS))) as transfer:
        events.put(("ready", transfer.descriptor()))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for note in transfer.notifications():
                events.put(note)
            try:
                if commands.get(timeout=0.01) == "stop":
                    return
            except queue.Empty:
                pass


class Prefill:
    """A running prefill process and the queues to it."""

    def __init__(self, agent: str) -> None:
        ctx = mp.get_context("spawn")
        self.agent, self.commands, self.events = agent, ctx.Queue(), ctx.Queue()
        args = (agent, self.commands, self.events)
        self.process = ctx.Process(target=_prefill_main, args=args)
        self.process.start()
        kind, self.descriptor = self.next_event()
        assert kind == "ready"

    def next_event(self) -> tuple[str, bytes] | tuple[str, str]:
        return self.events.get(timeout=WAIT_S)

    def pause(self) -> None:
        """SIGSTOP, then wait until every thread has stopped (delivery is asynchronous)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + WAIT_S
        while not all(_stopped(t) for t in tasks.iterdir()):
            assert time.monotonic() < deadline, "the process did not stop"

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(WAIT_S)
        assert self.process.exitcode == -signal.SIGKILL

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put("stop")
            self.process.join(WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(WAIT_S)


def _stopped(task: Path) -> bool:
    # /proc/<pid>/task/<tid>/stat reads "tid (comm) STATE ..."; comm may hold spaces.
    try:
        return task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
    except FileNotFoundError:  # the thread exited
        return True


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    p = Prefill("prefill-0")
    yield p
    p.stop()


@pytest.fixture
def decode(request: pytest.FixtureRequest) -> Iterator[tuple[KVTransfer, dict[str, torch.Tensor]]]:
    pools = _pools(DECODE_SEED, DECODE_UNITS)
    with KVTransfer(f"decode-{request.node.name}", _regions(pools)) as transfer:
        yield transfer, pools


def test_read_scattered_pages_and_notify(prefill: Prefill, decode) -> None:
    transfer, pools = decode
    peer = transfer.add_peer(prefill.descriptor)
    assert peer == prefill.agent
    assert transfer.add_peer(prefill.descriptor) == peer  # idempotent

    remote = {"csa": [9, 3, 4, 5, 14], "swa": [6, 5, 1], "slab": [2]}
    local = {"csa": [0, 7, 8, 9, 2], "swa": [4, 3, 0], "slab": [1]}
    stats = transfer.read(peer, remote, local, notify=b"req-1:release", timeout_s=10)

    theirs, before = _pools(PREFILL_SEED, PREFILL_UNITS), _pools(DECODE_SEED, DECODE_UNITS)
    for name, (group, _) in LAYOUT.items():
        got, want = pools[name].view(torch.uint8), theirs[name].view(torch.uint8)
        untouched = before[name].view(torch.uint8)
        read = local.get(group, [])  # no staging blocks in this read
        assert torch.equal(got[read], want[remote.get(group, [])]), name
        rest = [u for u in range(DECODE_UNITS[group]) if u not in read]
        assert torch.equal(got[rest], untouched[rest]), f"{name}: pages outside the read changed"
    # csa: runs 9->0, 3..5->7..9, 14->2 in two regions; swa: 1->0 and the reversed pairs
    # 6->4, 5->3, which merge into 5..6->3..4; slab: one.
    assert stats.descriptors == 3 * 2 + 2 + 1
    assert stats.bytes == 5 * (4096 + 1024) + 3 * 4096 + 192
    assert prefill.next_event() == (transfer.agent_name, b"req-1:release")


def test_invalid_reads_raise_before_posting(prefill: Prefill, decode) -> None:
    transfer, pools = decode
    before = {name: t.clone() for name, t in pools.items()}
    peer = transfer.add_peer(prefill.descriptor)
    bad = [
        ({"csa": [PREFILL_UNITS["csa"]]}, {"csa": [0]}, "out of range"),  # one past the peer's pool
        ({"csa": [0]}, {"csa": [DECODE_UNITS["csa"]]}, "out of range"),  # 12 here, 16 there
        ({"csa": [0]}, {"csa": [-1]}, "out of range"),
        ({"csa": [0, 1]}, {"csa": [0]}, "2 remote pages but 1 local"),
        ({"csa": [0, 1]}, {"csa": [3, 3]}, "repeats"),
        ({"mla": [0]}, {"mla": [0]}, "unknown group"),
        ({"csa": [0]}, {"swa": [0]}, "groups"),
        ({"csa": [0.5]}, {"csa": [0]}, "integers"),
    ]
    for remote, local, message in bad:
        with pytest.raises(TransferError, match=message):
            transfer.read(peer, remote, local, notify=b"must-not-arrive", timeout_s=10)
    with pytest.raises(TransferError, match="unknown peer"):
        transfer.read("nobody", {"csa": [0]}, {"csa": [0]}, notify=b"x", timeout_s=10)
    for name, t in pools.items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name

    # Nothing was posted: the first notification the peer sees is this read's.
    transfer.read(peer, {"slab": [0]}, {"slab": [0]}, notify=b"after-invalid", timeout_s=10)
    assert prefill.next_event() == (transfer.agent_name, b"after-invalid")
    # An empty read moves nothing but still releases the peer's pages.
    stats = transfer.read(peer, {"csa": []}, {"csa": []}, notify=b"empty", timeout_s=10)
    assert (stats.bytes, stats.descriptors) == (0, 0)
    assert prefill.next_event() == (transfer.agent_name, b"empty")


def _slot_bytes(pools: dict[str, torch.Tensor], blocks: list[int]) -> torch.Tensor:
    return pools["staging"].view(torch.uint8)[blocks].clone()  # [blocks, BLOCK]


def test_pull_staged_blocks_through_a_ring(prefill: Prefill, decode) -> None:
    transfer, pools = decode
    before = {name: t.clone() for name, t in pools.items()}
    peer = transfer.add_peer(prefill.descriptor)
    # Stream order; runs of consecutive blocks (7-9, 3-4, 20-23) and single ones. The ring has
    # three slots of two blocks, so six chunks, the last of one block, partly used.
    remote = [7, 8, 9, 3, 4, 20, 21, 22, 23, 0, 11]
    ring = [[0, 1], [4, 5], [8, 9]]
    nbytes = 10 * BLOCK + 100
    chunks: list[tuple[int, torch.Tensor]] = []

    def on_chunk(chunk: int, slot: int) -> None:
        assert chunk == len(chunks)  # in stream order, one call per chunk
        chunks.append((slot, _slot_bytes(pools, ring[slot])))

    stats = transfer.pull(
        peer, "staging", remote, ring, nbytes, on_chunk, notify=b"pulled", timeout_s=10
    )
    theirs = _pools(PREFILL_SEED, PREFILL_UNITS)["staging"].view(torch.uint8)
    assert [slot for slot, _ in chunks] == [0, 1, 2, 0, 1, 2]
    for j, (_, landed) in enumerate(chunks):
        blocks = remote[2 * j : 2 * j + 2]
        assert torch.equal(landed[: len(blocks)], theirs[blocks]), f"chunk {j}"
    # Chunks [7, 8] [9, 3] [4, 20] [21, 22] [23, 0] [11]: a descriptor per run in each.
    assert (stats.bytes, stats.descriptors) == (11 * BLOCK, 9)
    assert prefill.next_event() == (transfer.agent_name, b"pulled")
    ring_blocks = [b for slot in ring for b in slot]
    for name, t in pools.items():  # nothing outside the ring was written
        got, was = t.view(torch.uint8), before[name].view(torch.uint8)
        if name == "staging":
            rest = [b for b in range(DECODE_UNITS["staging"]) if b not in ring_blocks]
            got, was = got[rest], was[rest]
        assert torch.equal(got, was), name


def test_invalid_pulls_post_nothing_and_a_failed_scatter_ends_the_pull(
    prefill: Prefill, decode
) -> None:
    transfer, pools = decode
    peer = transfer.add_peer(prefill.descriptor)
    ring = [[0, 1], [2, 3]]
    bad = [
        ("staging", [PREFILL_UNITS["staging"]], ring, BLOCK, "out of range"),
        ("staging", [0], [[0], [DECODE_UNITS["staging"]]], BLOCK, "out of range"),
        ("staging", [0, 1], ring, BLOCK, "2 blocks of 512 bytes cannot hold 512"),
        ("staging", [0], ring, 0, "cannot hold 0"),
        ("staging", [0], [[0, 1], [1, 2]], BLOCK, "repeats"),
        ("staging", [0], [[0, 1], [2]], BLOCK, "ring slots"),
        ("staging", [0], [], BLOCK, "ring slots"),
        ("csa", [0], ring, BLOCK, "has 2 regions here"),
    ]
    for group, remote, slots, nbytes, message in bad:
        with pytest.raises(TransferError, match=message):
            transfer.pull(peer, group, remote, slots, nbytes, _never, notify=b"no", timeout_s=10)
    with pytest.raises(TransferError, match="unknown peer"):
        transfer.pull("nobody", "staging", [0], ring, BLOCK, _never, timeout_s=10)

    # A failing on_chunk ends the pull; the READs still in flight are released, and the next
    # pull (whose notification is the first the peer sees) works.
    def fail(chunk: int, slot: int) -> None:
        raise RuntimeError("scatter failed")

    with pytest.raises(RuntimeError, match="scatter failed"):
        transfer.pull(peer, "staging", list(range(8)), ring, 8 * BLOCK, fail, timeout_s=10)
    landed = []
    transfer.pull(
        peer,
        "staging",
        [5],
        ring,
        BLOCK,
        lambda chunk, slot: landed.append(_slot_bytes(pools, ring[slot])[0]),
        notify=b"after-invalid",
        timeout_s=10,
    )
    theirs = _pools(PREFILL_SEED, PREFILL_UNITS)["staging"].view(torch.uint8)
    assert torch.equal(landed[0], theirs[5])
    assert prefill.next_event() == (transfer.agent_name, b"after-invalid")


def _never(chunk: int, slot: int) -> None:
    raise AssertionError("nothing may land")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"csa.0.idx": ("csa", (64, 16))}, "'csa.0.idx' has 2048 page bytes here, 1024 there"),
        ({"csa.0.idx": ("hca", (64, 8))}, "'csa.0.idx' is in group 'hca' here but 'csa' there"),
        ({"csa.1.kv": ("csa", (64, 32))}, "'csa.1.kv' is missing at the peer"),
        ({"slab": None}, "the peer has region 'slab', which is missing here"),
    ],
)
def test_mismatched_layout_raises(prefill: Prefill, change: dict, message: str) -> None:
    layout = {name: spec for name, spec in {**LAYOUT, **change}.items() if spec is not None}
    pools = _pools(DECODE_SEED, {**DECODE_UNITS, "hca": 4}, layout)
    with KVTransfer("decode-other-layout", _regions(pools, layout)) as transfer:
        with pytest.raises(TransferError, match=f"mismatch with peer 'prefill-0': .*{message}"):
            transfer.add_peer(prefill.descriptor)
        with pytest.raises(TransferError, match="malformed"):
            transfer.add_peer(b'{"format": "something else"}')


def test_dead_peer_raises_within_timeout(decode) -> None:
    transfer, _ = decode
    doomed = Prefill("prefill-doomed")
    try:
        peer = transfer.add_peer(doomed.descriptor)
        transfer.read(peer, {"csa": [1]}, {"csa": [1]}, notify=b"alive", timeout_s=10)
        doomed.kill()
        for _ in range(2):  # and the connection stays failed, without hanging
            start = time.monotonic()
            with pytest.raises(TransferError):
                transfer.read(peer, {"csa": [2]}, {"csa": [2]}, notify=b"dead", timeout_s=5)
            assert time.monotonic() - start < 5  # UCX reported the death; no wait for the timeout
        start = time.monotonic()
        with pytest.raises(TransferError):
            transfer.pull(peer, "staging", [0, 1], [[0], [1]], 2 * BLOCK, _never, timeout_s=5)
        assert time.monotonic() - start < 5
        transfer.remove_peer(peer)
    finally:
        doomed.stop()


def test_hung_peer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over TCP a READ needs the peer's UCX progress, so a stopped (not dead) peer never answers:
    # the READ must end at the timeout, with its in-flight handle released.
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent below creates its backend
    hung = Prefill("prefill-hung")
    try:
        with KVTransfer("decode-tcp", _regions(_pools(DECODE_SEED, DECODE_UNITS))) as transfer:
            peer = transfer.add_peer(hung.descriptor)
            transfer.read(peer, {"csa": [1]}, {"csa": [1]}, notify=b"alive", timeout_s=10)
            hung.pause()
            start = time.monotonic()
            with pytest.raises(TransferError, match="did not finish within 2 s"):
                transfer.read(peer, {"csa": [2]}, {"csa": [2]}, notify=b"hung", timeout_s=2)
            assert time.monotonic() - start < 2 + 1
            start = time.monotonic()
            with pytest.raises(TransferError, match="did not finish within 2 s"):
                transfer.pull(
                    peer, "staging", [0, 1, 2], [[0], [1]], 3 * BLOCK, _never, timeout_s=2
                )
            assert time.monotonic() - start < 2 + 1
    finally:
        hung.kill()
