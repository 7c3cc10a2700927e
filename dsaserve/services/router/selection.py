"""Which workers take a request: live ones for our model, with matching KV layouts, by policy.

A prefill worker is only a candidate when some decode worker shares its layout hash (the decode
side could not read its KV otherwise); the decode worker is picked after prefill returns, from
those with the prefill worker's layout, so its load numbers are as fresh as possible.

A worker that failed in a way the registry cannot see yet (its calls fail or stall, but it still
beats) can be benched for a cool-down with `mark_unhealthy`: picks skip it while another
candidate exists. When every candidate is benched they are all tried anyway (Envoy's "panic
mode"): a benched worker may have recovered, and a sure 503 helps no one.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from dsaserve.services.kv_events import CacheIndex
from dsaserve.services.registry import ROLES, RegistryWatcher, Role, WorkerRecord
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.conversations import Conversations
from dsaserve.services.router.policy import DEFAULT_BALANCE_BOUND, make_policy


class WorkerSelector:
    def __init__(
        self,
        watcher: RegistryWatcher,
        model: str,
        policy: str,
        inflight: Mapping[str, int],
        rng: random.Random | None = None,
        on_mark: Callable[[WorkerRecord, str], None] = lambda worker, reason: None,
        cache: CacheIndex | None = None,
        balance_bound: int = DEFAULT_BALANCE_BOUND,
        decode_kv_threshold: float = 1.0,
    ) -> None:
        """cache: what the workers' prefix caches hold (for cache_aware); decode_kv_threshold:
        the share of a decode worker's KV pages in use above which a conversation's next turn
        does not go to it for its cache."""
        self._watcher = watcher
        self._model = model
        self._inflight = inflight
        self._on_mark = on_mark
        self._cache = cache
        self._conversations = Conversations()  # (with the cache index: for cache_aware)

        def room(worker: WorkerRecord) -> bool:
            load = worker.load
            used = load.total_pages - load.free_pages - load.cached_pages
            return used <= decode_kv_threshold * load.total_pages

        # One policy state per role: round-robin over prefill workers must not skip decode ones.
        self._policies = {
            "prefill": make_policy(policy, rng, cache, balance_bound),
            "decode": make_policy(policy, rng, cache, balance_bound, room),
        }
        self._benched: dict[str, float] = {}  # worker id -> monotonic end of its cool-down
        # A 503 for want of workers lasts until at least the next registry refresh.
        self.retry_after_s = math.ceil(watcher.refresh_interval_s)

    def live(self, role: Role) -> list[WorkerRecord]:
        return self._watcher.workers(role, self._model)

    def mark_unhealthy(self, worker_id: str, seconds: float, reason: str) -> None:
        """Skip `worker_id` in picks for `seconds` (a later mark can only extend it).

        `reason` is a short cause for the metric label (`unavailable`, `stalled`, ...), not a
        message: it must take few distinct values.
        """
        live = (w for role in ROLES for w in self.live(role))
        worker = next((w for w in live if w.worker_id == worker_id), None)
        if worker is None:  # gone from the registry already: nothing to skip
            return
        until = time.monotonic() + seconds
        self._benched[worker_id] = max(until, self._benched.get(worker_id, until))
        self._on_mark(worker, reason)

    def unhealthy(self, role: Role) -> list[WorkerRecord]:
        """The live workers of `role` in a cool-down now."""
        now = time.monotonic()
        # Drop cool-downs that are over, so workers that come and go leave nothing behind.
        self._benched = {w: end for w, end in self._benched.items() if end > now}
        return [w for w in self.live(role) if w.worker_id in self._benched]

    def _choose(
        self,
        role: Role,
        candidates: list[WorkerRecord],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        benched = {w.worker_id for w in self.unhealthy(role)}
        healthy = [w for w in candidates if w.worker_id not in benched]
        return self._policies[role].choose(
            healthy or candidates, self._inflight, prompt, cache_salt
        )

    def unavailable_reason(self) -> str | None:
        """Why no request could be served right now, or None when a pair exists."""
        prefill, decode = self.live("prefill"), self.live("decode")
        missing = [
            role for role, workers in (("prefill", prefill), ("decode", decode)) if not workers
        ]
        if missing:
            untrusted = self._watcher.untrusted
            return (
                f"No live {' or '.join(missing)} worker for model '{self._model}'. Start one "
                f"(dsaserve {missing[0]}) or check that it uses the router's --redis-url"
                + (
                    f" and --cluster-token ({untrusted} registry records are not signed with "
                    "the router's)."
                    if untrusted
                    else "."
                )
            )
        if not {w.layout_hash for w in prefill} & {w.layout_hash for w in decode}:
            return (
                "No decode worker shares a KV layout with any prefill worker for model "
                f"'{self._model}' "
                f"(prefill layouts {sorted({w.layout_hash for w in prefill})}, decode layouts "
                f"{sorted({w.layout_hash for w in decode})}); "
                "run both roles with the same model and KV settings (--dtype, "
                "--kv-cache-dtype, --block-size)."
            )
        return None

    def prefill(
        self,
        exclude: Collection[str] = (),
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        """A prefill worker for a request with these token ids (the policy may route by them)."""
        layouts = {w.layout_hash for w in self.live("decode")}
        candidates = [
            w
            for w in self.live("prefill")
            if w.layout_hash in layouts and w.worker_id not in exclude
        ]
        if not candidates:
            raise self._unavailable()
        return self._choose("prefill", candidates, prompt, cache_salt)

    def decode(
        self,
        layout_hash: str,
        exclude: Collection[str] = (),
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        """A decode worker for a prompt prefilled on a worker of `layout_hash` (the policy may
        route by its tokens, in the namespace `cache_salt`: the decode worker holding a
        conversation's earlier turns pulls only the new pages)."""
        candidates = [
            w
            for w in self.live("decode")
            if w.layout_hash == layout_hash and w.worker_id not in exclude
        ]
        if not candidates:
            raise APIError(
                503,
                f"No live decode worker with KV layout {layout_hash} for model '{self._model}' "
                "is left; retry the request.",
                code="no_worker",
                cause="no_worker",
                retry_after_s=self.retry_after_s,
            )
        return self._choose("decode", candidates, prompt, cache_salt)

    def lender(
        self, prefill: WorkerRecord, prompt: Sequence[int], cache_salt: str | None = None
    ) -> WorkerRecord | None:
        """A decode worker to borrow from the state of the prompt's start the prefill worker
        lacks (a conversation's last answer, which it never computed): the one that decoded the
        generation the prompt continues, as this router recorded it, else one whose cache holds
        more whole blocks of the prompt than the prefill worker's; None: none."""
        if self._cache is None:
            return None
        benched = {w.worker_id for w in self.unhealthy("decode")}
        decode = {
            w.worker_id: w
            for w in self.live("decode")
            if w.layout_hash == prefill.layout_hash and w.worker_id not in benched
        }
        held = self._conversations.holder(prompt, cache_salt)
        if held is not None and held[0] in decode:
            return decode[held[0]]
        # (what the prefill worker says it holds: this very prompt was just routed there)
        have = self._cache.matched_tokens([prefill.worker_id], prompt, cache_salt, routed=False)
        matched = self._cache.matched_tokens(list(decode), prompt, cache_salt)
        best = max(decode.values(), key=lambda w: matched[w.worker_id], default=None)
        if best is None or matched[best.worker_id] <= have[prefill.worker_id]:
            return None
        return best

    def decoded(
        self, worker: WorkerRecord, tokens: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """`worker` decoded a generation to its end: these tokens (its prompt and answer) count
        as cached there (in the namespace `cache_salt`), as the worker keeps them, before it
        says so itself."""
        if self._cache is not None:
            self._cache.routed(worker.worker_id, tokens, cache_salt)
            self._conversations.decoded(worker.worker_id, tokens, cache_salt)

    def _unavailable(self) -> APIError:
        reason = (
            self.unavailable_reason()
            or f"Every prefill worker for model '{self._model}' failed; retry the request."
        )
        return APIError(
            503, reason, code="no_worker", cause="no_worker", retry_after_s=self.retry_after_s
        )
