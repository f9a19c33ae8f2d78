"""The registry's tables (SQLAlchemy 2) and the schema's upgrade through Alembic.
SQLite by default, PostgreSQL (psycopg 3) in production: the same tables and
migrations on both."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, UniqueConstraint,
                        create_engine, event)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

MIGRATIONS = Path(__file__).with_name("migrations")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class ModelRow(Base):
    __tablename__ = "models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    versions: Mapped[list[VersionRow]] = relationship(back_populates="model", order_by="VersionRow.number")


class VersionRow(Base):
    __tablename__ = "versions"
    __table_args__ = (UniqueConstraint("model_id", "number"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(1024), default="")
    parent_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    lineage: Mapped[dict] = mapped_column(JSON, default=dict)   # training data, script, params: as given
    context_length: Mapped[int] = mapped_column(Integer, default=0)
    tokenizer: Mapped[str] = mapped_column(String(256), default="")
    eval_scores: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    model: Mapped[ModelRow] = relationship(back_populates="versions")
    artifacts: Mapped[list[ArtifactRow]] = relationship(back_populates="version", order_by="ArtifactRow.id")
    replicas: Mapped[list[ReplicaRow]] = relationship(back_populates="version", order_by="ReplicaRow.id")


class ArtifactRow(Base):
    """One variant of a version (its quantization), stored by content."""
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("version_id", "variant"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    variant: Mapped[str] = mapped_column(String(32))
    format: Mapped[str] = mapped_column(String(16))
    quantization: Mapped[str] = mapped_column(String(32), default="")
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    derived_from: Mapped[str] = mapped_column(String(32), default="")  # variant it was made from
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    version: Mapped[VersionRow] = relationship(back_populates="artifacts")


class ReplicaRow(Base):
    __tablename__ = "replicas"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    variant: Mapped[str] = mapped_column(String(32))
    endpoint_id: Mapped[str] = mapped_column(String(256))
    address: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))   # loading | warming | ready | failed | unloaded
    detail: Mapped[str] = mapped_column(String(1024), default="")
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    version: Mapped[VersionRow] = relationship(back_populates="replicas")


class AliasRow(Base):
    __tablename__ = "aliases"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    previous_version_id: Mapped[int | None] = mapped_column(ForeignKey("versions.id"), nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EventRow(Base):
    """The history: every state change, deploy, promotion and rollback."""
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    alias: Mapped[str] = mapped_column(String(128), default="")
    detail: Mapped[dict] = mapped_column(JSON, default=dict)


class EvalRow(Base):
    __tablename__ = "evals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    candidate_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    baseline_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    passed: Mapped[bool] = mapped_column(Boolean)
    exact_match: Mapped[float] = mapped_column(Float)
    similarity: Mapped[float] = mapped_column(Float)
    threshold: Mapped[float] = mapped_column(Float)
    report: Mapped[dict] = mapped_column(JSON, default=dict)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()
    return engine


def upgrade(engine: Engine) -> None:
    """Brings the schema to the newest migration (a no-op when it is there)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
