"""Fixtures shared by the integration tests of this folder."""

from __future__ import annotations

import pytest

from tests.integration.consul_standin import ConsulStandin


@pytest.fixture
def standin():
    """The Consul agent stand-in, as a child process, for one test."""
    s = ConsulStandin()
    s.start()
    yield s
    s.stop()
