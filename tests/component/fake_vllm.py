"""A FAKE of vLLM's AsyncLLM, for the backend contract tests only (vLLM needs a GPU
and is not installed in CI). It mimics the surface the vllm backend uses: generate()
streaming DELTA outputs, abort(), add_lora()/remove_lora(), shutdown(), a stat
logger call per step, and KV events published over a real ZMQ PUB socket in vLLM's
wire format ([topic, seq, msgpack KVEventBatch]). Nothing here counts as vLLM working:
`make gpu-smoke` runs the real thing."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import zmq

from llmesh.engine.kvblocks import chain_hashes

WORDS = ("red", "green", "blue", "cyan", "teal", "gold", "gray", "pink")


class FakeTokenizer:
    """Whitespace words hashed into a 1000-token vocabulary; a ChatML-like template."""

    def __len__(self) -> int:
        return 1000

    def encode(self, text: str) -> list[int]:
        return [int.from_bytes(hashlib.blake2s(w.encode(), digest_size=4).digest(), "big") % 1000
                for w in text.split()]

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool,
                            return_dict: bool = False) -> list[int]:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return self.encode(text + (" <assistant>" if add_generation_prompt else ""))


@dataclass
class FakeSamplingParams:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    output_kind: object


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


API = SimpleNamespace(SamplingParams=FakeSamplingParams, RequestOutputKind=SimpleNamespace(DELTA="delta"),
                      LoRARequest=FakeLoRARequest)


class FakeAsyncLLM:
    def __init__(self, kv_endpoint: str, on_stats=lambda stats: None, block_size: int = 16):
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.loras: dict[int, FakeLoRARequest] = {}
        self._on_stats = on_stats
        self._bs = block_size
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.bind(kv_endpoint)
        self._seq = 0

    def _publish(self, events: list) -> None:
        payload = msgspec.msgpack.encode([time.time(), events])
        self._pub.send_multipart([b"kv", self._seq.to_bytes(8, "big", signed=True), payload])
        self._seq += 1

    async def generate(self, prompt: dict, sampling_params: FakeSamplingParams, request_id: str, lora_request=None):
        tokens = prompt["prompt_token_ids"]
        self.active.add(request_id)
        hashes = chain_hashes(tokens, self._bs)
        if hashes:  # BlockStored: [tag, block_hashes, parent, token_ids, block_size, lora_id, medium]
            self._publish([["BlockStored", hashes, None, tokens[:len(hashes) * self._bs], self._bs, None, "GPU"]])
        rng = random.Random(hash((tuple(tokens), sampling_params.seed, sampling_params.temperature)))
        try:
            for i in range(min(sampling_params.max_tokens, 12)):
                await asyncio.sleep(0.002)
                if request_id not in self.active:
                    return
                self._on_stats(SimpleNamespace(kv_cache_usage=min(1.0, len(self.active) / 8)))
                word = WORDS[rng.randrange(len(WORDS))]
                done = i + 1 == min(sampling_params.max_tokens, 12)
                yield SimpleNamespace(outputs=[SimpleNamespace(text=(" " if i else "") + word, token_ids=[i])],
                                      finished=done)
        finally:
            self.active.discard(request_id)
            self._on_stats(SimpleNamespace(kv_cache_usage=len(self.active) / 8))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    async def add_lora(self, request: FakeLoRARequest) -> bool:
        self.loras[request.lora_int_id] = request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def shutdown(self) -> None:
        self._pub.close(linger=0)
