"""Which replica claimed a job last: kept after it finishes (a lease owner is cleared).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("replica", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("replica")
