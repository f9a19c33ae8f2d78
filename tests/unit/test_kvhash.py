import pytest

from llmesh.convert import kv_hash_from_pb, kv_hash_to_pb
from llmesh.kvhash import HashScheme, chain_hashes, hash64
from llmesh.v1 import scheduler_pb2
from llmesh.scheduler.kvindex import KvIndex


def test_a_bytes_hash_keeps_its_last_8_bytes_big_endian():
    assert hash64(bytes(24) + (42).to_bytes(8, "big")) == 42
    assert hash64(2**70 + 5) == 5


def test_schemes_refuse_what_cannot_be_reproduced():
    with pytest.raises(ValueError, match="cannot be reproduced"):
        HashScheme("vllm", 16, "xxhash", "seed")
    with pytest.raises(ValueError, match="whole number"):
        HashScheme("vllm", 24, "sha256", "s", hash_block_size=16)
    assert kv_hash_from_pb(scheduler_pb2.KvHashScheme(kind="vllm", block_size=16, algo="xxhash")) is None
    assert kv_hash_from_pb(scheduler_pb2.KvHashScheme()) is None
    s = HashScheme("vllm", 32, "sha256", "vllm-none-hash", 16)
    assert kv_hash_from_pb(kv_hash_to_pb(s)) == s


def held_tokens(index: KvIndex, eid: str, tokens: list[int], lora=None) -> int:
    """Leading tokens whose blocks the engine holds, hashed with its own scheme (none without one)."""
    scheme, held = index.scheme(eid), index.held(eid)
    hashes = scheme.block_hashes(tokens, lora) if scheme is not None else []
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes)) * (scheme.block_size if scheme else 0)


def test_the_index_hashes_a_request_as_each_engine_does():
    tokens = list(range(100))
    vllm = HashScheme("vllm", 16, "sha256", "vllm-none-hash")
    llmesh = HashScheme("llmesh", 16)
    index = KvIndex()
    index.set_scheme("v", vllm)
    index.set_scheme("l", llmesh)
    index.apply("v", [("stored", vllm.block_hashes(tokens[:64]))])
    index.apply("l", [("stored", chain_hashes(tokens[:32]))])
    index.apply("x", [("stored", chain_hashes(tokens))])  # no scheme reported: matches nothing
    assert {eid: held_tokens(index, eid, tokens) for eid in "vlx"} == {"v": 64, "l": 32, "x": 0}
    assert held_tokens(index, "v", tokens, lora=("a", "/p")) == 0  # an adapter's blocks are its own
    index.forget("v")
    assert index.scheme("v") is None and not index.held("v") and index.count("v") == 0
