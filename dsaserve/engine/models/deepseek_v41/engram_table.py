"""An Engram table in host memory, behind a device cache of its hot rows.

V4.1-Flash's two tables are 384 M rows of 256 FP8 values each (plus a ue8m0 scale per 32):
~183 GiB, more than a GPU holds beside the model, and read a few dozen rows per token. So the
table stays where the checkpoint put it, memory-mapped from its safetensors file (every rank
and engine on a host shares those pages, and loading copies nothing), and the device reads it
through unified addressing (the pages registered with CUDA, a device tensor over them): a
lookup is a gather whose rows cross PCIe. Lookups are Zipfian (a few n-grams are most of any
text), so a direct-mapped device cache of dequantized rows (row id modulo its size, one tag per
slot) serves most of them from device memory: a hit reads its cache slot, a miss the host row,
which then takes the slot (when several misses want one slot in a lookup, the largest id
does). Everything is tensor ops without a host sync, so decode steps stay capturable.

The counts of lookups and hits stay on the device (`stats`): the worker exports them
(dsaserve_engram_lookups_total, dsaserve_engram_cache_hits_total; their ratio is the hit rate).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

from dsaserve.engine.models.loading import SCALE_SUFFIXES
from dsaserve.kernels.quant import ue8m0_to_float

SCALE_GROUP = 32  # values per ue8m0 scale of a row
DEVICE_CACHE_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}  # each table's cache, by device type
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ONE_BYTE = ("F8_E4M3", "F8_E8M0", "U8", "I8")  # the table's stored formats


def mmap_tensor(path: str, name: str) -> torch.Tensor:
    """The raw bytes of tensor `name` of a safetensors file, memory-mapped (copy-on-write, so
    nothing is read until touched and processes share the pages): uint8 [shape..., element
    bytes] for a 1-byte dtype, as stored."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    entry = header[name]
    assert entry["dtype"] in _ONE_BYTE, f"{name}: {entry['dtype']} is not a 1-byte format"
    begin, end = entry["data_offsets"]
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size + begin, shape=(end - begin,))
    return torch.from_numpy(raw).view(entry["shape"])


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [M, D] uint8 (e4m3 bits), scales [M, D/32] uint8 (ue8m0) -> [M, D] dtype, exactly
    (an e4m3 value times a power of two is exact in bf16 and fp32)."""
    values = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, SCALE_GROUP))
    return (values * ue8m0_to_float(scales)[..., None]).flatten(-2).to(dtype)


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) as the device reads it: itself on the CPU; on a GPU a CUDA tensor
    over the same pages (registered with CUDA, read through unified addressing)."""
    if device.type != "cuda":
        return host
    nbytes = host.numel() * host.element_size()
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(
            f"registering the Engram table ({nbytes / 2**30:.1f} GiB of host memory) with CUDA "
            f"failed (cudaError {int(err)}): the host needs that much memory it can lock"
        )

    class _Interface:  # what torch.as_tensor reads a device pointer from
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }

    view = torch.as_tensor(_Interface(), device=device)
    view._host = host  # type: ignore[attr-defined]  # (the pages must outlive the view)
    return view


def cache_slots(rows: int, row_bytes: int, budget: int) -> int:
    """Slots of a table's device cache: a power of two within `budget` bytes and a quarter of
    the table (a cache as large as the table would be the table)."""
    slots = 1
    while slots * 2 * row_bytes <= budget and slots * 2 <= rows // 4:
        slots *= 2
    return slots if slots > 1 else 0


class EngramTable:
    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        slots: int,
    ) -> None:
        """codes [R, D] uint8 e4m3 bits, scales [R, D/32] uint8 ue8m0, both host tensors (the
        checkpoint's, memory-mapped); dtype: the rows' (the model's); slots: the device cache's
        (0: none)."""
        self.rows, self.dim = codes.shape
        self.codes, self.scales = device_view(codes, device), device_view(scales, device)
        self.dtype, self.device = dtype, device
        self.lookups = torch.zeros((), dtype=torch.int64, device=device)
        self.hits = torch.zeros((), dtype=torch.int64, device=device)
        self.set_cache(slots)

    def set_cache(self, slots: int) -> None:
        """An empty device cache of `slots` rows (0: every lookup reads the host's rows)."""
        self.slots = slots
        # slot `slots` is a dummy: lookups that insert nothing write there
        self.tags = torch.full((slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.cache = torch.zeros(slots + 1, self.dim, dtype=self.dtype, device=self.device)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [M] (on the device) of the table itself: [M, D] in the model dtype."""
        return dequantize_rows(self.codes[ids], self.scales[ids], self.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [M] int64 -> [M, D] in the model dtype, through the device cache."""
        self.lookups += ids.numel()
        if not self.slots:
            return self.read(ids)
        slot = ids % self.slots
        hit = self.tags[slot] == ids
        self.hits += hit.sum()
        fetched = self.read(torch.where(hit, 0, ids))  # (a hit reads row 0, once per lookup)
        rows = torch.where(hit[:, None], self.cache[slot], fetched)
        # one miss per slot takes it (the largest id; a repeated id writes the same row)
        wants = torch.where(hit, self.slots, slot)
        winner = torch.full_like(self.tags, -1).scatter_reduce(0, wants, ids, "amax")
        target = torch.where(~hit & (winner[slot] == ids), slot, self.slots)
        self.cache.index_copy_(0, target, rows)
        self.tags.index_copy_(0, target, ids)
        return rows

    def stats(self) -> tuple[int, int]:
        """(lookups, hits) so far (reads them back from the device)."""
        return int(self.lookups), int(self.hits)


def open_table(
    model_dir: str | os.PathLike, prefix: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The host tensors (codes, scales) of the table `<prefix>.weight` and its scale (`.scale`,
    or HF's `.weight_scale_inv`) of a checkpoint, memory-mapped from whichever shard holds them
    (None: the checkpoint has none)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as text:
            weight_map: dict[str, str] = json.load(text)["weight_map"]
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        weight_map = {}
        for file in files:
            with open(os.path.join(model_dir, file), "rb") as raw:
                (size,) = struct.unpack("<Q", raw.read(8))
                weight_map |= dict.fromkeys(json.loads(raw.read(size)), file)
    weight = f"{prefix}.weight"
    scale = next((f"{prefix}{s}" for s in SCALE_SUFFIXES if f"{prefix}{s}" in weight_map), None)
    if weight not in weight_map or scale is None:
        return None
    return (
        mmap_tensor(os.path.join(model_dir, weight_map[weight]), weight),
        mmap_tensor(os.path.join(model_dir, weight_map[scale]), scale),
    )
