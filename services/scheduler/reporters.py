"""Which engine may report which endpoint (Scheduler/Report), from the verified caller.

An engine with a certificate of its own (CN the instance) reports only the endpoint named
after it; engines sharing one certificate (CN ``engine``) report only an address whose host
is the IP the stream comes from. An endpoint is never taken over by another identity while
its registering stream is live. In local trust (no caller) nothing is checked, as before."""

from __future__ import annotations

import ipaddress

from llmesh.errors import PermissionDenied
from llmesh.rpc.pki import Principal


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.5:4242`` / ``ipv6:[::1]:4242`` -> the IP; '' when it is not an IP peer."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rsplit(":", 1)[0].strip("[]")


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


class ReportGuard:
    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, object]] = {}  # endpoint_id -> (owner, its live stream)

    @staticmethod
    def owner(who: Principal, peer: str) -> str:
        return f"{who.service}/{who.instance}" + (f"@{peer_host(peer)}" if who.shared else "")

    @staticmethod
    def check(who: Principal | None, peer: str, endpoint_id: str, address: str) -> None:
        """Raises PermissionDenied unless ``who`` may report ``endpoint_id`` at ``address``."""
        if who is None:
            return
        if not who.shared:
            if endpoint_id != who.instance:
                raise PermissionDenied(f"the engine {who.instance} may report only its own endpoint, "
                                       f"not {endpoint_id!r}", reason="not_your_endpoint")
            return
        host, seen = address.rsplit(":", 1)[0].strip("[]"), peer_host(peer)
        if not _same_ip(host, seen):
            raise PermissionDenied(f"an engine on the shared certificate may report only an address on the IP it "
                                   f"calls from ({seen or peer}), not {address!r}", reason="not_your_endpoint")

    def claim(self, endpoint_id: str, owner: str, stream: object) -> None:
        held = self._owners.get(endpoint_id)
        if held is not None and held[0] != owner:
            raise PermissionDenied(f"the endpoint {endpoint_id!r} is registered by another engine",
                                   reason="endpoint_taken")
        self._owners[endpoint_id] = (owner, stream)

    def release(self, endpoint_id: str, stream: object) -> None:
        held = self._owners.get(endpoint_id)
        if held is not None and held[1] is stream:
            del self._owners[endpoint_id]
