"""Cache keys. An exact key is a digest of everything that changes an answer; a
semantic scope is the same digest without the last user turn, so a semantic match
never crosses a tenant, a model (version), a system prompt, earlier turns or the
sampling parameters."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import orjson

from llmesh.types import Message, Prompt, Sampling

_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """NFC, surrounding whitespace stripped, inner runs of whitespace as one space:
    what a client's formatting changes without changing the question."""
    return _SPACES.sub(" ", unicodedata.normalize("NFC", text)).strip()


def _sampling_doc(sampling: Sampling) -> dict[str, Any]:
    """The parameters that change the output. At temperature 0 the answer is greedy:
    top_p and the seed change nothing, so they stay out and the entries are shared."""
    doc: dict[str, Any] = {"n": sampling.max_tokens, "s": list(sampling.stop)}
    if sampling.response_format is not None:
        doc["f"] = [sampling.response_format.type, sampling.response_format.schema]
    if sampling.temperature != 0.0:
        doc.update(t=sampling.temperature, p=sampling.top_p, seed=sampling.seed)
    knobs = sampling.knobs()  # the penalties change a greedy answer too
    if knobs:
        doc["k"] = knobs
    return doc


def _messages(messages: tuple[Message, ...]) -> list[list[str]]:
    return [[m.role, normalise(m.content)] for m in messages]


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True, slots=True)
class Request:
    """What the cache is asked about: the tenant, the model (and its version when
    known), the already PII-masked prompt and the sampling parameters."""
    tenant: str
    model: str
    prompt: Prompt
    sampling: Sampling
    model_version: str = ""


def exact_key(req: Request) -> str:
    prompt = req.prompt
    doc = {"t": req.tenant, "m": req.model, "v": req.model_version,
           "c": _messages(prompt.messages) if prompt.messages is not None else None,
           "p": normalise(prompt.text) if prompt.text is not None else None, **_sampling_doc(req.sampling)}
    return _digest(doc)


@dataclass(frozen=True, slots=True)
class SemanticQuery:
    scope: str   # digest of everything but the last user turn
    text: str    # the last user turn, normalised


def semantic_query(req: Request) -> SemanticQuery | None:
    """Chats whose last message is the user's are open to semantic matching; the
    scope fingerprints the system prompt and every earlier turn."""
    messages = req.prompt.messages
    if not messages or messages[-1].role != "user" or not messages[-1].content.strip():
        return None
    doc = {"t": req.tenant, "m": req.model, "v": req.model_version, "ctx": _messages(messages[:-1]),
           **_sampling_doc(req.sampling)}
    return SemanticQuery(scope=_digest(doc), text=normalise(messages[-1].content))


def embedded_scope(identity: str, scope: str) -> str:
    """A semantic scope as the index and the store keep it: the embedder's identity (model name and
    version; an endpoint's model and dimension) first, so vectors of two embedders never share a
    scope, and a change of embedder starts from an empty one."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16] + ":" + scope
