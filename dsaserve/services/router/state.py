"""What one router holds for the requests it serves (`RouterState`, on `app.state.router`):
built by `app.create_app`, read by every route and by the pipeline (`router_state`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from dsaserve.services.registry import RegistryWatcher
from dsaserve.services.router.admission import Admission, KeyLimit
from dsaserve.services.router.api.responses.store import ResponseStore
from dsaserve.services.router.clients import WorkerClients
from dsaserve.services.router.grammars import GrammarBuilder
from dsaserve.services.router.metrics import RouterMetrics
from dsaserve.services.router.model import ServedModel
from dsaserve.services.router.pd import PDFlow
from dsaserve.services.router.selection import WorkerSelector
from dsaserve.services.router.settings import RouterSettings


@dataclass(frozen=True)
class RouterState:
    settings: RouterSettings
    model: ServedModel
    metrics: RouterMetrics
    watcher: RegistryWatcher
    clients: WorkerClients
    admission: Admission
    key_limit: KeyLimit
    selector: WorkerSelector
    flow: PDFlow
    responses: ResponseStore  # the Responses API's stored responses
    grammars: GrammarBuilder  # structured outputs' grammars, compiled before they are sent


def router_state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state
