"""The model list names only what can answer (services/gateway/domain/listing.py)."""

from __future__ import annotations

from llmesh.gateway.domain.listing import EMBEDDING, GENERATIVE, listed_models
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker
from llmesh.liveconfig.schema import MeshConfig


def names(config: MeshConfig, served: set[str]) -> list[str]:
    return [m.name for m in listed_models(config, served)]


def test_only_served_provider_and_autoscaled_models_are_listed():
    config = MeshConfig.model_validate({
        "providers": {"openai": {"base_url": "https://api.example.com/v1", "models": {"hosted": "gpt"}}},
        "autoscaling": {"models": {"scaled": {}}}})
    listed = listed_models(config, {"smol", "sim-small"})
    assert [m.name for m in listed] == ["hosted", "scaled", "sim-small", "smol"]
    assert {m.name: m.owned_by for m in listed}["hosted"] == "openai"
    assert {m.name: m.owned_by for m in listed}["smol"] == "llmesh"
    assert all(m.serves == GENERATIVE for m in listed)
    assert [s.value for s in GENERATIVE] == ["chat", "completions"]


def test_an_alias_is_listed_when_its_models_can_answer():
    config = MeshConfig.model_validate({
        "models": {"registered": {"fallbacks": ["smol"]}, "lost": {"fallbacks": ["gone"]}},
        "splits": {"ab": {"targets": [{"model": "smol", "weight": 1}, {"model": "registered", "weight": 1}]},
                   "half": {"targets": [{"model": "smol", "weight": 1}, {"model": "gone", "weight": 1}]}},
        "cascades": {"cheap-first": {"cheap": "gone", "strong": "smol", "min_confidence": -1},
                     "nowhere": {"cheap": "gone", "strong": "lost", "min_confidence": -1}}})
    # a fallback to a served model serves; a split needs every arm; a cascade either model
    assert names(config, {"smol"}) == ["ab", "cheap-first", "registered", "smol"]
    assert names(config, set()) == []


def test_the_picker_offers_only_healthy_endpoints_models():
    """A degraded node's model is listed: it answers when no other endpoint can (picker preference)."""
    picker = EndpointPicker()
    picker.replace_all([Endpoint("e1", "a:1", frozenset({"smol"})),
                        Endpoint("e2", "a:2", frozenset({"sick"}), healthy=False),
                        Endpoint("e3", "a:3", frozenset({"ecc"}), degraded="ecc errors rising")])
    assert picker.healthy_models() == {"smol", "ecc"}
    assert names(MeshConfig(), picker.healthy_models()) == ["ecc", "smol"]


def test_embedding_models_say_so_and_come_after_the_generative_ones():
    """A client that takes the first listed model can chat with it (issue 29)."""
    config = MeshConfig.model_validate({
        "splits": {"embed-ab": {"targets": [{"model": "all-minilm-l6-v2", "weight": 1}]},
                   "chat-ab": {"targets": [{"model": "smol", "weight": 1}]}}})
    listed = listed_models(config, {"all-minilm-l6-v2", "smol", "zeta"}, embedding={"all-minilm-l6-v2"})
    assert [(m.name, m.serves) for m in listed] == [
        ("chat-ab", GENERATIVE), ("smol", GENERATIVE), ("zeta", GENERATIVE),
        ("all-minilm-l6-v2", EMBEDDING), ("embed-ab", EMBEDDING)]
    assert [s.value for s in EMBEDDING] == ["embeddings"]


def test_the_picker_tells_embedding_models_from_generative_ones():
    picker = EndpointPicker()
    picker.replace_all([Endpoint("g", "a:1", frozenset({"smol"})),
                        Endpoint("e", "a:2", frozenset({"mini"}), embeds=frozenset({"mini"}))])
    assert picker.embedding_models() == {"mini"} and picker.generative_models() == {"smol"}
    assert [m.name for m in listed_models(MeshConfig(), picker.healthy_models(), picker.embedding_models())] == [
        "smol", "mini"]
