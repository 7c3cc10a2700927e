"""Keep UCX on the interface a worker advertises.

UCX's TCP transport otherwise listens on, and connects from, every interface of the host, so a
worker bound to one private address would still expose its KV pools everywhere.
`UCX_NET_DEVICES` names the interfaces UCX may use; a value the operator set is left alone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def interface_of(host: str) -> str | None:
    """The name of the local interface holding `host`'s IPv4 address, or None."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address on this interface
                continue
            if ipaddress.ip_address(packed[20:24]) == address:
                return name
    return None


def bind_ucx_to(host: str) -> None:
    """Restrict UCX to the interface of `host` (unless UCX_NET_DEVICES is already set)."""
    if "UCX_NET_DEVICES" in os.environ:
        return
    name = interface_of(host)
    if name is None:
        log.warning("no local interface has %s: UCX may use every interface", host)
        return
    os.environ["UCX_NET_DEVICES"] = name
