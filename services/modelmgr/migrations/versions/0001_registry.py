"""The registry: models, versions, artifacts, replicas, aliases, events, evals.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _at(name: str = "created_at") -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    _catalog()
    _serving()
    _history()


def _catalog() -> None:
    """Models, their versions and each version's artifacts."""
    op.create_table(
        "models",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        _at())
    op.create_table(
        "versions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("parent_version", sa.Integer, nullable=True),
        sa.Column("lineage", sa.JSON, nullable=False),
        sa.Column("context_length", sa.Integer, nullable=False),
        sa.Column("tokenizer", sa.String(256), nullable=False),
        sa.Column("eval_scores", sa.JSON, nullable=False),
        _at(),
        sa.UniqueConstraint("model_id", "number"))
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("variant", sa.String(32), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("quantization", sa.String(32), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False, index=True),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("derived_from", sa.String(32), nullable=False),
        _at(),
        sa.UniqueConstraint("version_id", "variant"))


def _serving() -> None:
    """Where versions run, and the aliases clients name them by."""
    op.create_table(
        "replicas",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("variant", sa.String(32), nullable=False),
        sa.Column("endpoint_id", sa.String(256), nullable=False),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("detail", sa.String(1024), nullable=False),
        _at("updated_at"))
    op.create_table(
        "aliases",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("previous_version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=True),
        _at("updated_at"))


def _history() -> None:
    """What happened to each model, and the evaluations behind promotions."""
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        _at("at"),
        sa.Column("model", sa.String(128), nullable=False, index=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("alias", sa.String(128), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False))
    op.create_table(
        "evals",
        sa.Column("id", sa.Integer, primary_key=True),
        _at("at"),
        sa.Column("candidate_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("baseline_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("passed", sa.Boolean, nullable=False),
        sa.Column("exact_match", sa.Float, nullable=False),
        sa.Column("similarity", sa.Float, nullable=False),
        sa.Column("threshold", sa.Float, nullable=False),
        sa.Column("report", sa.JSON, nullable=False))


def downgrade() -> None:
    for table in ("evals", "events", "aliases", "replicas", "artifacts", "versions", "models"):
        op.drop_table(table)
