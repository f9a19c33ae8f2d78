"""Our servers accept the keepalive pings our clients send on a call that sends nothing
for a while (a queued request, a non-streamed answer generated whole): with gRPC's
default (one ping per 5 minutes without data) the server strikes them and closes the
channel with GOAWAY too_many_pings (tests/e2e/test_openai_api.py's queued requests
failed with 503 that way). The server option is named as gRPC core reads it."""

from llmesh.rpc.channels import CHANNEL_OPTIONS
from llmesh.rpc.server import SERVER_OPTIONS


def test_servers_accept_the_clients_ping_interval_without_data():
    server = dict(SERVER_OPTIONS)
    assert dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
