"""Our servers accept the keepalive pings our clients send: a call that sends nothing
for a while (a queued request, a non-streamed answer generated whole) would otherwise
be struck for too many pings and its channel closed (GOAWAY too_many_pings)."""

from llmesh.rpc.channels import CHANNEL_OPTIONS
from llmesh.rpc.server import SERVER_OPTIONS


def test_servers_accept_the_clients_ping_interval_without_data():
    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
