"""What a worker's KV pools look like to NIXL, and the descriptor peers exchange.

A worker's pools are a list of `Region`s (one registered tensor each). Its descriptor is JSON:
the NIXL agent metadata (base64) plus one row per region (name, group, base address, page bytes,
pages, device id, memory type). JSON rather than pickle because descriptors come over the network.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from .errors import TransferError

_FORMAT = "dsaserve-kv-transfer/1"


@dataclass(frozen=True)
class Region:
    """One registered tensor of a worker's KV pools.

    name:   unique per worker, identical on every worker with the same layout, e.g. "csa.3.kv".
    group:  the allocator group whose page ids index dim 0, e.g. "swa" | "csa" | "hca" | "slab".
    tensor: contiguous; dim 0 = page (a slab row in "slab"); page bytes = tensor[0].nbytes.
    """

    name: str
    group: str
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dim() < 1 or t.numel() == 0:
            raise ValueError(f"region {self.name!r}: empty {tuple(t.shape)}; dim 0 indexes pages")
        if not t.is_contiguous():
            raise ValueError(f"region {self.name!r}: must be contiguous (NIXL registers one span)")


@dataclass(frozen=True)
class RegionInfo:
    """A region as its peers see it: where its bytes live and how they split into pages."""

    name: str
    group: str
    addr: int
    page_bytes: int
    pages: int
    device: int  # CUDA device index; 0 for host memory, as NIXL numbers DRAM
    mem: str  # "DRAM" | "VRAM"


@dataclass(frozen=True)
class Descriptor:
    """A decoded peer descriptor."""

    agent: str
    metadata: bytes  # NIXL agent metadata, for add_remote_agent
    regions: tuple[RegionInfo, ...]

    @property
    def mem(self) -> str:
        return self.regions[0].mem


def describe(regions: Sequence[Region]) -> tuple[RegionInfo, ...]:
    """Region table of one worker; raises ValueError on a table NIXL could not serve in one READ."""
    if not regions:
        raise ValueError("no regions to register")
    infos = tuple(_info(r) for r in regions)
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise ValueError(f"region names must be unique, got duplicates in {names}")
    # A NIXL descriptor list has one memory type, so a worker's pools are all host or all GPU
    # memory (GPUs may differ: each descriptor names its device).
    mems = {i.mem for i in infos}
    if len(mems) != 1:
        raise ValueError(f"regions mix memory types {sorted(mems)}; one READ carries one")
    _check_group_pages(infos, ValueError)
    return infos


def _info(region: Region) -> RegionInfo:
    t = region.tensor
    on_gpu = t.device.type == "cuda"
    return RegionInfo(
        name=region.name,
        group=region.group,
        addr=t.data_ptr(),
        page_bytes=t.nbytes // t.shape[0],
        pages=t.shape[0],
        device=t.device.index if on_gpu else 0,
        mem="VRAM" if on_gpu else "DRAM",
    )


def _check_group_pages(infos: Iterable[RegionInfo], error: type[Exception]) -> None:
    # Page ids index every region of a group, so the group's regions have the same page count.
    pages: dict[str, tuple[str, int]] = {}
    for i in infos:
        first = pages.setdefault(i.group, (i.name, i.pages))
        if first[1] != i.pages:
            raise error(
                f"group {i.group!r}: region {first[0]!r} has {first[1]} pages, {i.name!r} {i.pages}"
            )


def encode(agent: str, metadata: bytes, regions: Iterable[RegionInfo]) -> bytes:
    body = {
        "format": _FORMAT,
        "agent": agent,
        "nixl": base64.b64encode(metadata).decode("ascii"),
        "regions": [asdict(r) for r in regions],
    }
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def decode(descriptor: bytes) -> Descriptor:
    """Parse a peer descriptor; raises TransferError on anything malformed."""
    try:
        body = json.loads(descriptor)
        if body.get("format") != _FORMAT:
            raise ValueError(f"format {body.get('format')!r}, expected {_FORMAT!r}")
        regions = tuple(_region_info(r) for r in body["regions"])
        metadata = base64.b64decode(body["nixl"], validate=True)
        desc = Descriptor(str(body["agent"]), metadata, regions)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise TransferError(f"malformed transfer descriptor: {e}") from e
    if len({r.mem for r in regions}) != 1:
        raise TransferError(f"descriptor of {desc.agent!r}: needs regions of one memory type")
    _check_group_pages(regions, TransferError)
    return desc


def _region_info(row: dict) -> RegionInfo:
    # The numbers become addresses of a READ: accept only what `describe` could have written.
    r = RegionInfo(**row)
    numbers = (r.addr, r.page_bytes, r.pages, r.device)
    if not all(type(n) is int and n >= 0 for n in numbers) or min(r.page_bytes, r.pages) == 0:
        raise ValueError(f"region {r.name!r}: bad numbers {numbers}")
    if r.mem not in ("DRAM", "VRAM") or not isinstance(r.name, str) or not isinstance(r.group, str):
        raise ValueError(f"region {r.name!r}: bad name, group or memory type {r.mem!r}")
    return r


def first_difference(ours: Sequence[RegionInfo], theirs: Sequence[RegionInfo]) -> str | None:
    """The first layout difference between two region tables (by name), or None if they match.

    Page counts and addresses may differ (each worker sizes its own pools); names, groups and
    page bytes may not, or a page read from one would be misread by the other.
    """
    by_name = {r.name: r for r in theirs}
    for r in ours:
        t = by_name.pop(r.name, None)
        if t is None:
            return f"region {r.name!r} is missing at the peer"
        if t.group != r.group:
            return f"region {r.name!r} is in group {r.group!r} here but {t.group!r} there"
        if t.page_bytes != r.page_bytes:
            return f"region {r.name!r} has {r.page_bytes} page bytes here, {t.page_bytes} there"
    if by_name:
        return f"the peer has region {next(iter(by_name))!r}, which is missing here"
    return None
