"""Discovery settings and the shared resolver: advertise addresses, Consul settings,
address parsing, and a follower that keeps the last known instances through errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from llmesh.cache.config import CacheSettings
from llmesh.discovery.base import Follower, Instance, NoInstance, advertisable
from llmesh.discovery.consul import parse_address
from llmesh.errors import DiscoveryError
from llmesh.service import StartFailed, serve
from llmesh.settings import MeshSettings


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "[::]:50051", ":::50051", ":50051"])
def test_an_unspecified_advertise_address_is_refused(address):
    with pytest.raises(ValidationError, match="names no host"):
        CacheSettings(advertise_address=address)


@pytest.mark.parametrize("address", ["10.0.0.7:50054", "cache-0.cache.llmesh.svc:50054", "[fd00::7]:50054"])
def test_a_dialable_advertise_address_is_kept(address):
    assert CacheSettings(advertise_address=address).advertise_address == address


def test_an_advertise_address_needs_a_port():
    with pytest.raises(ValueError, match="not host:port"):
        advertisable("10.0.0.7")


async def test_a_service_on_0000_without_an_advertise_address_does_not_start():
    mesh = MeshSettings(discovery="consul", config_backend="none")
    with pytest.raises(StartFailed, match="LLMESH_CACHE_ADVERTISE_ADDRESS"):
        await serve("cache", lambda platform: None, CacheSettings(host="0.0.0.0"), mesh)


def test_consul_settings_hold_consuls_own_limits():
    with pytest.raises(ValidationError, match="greater than or equal to 60"):
        MeshSettings(consul_deregister_after_s=10)  # Consul raises it to 1 minute anyway
    with pytest.raises(ValidationError, match="go together"):
        MeshSettings(consul_cert_file="client.pem")


@pytest.mark.parametrize(("address", "parsed"), [
    ("127.0.0.1:8500", ("http", "127.0.0.1", 8500)),
    ("http://consul:8500", ("http", "consul", 8500)),
    ("https://consul.example:8501", ("https", "consul.example", 8501)),
    ("https://consul.example", ("https", "consul.example", 8501)),
    ("http://[::1]:8500", ("http", "::1", 8500)),
])
def test_consul_addresses_keep_their_scheme(address, parsed):
    assert parse_address(address) == parsed


def test_a_consul_address_with_another_scheme_is_refused():
    with pytest.raises(ValueError, match="not"):
        parse_address("grpc://consul:8502")


class FlakyRegistryFake:
    """A fake registry whose watch yields the given steps: a list of instances, or an
    exception to raise (then the watch ends, as a broken backend's does)."""

    def __init__(self, steps: list):
        self.steps = list(steps)
        self.watches = 0

    async def watch(self, service: str) -> AsyncIterator[list[Instance]]:
        self.watches += 1
        while self.steps:
            step = self.steps.pop(0)
            if isinstance(step, Exception):
                raise step
            yield step
        await asyncio.Event().wait()  # then quiet, as a watch with nothing new is


async def test_a_follower_keeps_the_last_instances_through_errors_and_watches_again():
    a, b = Instance("scheduler", "a", "10.0.0.1:1"), Instance("scheduler", "b", "10.0.0.2:1")
    registry = FlakyRegistryFake([[a], DiscoveryError("agent gone"), [a, b]])
    follower = Follower(registry, "scheduler")
    try:
        assert await follower() == "10.0.0.1:1"
        for _ in range(100):
            if follower.instances == [a, b]:
                break
            await asyncio.sleep(0.02)
        assert follower.instances == [a, b] and registry.watches == 2
        assert {await follower(), await follower()} == {"10.0.0.1:1", "10.0.0.2:1"}  # reconnects spread
    finally:
        await follower.close()


async def test_a_follower_says_no_instance_when_discovery_never_answered():
    follower = Follower(FlakyRegistryFake([]), "cache", first_answer_s=0.1)
    try:
        with pytest.raises(NoInstance, match="has not answered"):
            await follower()
    finally:
        await follower.close()
