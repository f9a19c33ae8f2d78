"""The one loopback rule (llmesh.netaddr) behind local trust's bind check, the gateway's
local mode and plain-http provider URLs."""

import pytest

from llmesh.netaddr import is_loopback


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("gateway", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback
