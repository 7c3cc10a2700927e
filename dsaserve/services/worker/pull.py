"""Pulling KV that a peer worker holds for us: its NIXL agent loaded once, one READ of what we
lack, then the peer's word that its pages stayed held until the READ was over.

Two pulls use it: a decode worker pulls a prompt's KV from the prefill worker that computed it
(Claim, READ, Release: services.decode.service), and a prefill worker pulls the state of a
conversation's last turn from the decode worker that lends it (Lend, READ, Return:
services.prefill.borrow). A READ is one-sided and the peer reuses freed memory at once, so what
was read is used only when the peer answers `intact`; otherwise the pull fails with a cause.

What is read is what our own prefix cache lacks (`KVPages.reused_tokens`, KVPool.missing): the
first blocks of a staged stream (the newest pages come first), or the pages past those, into
the first of our reserved pages (a borrowed prefix fills only some of them).

Before the first READ from a peer agent, the peer's Describe (gRPC, at the handle's address)
gives its NIXL descriptor: not the registry, so workers pair while Redis is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from dsaserve.engine.kv.layout import STAGING
from dsaserve.engine.load import step_deadline
from dsaserve.engine.request import KVPages
from dsaserve.services import connections
from dsaserve.services.auth import token_metadata
from dsaserve.services.rpc import pb
from dsaserve.services.transfer import TransferError, TransferStats
from dsaserve.services.worker.process import Worker

log = logging.getLogger(__name__)
# Bound on one Claim, Lend, Release or Describe call: at least this, longer for a peer whose
# steps are slow (a loaded host answers every RPC slowly, the control ones too).
CONTROL_TIMEOUT_S = 10.0
CONTROL_STEPS = 10
HOLD_MARGIN_S = 5.0  # a claim or a loan outlasts the READ's own timeout by this much

Describe = Callable[..., Awaitable[pb.DescribeResponse]]  # a stub's Describe
Release = Callable[..., Awaitable[pb.ReleaseResponse]]  # a stub's Release or Return


class PullFailed(Exception):
    """The peer's KV could not be pulled; `cause` labels it for metrics and the router."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class KVPuller:
    def __init__(self, worker: Worker, timeout_s: float) -> None:
        """timeout_s: the longest one READ may take (--transfer-timeout)."""
        self.w, self.timeout_s = worker, timeout_s
        self.metadata = token_metadata(worker.settings.cluster_token)
        self.peers: dict[str, str] = {}  # peer worker id -> its NIXL agent we have loaded
        self._channels: dict[str, grpc.aio.Channel] = {}  # by address

    @property
    def hold_ms(self) -> int:
        """How long to ask a peer to hold what we read: the READ's bound and a margin."""
        return int((self.timeout_s + HOLD_MARGIN_S) * 1000)

    def control_s(self, kv: pb.KVHandle) -> float:
        """The deadline of a control call to the peer holding `kv` (its steps' pace)."""
        return step_deadline(CONTROL_TIMEOUT_S, CONTROL_STEPS, kv.step_ms)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = connections.open_channel(address, self.w.settings.tls)
        return self._channels[address]

    async def peer(self, kv: pb.KVHandle, describe: Describe) -> str:
        """The peer's NIXL agent, loaded once per agent from its Describe.

        A restarted worker keeps its id but gets a new agent name: the old agent is dropped. A
        handle naming another agent than the worker runs now was made before it restarted, and
        the KV it names died with that process. A layout unlike ours: PullFailed
        "layout_mismatch".
        """
        agent = kv.agent_name
        if self.peers.get(kv.worker_id) == agent:
            return agent
        try:
            described = await describe(
                pb.DescribeRequest(), timeout=self.control_s(kv), metadata=self.metadata
            )
        except grpc.aio.AioRpcError as e:
            raise PullFailed(
                "peer_unreachable",
                f"worker {kv.worker_id} did not describe its NIXL agent: {e.details()}",
            ) from None
        if described.agent_name != agent:
            raise PullFailed(
                "peer_unknown",
                f"worker {kv.worker_id} restarted: it runs NIXL agent {described.agent_name}, "
                f"not {agent} which held the KV; the request must be retried",
            )
        known = self.peers.get(kv.worker_id)  # again: another request may have loaded it since
        if known == agent:
            return agent
        if known is not None:
            await self.w.in_nixl_thread(self.w.transfer.remove_peer, known)
        try:
            await self.w.in_nixl_thread(self.w.transfer.add_peer, described.descriptor)
        except TransferError as e:
            raise PullFailed("layout_mismatch", str(e)) from None
        self.peers[kv.worker_id] = agent
        return agent

    async def read(
        self, rid: str, peer: str, kv: pb.KVHandle, reserved: KVPages, release: Release
    ) -> None:
        """READ what `kv` holds but our reserved pages share from our cache, then release it
        at the peer (`release`: its Release or Return); PullFailed unless the pages read were
        intact. Counts the bytes, pages pulled and pages reused."""
        w, pool, skip = self.w, self.w.engine.pool, reserved.reused_tokens
        remote = {g: list(p.ids) for g, p in kv.pages.items()}
        wanted = pool.missing(reserved.pages, skip)
        if STAGING in remote:
            ours = wanted
            read = w.nixl_submit(self._pull_staged, peer, remote[STAGING], reserved)
        else:
            theirs = pool.missing(remote, skip)
            ours = {g: pages[: len(theirs[g])] for g, pages in wanted.items()}
            read = w.nixl_submit(w.transfer.read, peer, theirs, ours, timeout_s=self.timeout_s)
        w.reads[rid] = read  # (an abort meanwhile frees the pages once it is over: Worker.abort)
        try:
            stats = await asyncio.wrap_future(read)
        except TransferError as e:
            self.peers.pop(kv.worker_id, None)  # Describe it afresh next time
            await self.release(release, kv, rid)  # (free them there now, not at the lease's end)
            raise PullFailed("transfer", f"KV transfer from {kv.worker_id} failed: {e}") from e
        finally:
            if read.done():
                w.reads.pop(rid, None)
        if not await self.release(release, kv, rid):
            raise PullFailed(
                "lease_expired",
                f"worker {kv.worker_id} freed the KV of {rid} before the transfer finished "
                "(its lease ran out); the request must be retried",
            )
        w.metrics.transfer_bytes.inc(stats.bytes)
        w.metrics.transfer_seconds.observe(stats.seconds)
        pulled = sum(len(pages) for g, pages in ours.items() if g in pool.groups)
        w.metrics.pulled_pages.inc(pulled)
        w.metrics.reused_pages.inc(
            sum(len(reserved.pages[g]) - len(wanted[g]) for g in pool.groups if g in wanted)
        )

    async def release(self, release: Release, kv: pb.KVHandle, rid: str) -> bool:
        """Let the peer free what it held for us; True if it was intact until now."""
        try:
            response = await release(
                pb.ReleaseRequest(request_id=rid),
                timeout=self.control_s(kv),
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as e:  # unknown: the read cannot be trusted
            log.warning("releasing %s at %s failed: %s", rid, kv.worker_id, e.code())
            return False
        return response.intact

    def _pull_staged(self, peer: str, blocks: list[int], reserved: KVPages) -> TransferStats:
        """Pull staged KV into our reserved pages (on the NIXL thread). The pool's geometry is
        fixed and only these pages are written, which no step reads before the request joins,
        so this thread may use the engine's pool."""
        pool = self.w.engine.pool
        unpack = pool.unpacker(reserved.pages, reserved.reused_tokens)
        return self.w.transfer.pull(
            peer,
            STAGING,
            blocks[: -(-unpack.nbytes // pool.staging.block_bytes)],  # (the stream's first part)
            pool.staging.ring,
            unpack.nbytes,
            unpack,
            timeout_s=self.timeout_s,
        )
