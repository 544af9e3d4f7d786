"""Idempotency-Key: the digest of (caller, key) of the POST that made a job, unique.

Revision ID: 0004
Revises: 0003

A nullable column: jobs posted without a key (and every existing row) hold NULL, which a unique
index never treats as a duplicate, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("idempotency_key", sa.String(64)))
    op.create_index("ix_jobs_idempotency_key", "jobs", ["idempotency_key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_idempotency_key", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("idempotency_key")
