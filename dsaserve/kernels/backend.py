"""Which implementation a kernel entry point runs: one rule for every kernel of this package.

CUDA tensors run the Triton kernels, and on sm_90 devices the Gluon ones of kernels.hopper where
an entry point has one (`uses_gluon`; DSASERVE_GLUON=0 keeps Triton); CPU tensors run the
plain-torch references (kernels.reference, kernels.fused_reference, kernels.quant: exact in
fp32). `use_backend` forces
one for the enclosed calls: tests run "triton" on the CPU, in Triton's interpreter (kernels.env).

`swap_kernels` runs named entry points on other implementations for the enclosed calls: how a
benchmark measures its "before" kernels (bench/naive.py) inside the engine. The product never
swaps.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from dsaserve.kernels import hopper
from dsaserve.kernels.env import GLUON

Backend = Literal["triton", "reference"]
BACKENDS: tuple[Backend, ...] = ("triton", "reference")

_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "kernels_backend", default=None
)
_swapped: contextvars.ContextVar[Mapping[str, Callable[..., Any]] | None] = contextvars.ContextVar(
    "kernels_swapped", default=None
)


@contextlib.contextmanager
def use_backend(backend: Backend | None) -> Iterator[None]:
    """Run the enclosed calls on one backend (None: choose by device again)."""
    assert backend in (*BACKENDS, None), backend
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


def forced() -> Backend | None:
    """The backend `use_backend` forces here, if any."""
    return _forced.get()


def backend(t: torch.Tensor) -> Backend:
    """The backend of a call whose tensors live where `t` does."""
    return _forced.get() or ("triton" if t.is_cuda else "reference")


def uses_triton(t: torch.Tensor) -> bool:
    return backend(t) == "triton"


def uses_gluon(t: torch.Tensor) -> bool:
    """Whether a call on `t` runs kernels.hopper's Gluon kernel where its entry point has one:
    nothing forced, a CUDA tensor on an sm_90 device, DSASERVE_GLUON not 0. A forced "triton"
    runs the Triton twins (how the benches and tests measure one against the other)."""
    return _forced.get() is None and GLUON and t.is_cuda and hopper.available(t.device)


@contextlib.contextmanager
def swap_kernels(**impls: Callable[..., Any]) -> Iterator[None]:
    """Run the enclosed calls of these entry points (by name, e.g. sparse_mla_decode) on the
    given implementations, which take the entry point's arguments."""
    token = _swapped.set({**(_swapped.get() or {}), **impls})
    try:
        yield
    finally:
        _swapped.reset(token)


def swapped(name: str) -> Callable[..., Any] | None:
    """The implementation `swap_kernels` put in place of entry point `name`, if any."""
    return (_swapped.get() or {}).get(name)
