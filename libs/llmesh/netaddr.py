"""Which hosts are reachable from this machine only: the one loopback rule behind local
trust's bind check (llmesh.rpc.identity), the gateway's local mode (its listeners) and the
live config's plain-http provider URLs."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``localhost``, or an IPv4 or IPv6 address, brackets allowed) is a
    loopback host. Any other host name is not: it may resolve anywhere."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
