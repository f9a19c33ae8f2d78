"""The README's grpcurl examples against the shared mesh's gateway. grpcurl is not in
Debian, npm or PyPI, so each example is read from the README and made the way grpcurl
makes it: the method and its message types from server reflection, the -d JSON parsed
strictly into the request (an unknown field fails, as in grpcurl), -H as metadata. The shared
mesh serves no embedder, so the Embed example goes to a mesh of its own that does, as `make run`'s."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmesh.testing import Mesh, free_layout

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:50051"


def readme_commands() -> list[list[str]]:
    section = README.read_text().split("## gRPC clients\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, flags=re.M | re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.startswith("grpcurl ")]


def parse(argv: list[str]) -> tuple[str, list[str], str | None, list[tuple[str, str]]]:
    """(address, verb and arguments, -d data, -H metadata) of one grpcurl command line."""
    args, data, headers = argv[1:], None, []
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-plaintext":
            continue
        if flag == "-d":
            data = args.pop(0)
        elif flag == "-H":
            key, _, value = args.pop(0).partition(":")
            headers.append((key.strip().lower(), value.strip()))
        else:
            raise AssertionError(f"the README uses a grpcurl flag this test does not make: {flag}")
    return args[0], args[1:], data, headers


def call(channel: grpc.Channel, pool: DescriptorPool, target: str, data: str | None, headers) -> list:
    service_name, method_name = target.rsplit("/", 1)
    method = pool.FindServiceByName(service_name).FindMethodByName(method_name)
    request_type, response_type = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    request = json_format.Parse(data or "{}", request_type())
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    rpc = kind(f"/{service_name}/{method_name}", request_serializer=request_type.SerializeToString,
               response_deserializer=response_type.FromString)
    answer = rpc(request, metadata=headers, timeout=120)
    return list(answer) if method.server_streaming else [answer]


@pytest.fixture(scope="module")
def reflected(mesh):
    with grpc.insecure_channel(mesh.layout.address("gateway")) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        yield channel, database, DescriptorPool(database)


@pytest.fixture(scope="module")
def embedder(real_model_dir: Path, tmp_path_factory):
    """A gateway whose mesh serves all-minilm-l6-v2, as `make run`'s does: (channel, pool)."""
    mesh = Mesh(layout=free_layout(n_engines=2), engines="sim", model_dir=real_model_dir, embeddings=True,
                log_dir=tmp_path_factory.mktemp("embed-logs"), args=["--no-cache"])
    mesh.start()
    try:
        with grpc.insecure_channel(mesh.layout.address("gateway")) as channel:
            yield channel, DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    finally:
        assert mesh.stop() == 0, mesh.logs()


def test_every_gateway_rpc_has_a_readme_example():
    calls = {parse(argv)[1][0] for argv in readme_commands()}
    from llmesh.v1 import gateway_pb2
    for service in gateway_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            assert f"{service.full_name}/{method.name}" in calls, f"no grpcurl example for {method.name}"


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(a for a in argv[1:] if len(a) < 40))
def test_readme_grpcurl_example(reflected, argv, request):
    channel, database, pool = reflected
    address, (verb, *rest), data, headers = parse(argv)
    if verb.endswith("/Embed"):
        channel, pool = request.getfixturevalue("embedder")
    assert address == README_ADDRESS
    if verb == "list":
        services = database.get_services()
        assert "llmesh.v1.Gateway" in services and "grpc.health.v1.Health" in services
    elif verb == "describe":
        (symbol,) = rest
        assert pool.FindServiceByName(symbol).methods
    else:
        assert re.fullmatch(r"[\w.]+/\w+", verb), verb
        answers = call(channel, pool, verb, data, headers)
        assert answers and all(a.ByteSize() > 0 for a in answers[-1:])
        if verb.endswith("/Chat"):
            assert "".join(a.text for a in answers) and answers[-1].usage.completion_tokens > 0
        if verb.endswith("/Embed"):
            (answer,) = answers
            assert [len(e.values) for e in answer.embeddings] == [384] and answer.usage.prompt_tokens > 0
