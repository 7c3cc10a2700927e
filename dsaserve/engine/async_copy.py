"""Host <-> device copies that never make the host wait for work already queued on the device.

Async scheduling (LLMEngine) builds step N+1 while the device still runs step N, so no copy on
the way may wait for the stream: a copy from pageable host memory may (CUDA stages it through
pinned memory and is allowed to synchronize first), and reading a device tensor on the host
does. Host-to-device copies therefore go through pinned memory (PyTorch's caching host
allocator recycles a pinned block only once the copy that read it has run), and device-to-host
results land in pinned memory behind an event that is waited on only when they are needed.
On the CPU every copy is immediate and these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A device tensor of `values` (a list, nested lists or an array), copied without waiting."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class ToHost:
    """Device tensors on their way to the host: each copied into pinned memory as soon as the
    stream reaches this point, then one event; `wait` blocks on that event only."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        self._event: torch.cuda.Event | None = None
        if device.type != "cuda":
            self._host = tensors
            return
        self._host = tuple(
            None
            if t is None
            else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        )
        self._event = torch.cuda.Event()
        self._event.record(
            torch.cuda.current_stream(device)
        )  # (the copies' device, not the current)

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        """The host copies, in the order given (waits until the device has made them)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
