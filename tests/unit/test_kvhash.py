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
    assert index.prefix_tokens(tokens) == {"v": 64, "l": 32, "x": 0}
    assert index.prefix_tokens(tokens, lora=("a", "/p"))["v"] == 0  # an adapter's blocks are its own
    index.forget("v")
    assert index.scheme("v") is None and "v" not in index.prefix_tokens(tokens)
