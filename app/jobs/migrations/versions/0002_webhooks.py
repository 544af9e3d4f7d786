"""Webhook delivery state on the job row (app/jobs/webhooks.py).

Revision ID: 0002
Revises: 0001

Databases from before migrations may already have some of these columns (the old start-up added
missing nullable columns), so each column and the index is added only when absent.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels = None
depends_on = None

COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ("callback_url", sa.String(2048)),
    ("webhook_status", sa.String(16)),  # pending | delivered | failed
    ("webhook_attempts", sa.Integer()),
    ("webhook_next_at", sa.Float()),  # next attempt due (also the lease of one in flight)
    ("webhook_last_error", sa.String(512)),
    ("webhook_delivered_at", sa.Float()),
)


def upgrade() -> None:
    insp = sa.inspect(op.get_bind())
    have = {c["name"] for c in insp.get_columns("jobs")}
    for name, kind in COLUMNS:
        if name not in have:
            op.add_column("jobs", sa.Column(name, kind))
    if "ix_jobs_webhook_status" not in {i["name"] for i in insp.get_indexes("jobs")}:
        op.create_index("ix_jobs_webhook_status", "jobs", ["webhook_status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_webhook_status", "jobs")
    with op.batch_alter_table("jobs") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
