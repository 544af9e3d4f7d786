"""A diarize job's speaker time (``diarization_s``), shown apart from its processing time.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("diarization_s", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("diarization_s")
