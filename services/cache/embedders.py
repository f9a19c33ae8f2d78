"""The semantic cache's embedders, as the live config chooses them (``cache.embedder``): a local
sentence-transformers directory (MiniLM by default, on numpy) or an OpenAI-compatible
``/v1/embeddings`` endpoint; and ``Embedders``, which builds the chosen one off the event loop
and hands it out once it is ready.

An endpoint's key is never in the config: ``api_key_env`` must be in the cache's allow-list
(``LLMESH_CACHE_EMBED_KEY_ENVS``) and ``api_key_file`` must resolve inside its key directory
(``LLMESH_CACHE_EMBED_KEY_DIR``), as the gateway treats providers' keys."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

from llmesh.liveconfig.schema import CacheEmbedder
from llmesh.cache.semantic import Embedder

log = logging.getLogger("llmesh.cache")

MAX_KEY_BYTES = 16 * 1024
PROBE = "dimension probe"  # embedded once when an endpoint is chosen: its dimension is part of its identity


class EmbedderRefused(ValueError):
    """The configured embedder may not or cannot be used (its key's source, its model's path)."""


class KeySource(Protocol):
    """Where a key is named: an embedder's or a verifier's config."""
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def api_key_file(self) -> str | None: ...


@dataclass(frozen=True)
class EmbedderSecrets:
    """Where an endpoint's key may be read from: ``key_dir`` None: no file; ``key_envs`` empty: no variable."""
    key_dir: Path | None = None
    key_envs: frozenset[str] = frozenset()

    def api_key(self, spec: KeySource) -> str | None:
        if spec.api_key_env is not None:
            if spec.api_key_env not in self.key_envs:
                raise EmbedderRefused(f"api_key_env {spec.api_key_env!r} is not in LLMESH_CACHE_EMBED_KEY_ENVS")
            key = os.environ.get(spec.api_key_env)
            if not key:
                raise EmbedderRefused(f"the key variable {spec.api_key_env} is not set")
            return key
        if spec.api_key_file is not None:
            if self.key_dir is None:
                raise EmbedderRefused("api_key_file is not allowed: the cache has no embedder key directory")
            path = (self.key_dir / spec.api_key_file).resolve()
            if not path.is_relative_to(self.key_dir.resolve()) or not path.is_file():
                raise EmbedderRefused(f"api_key_file {spec.api_key_file!r} is not a file in the key directory")
            data = path.read_bytes()[:MAX_KEY_BYTES + 1]
            if len(data) > MAX_KEY_BYTES:
                raise EmbedderRefused("api_key_file is larger than a key")
            return data.decode("utf-8", "replace").strip()
        return None


class HttpEmbedder:
    """An OpenAI-compatible embeddings endpoint. Blocking (httpx's sync client): the cache calls
    ``encode`` on a worker thread. Its identity is the endpoint, the model and the dimension the
    endpoint returned for a probe when it was built."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._model = model
        self.dim = len(self._call(PROBE))
        self.identity = f"openai:{base_url.rstrip('/')}:{model}:{self.dim}"

    def _call(self, text: str) -> np.ndarray:
        resp = self._client.post("/embeddings", json={"model": self._model, "input": [text],
                                                      "encoding_format": "float"})
        resp.raise_for_status()
        vector = np.asarray(resp.json()["data"][0]["embedding"], dtype=np.float32)
        norm = float(np.linalg.norm(vector))
        if vector.ndim != 1 or not vector.size or not np.isfinite(norm) or norm == 0.0:
            raise ValueError("the endpoint returned no usable vector")
        out: np.ndarray = vector / norm  # unit length: the index's similarity is a dot product
        return out

    def encode(self, text: str) -> np.ndarray:
        vector = self._call(text)
        if len(vector) != self.dim:  # the endpoint changed its model under the same name
            raise ValueError(f"the endpoint returned {len(vector)} dimensions, not {self.dim}")
        return vector

    def close(self) -> None:
        self._client.close()


def build_embedder(spec: CacheEmbedder, default_dir: Path, secrets: EmbedderSecrets) -> Embedder:
    """The embedder ``spec`` names (blocking: loads a model or probes an endpoint)."""
    if spec.kind == "openai":
        assert spec.base_url is not None and spec.model is not None  # the schema's rule
        return HttpEmbedder(spec.base_url, spec.model, secrets.api_key(spec), spec.timeout_s)
    model_dir = default_dir
    if spec.model is not None:
        model_dir = (default_dir.parent / spec.model).resolve()
        if not model_dir.is_relative_to(default_dir.parent.resolve()):
            raise EmbedderRefused(f"model {spec.model!r} is outside {default_dir.parent}")
    if not (model_dir / "model.safetensors").is_file():
        raise EmbedderRefused(f"no model.safetensors in {model_dir}")
    from llmesh.embedding import MiniLM
    return MiniLM(model_dir)


class Embedders:
    """The embedder the live config chooses, built once on a worker thread. ``__call__`` never
    waits: until the chosen one is ready (or while it cannot be built: retried every ``retry_s``)
    it answers None, and the cache matches exactly only. It keeps the last ``keep`` built."""

    def __init__(self, build: Callable[[CacheEmbedder], Embedder], built: dict[CacheEmbedder, Embedder] | None = None,
                 retry_s: float = 5.0, keep: int = 2, clock: Callable[[], float] = time.monotonic):
        self._build = build
        self._built: dict[CacheEmbedder, Embedder] = dict(built or {})
        self._failed: dict[CacheEmbedder, float] = {}  # spec -> when to try again
        self._building: dict[CacheEmbedder, asyncio.Task[None]] = {}
        self._retry_s = retry_s
        self._keep = keep
        self._clock = clock

    def __call__(self, spec: CacheEmbedder) -> Embedder | None:
        embedder = self._built.get(spec)
        if embedder is not None:
            return embedder
        if spec not in self._building and self._failed.get(spec, 0.0) <= self._clock():
            self._building[spec] = asyncio.get_running_loop().create_task(self._make(spec))
        return None

    async def ready(self, spec: CacheEmbedder) -> Embedder | None:
        """The embedder for ``spec`` once its build (started now if need be) is over; None if it failed."""
        if self(spec) is None and spec in self._building:
            await asyncio.shield(self._building[spec])
        return self._built.get(spec)

    async def _make(self, spec: CacheEmbedder) -> None:
        try:
            embedder = await asyncio.to_thread(self._build, spec)
        except Exception as exc:  # noqa: BLE001 - a bad model or an endpoint away: exact matches meanwhile
            self._failed[spec] = self._clock() + self._retry_s
            log.warning("cannot build the cache's embedder; semantic matching waits",
                        extra={"kind": spec.kind, "model": spec.model, "error": f"{type(exc).__name__}: {exc}"})
            return
        finally:
            self._building.pop(spec, None)
        self._failed.pop(spec, None)
        self._built[spec] = embedder
        while len(self._built) > self._keep:
            oldest = next(iter(self._built))
            gone = self._built.pop(oldest)
            close = getattr(gone, "close", None)
            if close is not None:
                close()
        log.info("cache embedder ready", extra={"identity": embedder.identity})

    async def close(self) -> None:
        for task in list(self._building.values()):
            task.cancel()
        await asyncio.gather(*self._building.values(), return_exceptions=True)
        for embedder in self._built.values():
            close = getattr(embedder, "close", None)
            if close is not None:
                close()
