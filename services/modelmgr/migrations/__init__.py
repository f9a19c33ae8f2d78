"""Alembic migrations of the registry (run by db.upgrade at start)."""
