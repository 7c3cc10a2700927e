"""The one error type of the transfer package."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer that cannot happen or did not finish: bad peer descriptor, mismatched
    layout, page id out of range, NIXL/UCX error, dead peer, or timeout. The caller frees its
    reserved pages and fails (or retries) the request; nothing was written outside them."""
