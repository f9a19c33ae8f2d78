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


CAPTURE = re.compile(r"(\w+)=\$\((grpcurl .*) \| jq -r \.([\w.]+)\)$")  # VAR=$(grpcurl ... | jq -r .path)


def readme_steps() -> list[tuple[list[str], tuple[str, str] | None]]:
    """Each grpcurl command of the README's gRPC section, in order, with the shell variable and the
    answer's JSON path a ``VAR=$(grpcurl ... | jq -r .path)`` line keeps (later lines use ``$VAR``)."""
    section = README.read_text().split("## gRPC clients\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, flags=re.M | re.S)
    steps: list[tuple[list[str], tuple[str, str] | None]] = []
    for line in (line for block in blocks for line in block.splitlines()):
        if (kept := CAPTURE.match(line)) is not None:
            steps.append((shlex.split(kept.group(2), comments=True), (kept.group(1), kept.group(3))))
        elif line.startswith("grpcurl "):
            steps.append((shlex.split(line, comments=True), None))
    return steps


def readme_commands() -> list[list[str]]:
    return [argv for argv, _ in readme_steps()]


def _chained(argv: list[str], capture: tuple[str, str] | None) -> bool:
    """A step of the Batch API's chain: it keeps a variable, uses one, or lists what the chain made."""
    batch_api = re.search(r"/\w*(File|Batch)\w*$", argv[-1]) is not None
    return capture is not None or batch_api or any("$" in a for a in argv)


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


@pytest.mark.parametrize("argv", [argv for argv, capture in readme_steps() if not _chained(argv, capture)],
                         ids=lambda argv: " ".join(a for a in argv[1:] if len(a) < 40))
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


def test_readme_batch_examples_in_order(reflected):
    """The chained examples (the Batch API) one after another, each ``$VAR`` set from an earlier answer
    as jq would; cancelling a batch that has already ended is FAILED_PRECONDITION, as the README says."""
    channel, _, pool = reflected
    variables: dict[str, str] = {}
    ran = []
    for argv, capture in (step for step in readme_steps() if _chained(*step)):
        address, (verb, *_), data, headers = parse(argv)
        assert address == README_ADDRESS
        for name, value in variables.items():
            data = data.replace(f"${name}", value) if data else data
        try:
            (answer,) = call(channel, pool, verb, data, headers)
        except grpc.RpcError as exc:
            assert verb.endswith("/CancelBatch") and exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
            ran.append(verb.rsplit("/", 1)[1])
            continue
        if capture is not None:
            value = json_format.MessageToDict(answer, preserving_proto_field_name=True)
            for key in capture[1].split("."):
                value = value[key]
            variables[capture[0]] = value
        if verb.endswith(("/ListFiles", "/ListBatches")):
            assert answer.ByteSize() > 0  # what the chain made so far is listed
        ran.append(verb.rsplit("/", 1)[1])
    assert ran == ["CreateFile", "GetFile", "ListFiles", "GetFileContent", "CreateBatch", "GetBatch", "ListBatches",
                   "CancelBatch", "DeleteFile"]
    assert variables["FILE_ID"].startswith("file-") and variables["BATCH_ID"].startswith("batch_")
