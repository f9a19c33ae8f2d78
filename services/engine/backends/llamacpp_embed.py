"""The ``llamacpp_embed`` backend: embeddings from a GGUF model on llama.cpp's low-level API
(an embedding model converted to GGUF, such as nomic-embed or bge; or any GGUF given a pooling).
Each input is decoded as one sequence in a context made for embeddings, pooled as the GGUF says
(``LLMESH_ENGINE_EMBED_POOLING`` chooses where it names none, as a generative model's GGUF does)
and L2-normalised, as OpenAI's and sentence-transformers' vectors are. It serves Embed only:
Generate is refused (``Capabilities.generates`` is False).

The model store holds the GGUF as for the ``llamacpp`` backend (``ModelStore``, format gguf)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Literal

import numpy as np

from llmesh.errors import Internal
from llmesh.modelstore import ModelStore, quiet_native_stderr
from llmesh.engine.backends.base import Capabilities, EmbeddingOnly
from llmesh.engine.kvblocks import KvEventLog

Pooling = Literal["model", "mean", "cls", "last"]
POOLING = {"mean": 1, "cls": 2, "last": 3}  # llama_cpp.LLAMA_POOLING_TYPE_*; "model": as the GGUF says


class LlamaCppEmbedBackend(EmbeddingOnly):
    name = "llamacpp_embed"
    capabilities = Capabilities(generates=False, embeddings=True)
    gpu_memory_share = 0.0
    vocab_size = 0  # nothing is sampled

    def __init__(self, model_path: Path, model: str, *, n_ctx: int, n_threads: int, pooling: Pooling = "model"):
        import llama_cpp as lc

        self._lc = lc
        self.model = model
        self.models = (model,)
        self.kv_blocks = KvEventLog()  # no prefix cache kept between inputs: no events
        with quiet_native_stderr():
            self._model_p = lc.llama_model_load_from_file(str(model_path).encode(), lc.llama_model_default_params())
        if not self._model_p:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        n = min(n_ctx, lc.llama_model_n_ctx_train(self._model_p))
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n  # one input is one batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = True
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # its f16 on CPUs moved vectors by ~1e-2
        params.pooling_type = POOLING.get(pooling, lc.LLAMA_POOLING_TYPE_UNSPECIFIED)
        params.no_perf = True
        with quiet_native_stderr():
            self._ctx = lc.llama_init_from_model(self._model_p, params)
        if not self._ctx:
            lc.llama_model_free(self._model_p)
            raise RuntimeError("llama.cpp could not create an embeddings context")
        if lc.llama_pooling_type(self._ctx) == lc.LLAMA_POOLING_TYPE_NONE:
            self._free()
            raise ValueError(f"{model_path} names no pooling (a generative model's GGUF): set "
                             "LLMESH_ENGINE_EMBED_POOLING to mean, cls or last")
        self._vocab = lc.llama_model_get_vocab(self._model_p)
        self.dim = lc.llama_model_n_embd(self._model_p)
        self.max_input_tokens = self.context_length = n
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n, 0, 1)
        self._lock = threading.Lock()  # one context: one input decoded at a time

    @classmethod
    def from_store(cls, model_dir: Path, model: str, **kwargs) -> LlamaCppEmbedBackend:
        return cls(ModelStore(model_dir).gguf(model), model, **kwargs)

    def tokenize_inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids by the loaded model's own vocabulary, its special tokens added (BOS, and
        EOS or SEP where the GGUF asks for them), text that looks like a special token kept as text."""
        return [self._tokens(text.encode("utf-8")) for text in texts]

    def _tokens(self, data: bytes) -> list[int]:
        lc = self._lc
        room = len(data) + 8  # a token is at least one byte; the special tokens besides
        while True:
            buf = (lc.llama_token * room)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, room, True, False)
            if n >= 0:
                return buf[:n]
            room = -n  # llama.cpp says how many it needs

    def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Each input's pooled, L2-normalised vector (in a thread: llama.cpp releases the GIL)."""
        lc, out = self._lc, []
        with self._lock:
            for ids in token_ids:
                lc.llama_memory_clear(self._mem, True)
                batch = self._batch
                for i, token in enumerate(ids):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
                    batch.seq_id[i][0] = 0
                batch.n_tokens = len(ids)
                if lc.llama_decode(self._ctx, batch) != 0:
                    raise Internal("llama.cpp could not embed an input")
                vector = np.ctypeslib.as_array(lc.llama_get_embeddings_seq(self._ctx, 0), shape=(self.dim,))
                vector = vector.astype(np.float64)
                norm = float(np.linalg.norm(vector))
                out.append((vector / norm if norm > 0 else vector).tolist())
        return out

    def _free(self) -> None:
        self._lc.llama_free(self._ctx)
        self._lc.llama_model_free(self._model_p)

    async def close(self) -> None:
        with self._lock:
            self._lc.llama_batch_free(self._batch)
            self._free()
