"""Per-key caps that hold for the deployment: one row per slot held (an upload being received, an
``audio_url`` download, a live session), leased by the replica holding it (app/jobs/holds.py).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision: str | None = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "holds",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("replica", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_index("ix_holds_kind_owner", "holds", ["kind", "owner"])
    op.create_index("ix_holds_replica", "holds", ["replica"])


def downgrade() -> None:
    op.drop_index("ix_holds_replica", "holds")
    op.drop_index("ix_holds_kind_owner", "holds")
    op.drop_table("holds")
