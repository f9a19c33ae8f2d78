"""The model registry: models, their numbered versions, each version's artifacts
(variants by quantization) with checksums and lineage, the replicas that serve a
version, aliases, eval reports and the history of every change. Pure domain code
over SQLAlchemy sessions; no gRPC.

Lifecycle of a version (as in MLflow's stages, with the steps KServe takes):
registered -> validated -> staged -> serving -> deprecated -> archived."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from llmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from llmesh.modelmgr.db import (AliasRow, ArtifactRow, EvalRow, EventRow, ModelRow, ReplicaRow, VersionRow,
                                utcnow)

STATES = ("registered", "validated", "staged", "serving", "deprecated", "archived")
TRANSITIONS = {
    "registered": {"validated", "archived"},
    "validated": {"staged", "archived"},
    "staged": {"serving", "validated", "archived"},
    "serving": {"deprecated"},
    "deprecated": {"serving", "staged", "archived"},
    "archived": set(),
}
REPLICA_STATES = ("loading", "warming", "ready", "failed", "unloaded")


@dataclass(frozen=True, slots=True)
class Artifact:
    variant: str
    format: str
    quantization: str
    sha256: str
    size_bytes: int
    derived_from: str = ""


@dataclass(frozen=True, slots=True)
class Replica:
    id: int
    variant: str
    endpoint_id: str
    address: str
    state: str
    detail: str
    updated_at: dt.datetime


@dataclass(frozen=True, slots=True)
class Version:
    name: str
    number: int
    state: str
    source: str = ""
    parent_version: int | None = None
    lineage: dict = field(default_factory=dict)
    context_length: int = 0
    tokenizer: str = ""
    eval_scores: dict = field(default_factory=dict)
    created_at: dt.datetime | None = None
    artifacts: tuple[Artifact, ...] = ()
    replicas: tuple[Replica, ...] = ()

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.number}"

    @property
    def served_name(self) -> str:
        """The name engines serve this version under (and the gateway routes to)."""
        return served_name(self.name, self.number)

    def artifact(self, variant: str) -> Artifact:
        for a in self.artifacts:
            if a.variant == variant:
                return a
        raise NotFound(f"{self.ref} has no variant {variant!r} (it has {[a.variant for a in self.artifacts]})")

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "ready"]


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    at: dt.datetime
    model: str
    version: int
    kind: str
    alias: str
    detail: dict


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    current: str        # name:number
    previous: str       # name:number or ""
    updated_at: dt.datetime


@dataclass(frozen=True, slots=True)
class EvalReport:
    id: int
    at: dt.datetime
    candidate: str
    baseline: str
    passed: bool
    exact_match: float
    similarity: float
    threshold: float
    report: dict


def served_name(name: str, number: int) -> str:
    return f"{name}@{number}"


def parse_ref(ref: str) -> tuple[str, int]:
    """'name:3' -> ('name', 3); a bad reference is INVALID_ARGUMENT."""
    name, sep, number = ref.rpartition(":")
    if not sep or not name or not number.isdigit() or int(number) < 1:
        raise InvalidArgument(f"name a version as NAME:VERSION (e.g. smollm2:2), got {ref!r}", param="version")
    return name, int(number)


def check_name(name: str) -> None:
    if not name or len(name) > 100 or not all(c.isalnum() or c in "-_." for c in name) or name[0] in "-_.":
        raise InvalidArgument(f"a model name is letters, digits, '-', '_' and '.', at most 100, got {name!r}",
                              param="name")


class Registry:
    def __init__(self, engine: Engine):
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # --- versions -------------------------------------------------------
    def create_version(self, name: str, artifact: Artifact, *, source: str, context_length: int,
                       tokenizer: str = "", parent_version: int | None = None, lineage: dict | None = None) -> Version:
        """A new version (next number) holding one artifact: registered, then
        validated (the caller verified its checksum and read its header)."""
        check_name(name)
        for attempt in range(3):  # two importers racing for the same number: the loser retries
            try:
                with self._tx() as s:
                    model = s.scalar(select(ModelRow).where(ModelRow.name == name))
                    if model is None:
                        model = ModelRow(name=name)
                        s.add(model)
                        s.flush()
                    if parent_version is not None and s.scalar(select(VersionRow.id).where(
                            VersionRow.model_id == model.id, VersionRow.number == parent_version)) is None:
                        raise NotFound(f"parent version {name}:{parent_version} does not exist")
                    number = 1 + max((v.number for v in model.versions), default=0)
                    row = VersionRow(model=model, number=number, state="registered", source=source,
                                     parent_version=parent_version, lineage=dict(lineage or {}),
                                     context_length=context_length, tokenizer=tokenizer, eval_scores={})
                    s.add(row)
                    s.add(_artifact_row(row, artifact))
                    self._event(s, name, number, "registered", detail={"source": source, "sha256": artifact.sha256})
                    self._move(s, row, "validated", {"variant": artifact.variant})
                return self.get(name, number)
            except IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def add_artifact(self, name: str, number: int, artifact: Artifact) -> Version:
        with self._tx() as s:
            row = self._version_row(s, name, number)
            if any(a.variant == artifact.variant for a in row.artifacts):
                raise InvalidArgument(f"{name}:{number} already has a {artifact.variant} variant", param="variant")
            s.add(_artifact_row(row, artifact))
            self._event(s, name, number, "variant_added",
                        detail={"variant": artifact.variant, "sha256": artifact.sha256,
                                "derived_from": artifact.derived_from})
        return self.get(name, number)

    def get(self, name: str, number: int) -> Version:
        with self._tx() as s:
            return _version(self._version_row(s, name, number))

    def list(self, name: str = "") -> list[Version]:
        with self._tx() as s:
            q = (select(VersionRow).join(ModelRow).options(selectinload(VersionRow.artifacts),
                                                           selectinload(VersionRow.replicas))
                 .order_by(ModelRow.name, VersionRow.number))
            if name:
                q = q.where(ModelRow.name == name)
            return [_version(v) for v in s.scalars(q)]

    def set_state(self, name: str, number: int, state: str, detail: dict | None = None, alias: str = "") -> Version:
        with self._tx() as s:
            self._move(s, self._version_row(s, name, number), state, detail or {}, alias)
        return self.get(name, number)

    def record_eval(self, name: str, number: int, scores: dict) -> None:
        with self._tx() as s:
            self._version_row(s, name, number).eval_scores = scores

    # --- replicas -------------------------------------------------------
    def add_replica(self, name: str, number: int, variant: str, endpoint_id: str, address: str) -> int:
        with self._tx() as s:
            row = self._version_row(s, name, number)
            rep = ReplicaRow(version=row, variant=variant, endpoint_id=endpoint_id, address=address,
                             state="loading", detail="")
            s.add(rep)
            s.flush()
            self._event(s, name, number, "replica_loading", detail={"endpoint": endpoint_id, "variant": variant})
            return rep.id

    def set_replica(self, replica_id: int, state: str, detail: str = "") -> None:
        if state not in REPLICA_STATES:
            raise InvalidArgument(f"unknown replica state {state!r}")
        with self._tx() as s:
            rep = s.get(ReplicaRow, replica_id)
            if rep is None:
                raise NotFound(f"no replica {replica_id}")
            rep.state, rep.detail, rep.updated_at = state, detail[:1000], utcnow()
            self._event(s, rep.version.model.name, rep.version.number, f"replica_{state}",
                        detail={"endpoint": rep.endpoint_id, "detail": detail[:200]} if detail
                        else {"endpoint": rep.endpoint_id})

    def replicas_on(self, endpoint_id: str) -> builtins.list[tuple[str, int, Replica]]:
        """Live (not unloaded or failed) replicas on an engine."""
        with self._tx() as s:
            rows = s.scalars(select(ReplicaRow).where(ReplicaRow.endpoint_id == endpoint_id,
                                                      ReplicaRow.state.in_(("loading", "warming", "ready"))))
            return [(r.version.model.name, r.version.number, _replica(r)) for r in rows]

    # --- aliases --------------------------------------------------------
    def alias(self, alias: str) -> Alias | None:
        with self._tx() as s:
            row = s.get(AliasRow, alias)
            return None if row is None else _alias(s, row)

    def aliases(self) -> builtins.list[Alias]:
        with self._tx() as s:
            return [_alias(s, row) for row in s.scalars(select(AliasRow).order_by(AliasRow.name))]

    def point_alias(self, alias: str, name: str, number: int, kind: str, detail: dict | None = None) -> Alias:
        """Moves the alias to name:number in one transaction, remembering where it pointed."""
        check_name(alias)
        with self._tx() as s:
            target = self._version_row(s, name, number)
            row = s.get(AliasRow, alias, with_for_update=True)
            if row is None:
                row = AliasRow(name=alias, version_id=target.id, previous_version_id=None)
                s.add(row)
            else:
                row.previous_version_id, row.version_id = row.version_id, target.id
            row.updated_at = utcnow()
            self._event(s, name, number, kind, alias=alias, detail=detail or {})
            s.flush()
            return _alias(s, row)

    # --- evals and history ----------------------------------------------
    def add_eval(self, candidate: tuple[str, int], baseline: tuple[str, int], passed: bool, exact_match: float,
                 similarity: float, threshold: float, report: dict) -> EvalReport:
        with self._tx() as s:
            cand, base = self._version_row(s, *candidate), self._version_row(s, *baseline)
            row = EvalRow(candidate_id=cand.id, baseline_id=base.id, passed=passed, exact_match=exact_match,
                          similarity=similarity, threshold=threshold, report=report)
            s.add(row)
            s.flush()
            self._event(s, candidate[0], candidate[1], "eval_passed" if passed else "eval_failed",
                        detail={"eval": row.id, "against": f"{baseline[0]}:{baseline[1]}",
                                "similarity": round(similarity, 4), "exact_match": round(exact_match, 4)})
            return _eval(row, cand, base)

    def evals(self, name: str = "", number: int = 0) -> builtins.list[EvalReport]:
        with self._tx() as s:
            q = select(EvalRow).order_by(EvalRow.id)
            if name:
                q = q.where(EvalRow.candidate_id == self._version_row(s, name, number).id)
            out = []
            for row in s.scalars(q):
                out.append(_eval(row, s.get_one(VersionRow, row.candidate_id), s.get_one(VersionRow, row.baseline_id)))
            return out

    def event(self, name: str, number: int, kind: str, alias: str = "", detail: dict | None = None) -> None:
        with self._tx() as s:
            self._event(s, name, number, kind, alias, detail or {})

    def history(self, name: str = "", alias: str = "") -> builtins.list[Event]:
        with self._tx() as s:
            q = select(EventRow).order_by(EventRow.id)
            if name:
                q = q.where(EventRow.model == name)
            if alias:
                q = q.where(EventRow.alias == alias)
            return [Event(e.id, e.at, e.model, e.version, e.kind, e.alias, e.detail) for e in s.scalars(q)]

    # --- helpers --------------------------------------------------------
    @staticmethod
    def _version_row(s: Session, name: str, number: int) -> VersionRow:
        row = s.scalar(select(VersionRow).join(ModelRow).where(ModelRow.name == name, VersionRow.number == number))
        if row is None:
            raise NotFound(f"no model version {name}:{number}")
        return row

    def _move(self, s: Session, row: VersionRow, state: str, detail: dict, alias: str = "") -> None:
        if state not in STATES:
            raise InvalidArgument(f"unknown state {state!r}; one of {list(STATES)}", param="state")
        if state == row.state:
            return
        if state not in TRANSITIONS[row.state]:
            raise FailedPrecondition(f"{row.model.name}:{row.number} is {row.state}; it cannot become {state}")
        old, row.state = row.state, state
        self._event(s, row.model.name, row.number, state, alias, {"from": old, **detail})

    @staticmethod
    def _event(s: Session, name: str, number: int, kind: str, alias: str = "", detail: dict | None = None) -> None:
        s.add(EventRow(model=name, version=number, kind=kind, alias=alias, detail=detail or {}))


def _artifact_row(version: VersionRow, a: Artifact) -> ArtifactRow:
    return ArtifactRow(version=version, variant=a.variant, format=a.format, quantization=a.quantization,
                       sha256=a.sha256, size_bytes=a.size_bytes, derived_from=a.derived_from)


def _replica(r: ReplicaRow) -> Replica:
    return Replica(r.id, r.variant, r.endpoint_id, r.address, r.state, r.detail, r.updated_at)


def _version(v: VersionRow) -> Version:
    return Version(name=v.model.name, number=v.number, state=v.state, source=v.source,
                   parent_version=v.parent_version, lineage=dict(v.lineage or {}), context_length=v.context_length,
                   tokenizer=v.tokenizer, eval_scores=dict(v.eval_scores or {}), created_at=v.created_at,
                   artifacts=tuple(Artifact(a.variant, a.format, a.quantization, a.sha256, a.size_bytes,
                                            a.derived_from) for a in v.artifacts),
                   replicas=tuple(_replica(r) for r in v.replicas))


def _ref(s: Session, version_id: int | None) -> str:
    if version_id is None:
        return ""
    v = s.get_one(VersionRow, version_id)
    return f"{v.model.name}:{v.number}"


def _alias(s: Session, row: AliasRow) -> Alias:
    return Alias(row.name, _ref(s, row.version_id), _ref(s, row.previous_version_id), row.updated_at)


def _eval(row: EvalRow, cand: VersionRow, base: VersionRow) -> EvalReport:
    return EvalReport(row.id, row.at, f"{cand.model.name}:{cand.number}", f"{base.model.name}:{base.number}",
                      row.passed, row.exact_match, row.similarity, row.threshold, dict(row.report or {}))
