"""Alembic environment: the connection comes from db.upgrade (no URL in a file)."""

from alembic import context

from llmesh.modelmgr.db import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
