"""One chat request makes one trace across gateway, cache and engine, exported over
OTLP/gRPC to a real receiver (the opentelemetry-proto TraceService) run here; and
every log line of the request carries its request id and trace id."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmesh.testing import Mesh, free_layout, free_ports, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []  # (service.name, span)
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the proto's method
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_ports(1)[0]}")
    server.start()
    tmp = tmp_path_factory.mktemp("traced")
    mesh = Mesh(layout=free_layout(1), engines="sim", model_dir=tmp / "models", log_dir=tmp / "logs",
                env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                     "OTEL_BSP_SCHEDULE_DELAY": "100", "LLMESH_CONFIG_BACKEND": "none"})
    mesh.start(timeout_s=60)
    mesh.receiver = receiver
    yield mesh
    mesh.stop()
    server.stop(0)


def test_one_trace_covers_gateway_cache_and_engine_with_parent_links(traced_mesh):
    client = OpenAI(base_url=traced_mesh.layout.http_url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "trace me"}], temperature=0, max_tokens=4,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    rid = raw.headers["x-request-id"]
    want = {("llmesh-gateway", "chat sim-small"), ("llmesh-gateway", "llmesh.v1.Cache/Lookup"),
            ("llmesh-cache", "llmesh.v1.Cache/Lookup"), ("llmesh-gateway", "llmesh.v1.Engine/Generate"),
            ("llmesh-engine", "llmesh.v1.Engine/Generate")}

    def ours():
        with traced_mesh.receiver.lock:
            return {(svc, s.name): s for svc, s in traced_mesh.receiver.spans if s.trace_id.hex() == TRACE_ID}

    assert wait_until(lambda: want <= set(ours()), 10), sorted(ours())
    spans = ours()
    root = spans[("llmesh-gateway", "chat sim-small")]
    assert root.parent_span_id.hex() == PARENT_ID  # the client's span
    for client_side, server_side in (
            (("llmesh-gateway", "llmesh.v1.Cache/Lookup"), ("llmesh-cache", "llmesh.v1.Cache/Lookup")),
            (("llmesh-gateway", "llmesh.v1.Engine/Generate"), ("llmesh-engine", "llmesh.v1.Engine/Generate"))):
        assert spans[client_side].parent_span_id == root.span_id
        assert spans[server_side].parent_span_id == spans[client_side].span_id
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.model"].string_value == "sim-small"
    assert attrs["gen_ai.operation.name"].string_value == "chat"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert attrs["gen_ai.usage.input_tokens"].int_value > 0
    engine_attrs = {a.key for a in spans[("llmesh-engine", "llmesh.v1.Engine/Generate")].attributes}
    assert {"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} <= engine_attrs

    # every log line about this request carries both ids
    lines = [json.loads(x) for f in ("gateway", "cache", "engine-0")
             for x in (traced_mesh.log_dir / f"{f}.log").read_text().splitlines() if rid in x]
    assert any(line["msg"] == "request" for line in lines)
    assert lines and all(line.get("trace_id") == TRACE_ID and line["request_id"] == rid for line in lines)
