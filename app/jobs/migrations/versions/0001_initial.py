"""The jobs table as the first release created it (metadata.create_all, before migrations).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Frozen copy of the columns, not app.jobs.schema.jobs: that table keeps changing, this must not.
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("expires_at", sa.Float),
        sa.Column("filename", sa.String(512)),
        sa.Column("upload_path", sa.String(1024), nullable=False),
        sa.Column("options", sa.JSON, nullable=False),
        sa.Column("audio_seconds", sa.Float, nullable=False),
        sa.Column("windows_total", sa.Integer),
        sa.Column("windows_done", sa.Integer, nullable=False),
        sa.Column("queue_wait_s", sa.Float),
        sa.Column("processing_s", sa.Float),
        sa.Column("result", sa.JSON),
        sa.Column("error", sa.JSON),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("lease_owner", sa.String(128)),
        sa.Column("lease_expires_at", sa.Float),
    )
    # The names create_all gave them, so databases from before migrations match exactly.
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_expires_at", "jobs", ["expires_at"])


def downgrade() -> None:
    op.drop_table("jobs")
