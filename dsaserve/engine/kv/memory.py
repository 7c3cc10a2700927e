"""Zeroed memory for the KV pools and staging blocks, without writing the zeros on the host.

A CPU engine's default budget is 512 MiB, and `torch.zeros` writes every byte of it before the
first step (a second per engine on a small machine), though most pages are never touched. An
anonymous mmap is zeroed by the kernel page by page on first touch instead: the same contents,
paid for only where used. On a GPU, torch.zeros (one memset on the device).
"""

from __future__ import annotations

import mmap

import torch


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed contiguous [numel] tensor (page-aligned on the host, as NIXL likes it)."""
    if device.type != "cpu" or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device)
    size = numel * torch.empty((), dtype=dtype).element_size()
    # (the tensor keeps the mapping alive: frombuffer holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype)
