"""Which workers take a request: live ones for our model, with matching KV layouts, by policy.

A prefill worker is only a candidate when some decode worker shares its layout hash (the decode
side could not read its KV otherwise); the decode worker is picked after prefill returns, from
those with the prefill worker's layout, so its load numbers are as fresh as possible.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

from services.registry import RegistryWatcher, Role, WorkerRecord

from .errors import APIError
from .policy import make_policy


class WorkerSelector:
    def __init__(
        self,
        watcher: RegistryWatcher,
        model: str,
        policy: str,
        inflight: Mapping[str, int],
        rng: random.Random | None = None,
    ) -> None:
        self._watcher = watcher
        self._model = model
        self._inflight = inflight
        # One policy state per role: round-robin over prefill workers must not skip decode ones.
        self._policies = {"prefill": make_policy(policy, rng), "decode": make_policy(policy, rng)}

    def live(self, role: Role) -> list[WorkerRecord]:
        return self._watcher.workers(role, self._model)

    def unavailable_reason(self) -> str | None:
        """Why no request could be served right now, or None when a pair exists."""
        prefill, decode = self.live("prefill"), self.live("decode")
        missing = [
            role for role, workers in (("prefill", prefill), ("decode", decode)) if not workers
        ]
        if missing:
            return (
                f"No live {' or '.join(missing)} worker for model '{self._model}'. Start one "
                f"(dsaserve {missing[0]}) or check that it uses the router's --redis-url."
            )
        if not {w.layout_hash for w in prefill} & {w.layout_hash for w in decode}:
            return (
                "No decode worker shares a KV layout with any prefill worker for model "
                f"'{self._model}' "
                f"(prefill layouts {sorted({w.layout_hash for w in prefill})}, decode layouts "
                f"{sorted({w.layout_hash for w in decode})}); "
                "run both roles with the same model and KV settings."
            )
        return None

    def prefill(self, exclude: Collection[str] = ()) -> WorkerRecord:
        layouts = {w.layout_hash for w in self.live("decode")}
        candidates = [
            w
            for w in self.live("prefill")
            if w.layout_hash in layouts and w.worker_id not in exclude
        ]
        if not candidates:
            raise self._unavailable()
        return self._policies["prefill"].choose(candidates, self._inflight)

    def decode(self, layout_hash: str, exclude: Collection[str] = ()) -> WorkerRecord:
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
            )
        return self._policies["decode"].choose(candidates, self._inflight)

    def _unavailable(self) -> APIError:
        reason = (
            self.unavailable_reason()
            or f"Every prefill worker for model '{self._model}' failed; retry the request."
        )
        return APIError(503, reason, code="no_worker", cause="no_worker")
