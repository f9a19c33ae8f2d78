"""How each engine kind names its KV-cache blocks, so that a router can compute, for a
request's tokens, the very hashes an engine publishes in its KV events and so find the
engine that already holds the longest prefix.

A block is ``block_size`` tokens; its hash covers its tokens and its parent's hash, so
two sequences share a block hash only when they share every token before it. Hashes
travel as 64-bit integers. Schemes:

- ``llmesh`` (the llamacpp and sim engines): blake2b-64 over the parent hash and the tokens.
- ``vllm``: vLLM's prefix-caching hash. Each block is ``algo`` ("sha256": SHA-256 of the
  pickled tuple; "sha256_cbor": SHA-256 of canonical CBOR) over ``(parent, tokens,
  extra_keys)``, the first block's parent being ``algo(seed)`` (vLLM's NONE_HASH; the seed
  is PYTHONHASHSEED or "vllm-none-hash"). A LoRA request's blocks carry the extra key
  ``("lora", name, path)``. Its events carry the last 8 bytes, big-endian."""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from hashlib import blake2b

LLMESH_BLOCK_SIZE = 16
VLLM_ALGOS = ("sha256", "sha256_cbor")


def chain_hashes(tokens: Sequence[int], block_size: int = LLMESH_BLOCK_SIZE, parent: int = 0) -> list[int]:
    """The ``llmesh`` scheme: hashes of the full blocks of ``tokens``."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = parent.to_bytes(8, "little") + array("q", tokens[start:start + block_size]).tobytes()
        parent = int.from_bytes(blake2b(data, digest_size=8).digest(), "little")
        hashes.append(parent)
    return hashes


def hash64(value: bytes | int) -> int:
    """A vLLM block hash as we carry it: the last 8 bytes, big-endian, of a bytes hash
    (what vLLM itself sends with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)."""
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(bytes(value)[-8:], "big")
    return int(value) & (2**64 - 1)


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    import cbor2  # only engines configured with sha256_cbor need it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@dataclass(frozen=True)
class HashScheme:
    kind: str                 # "llmesh" or "vllm"
    block_size: int           # tokens per published block
    algo: str = ""            # vllm: one of VLLM_ALGOS
    seed: str = ""            # vllm: what NONE_HASH is derived from
    hash_block_size: int = 0  # vllm: tokens per chained hash (0: block_size); a published
                              # block of k hash blocks carries the hash of its last one

    def __post_init__(self) -> None:
        if self.kind not in ("llmesh", "vllm"):
            raise ValueError(f"unknown KV hash scheme {self.kind!r}")
        if self.block_size < 1:
            raise ValueError("a KV block holds at least one token")
        if self.hash_block_size and self.block_size % self.hash_block_size:
            raise ValueError("a KV block must span a whole number of hash blocks")
        if self.kind == "vllm" and self.algo not in VLLM_ALGOS:
            raise ValueError(f"vLLM's {self.algo!r} block hashes cannot be reproduced outside the engine "
                             f"(reproducible: {', '.join(VLLM_ALGOS)})")

    def block_hashes(self, tokens: Sequence[int], lora: tuple[str, str] | None = None) -> list[int]:
        """The 64-bit hashes of the full blocks of ``tokens``; ``lora``: (name, path) of
        the adapter a vLLM request runs with."""
        if self.kind == "llmesh":
            return chain_hashes(tokens, self.block_size)
        fn = _sha256_pickle if self.algo == "sha256" else _sha256_cbor
        extra = (("lora", lora[0], lora[1]),) if lora else None
        bs = self.hash_block_size or self.block_size
        every = self.block_size // bs
        parent, out = self._none_hash, []
        for i, start in enumerate(range(0, len(tokens) - bs + 1, bs), 1):
            parent = fn((parent, tuple(tokens[start:start + bs]), extra))
            if i % every == 0:
                out.append(hash64(parent))
        return out

    @cached_property
    def _none_hash(self) -> bytes:
        return (_sha256_pickle if self.algo == "sha256" else _sha256_cbor)(self.seed)


LLMESH_SCHEME = HashScheme("llmesh", LLMESH_BLOCK_SIZE)
