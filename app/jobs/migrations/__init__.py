"""Versioned schema migrations (Alembic), run by :meth:`app.jobs.store.JobStore.init` at start-up.

A new column or index is a new file in ``versions/`` (never an edit of an applied one), and
``tests/test_migrations.py`` fails while the migrated schema differs from ``app.jobs.schema.jobs``.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent
BASELINE = "0001"  # what metadata.create_all made before migrations existed
# Any constant shared by every replica: PostgreSQL advisory lock key ("bsmigr" in ASCII).
LOCK_KEY = 0x62736D696772


def config(conn: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = conn
    return cfg


def head() -> str:
    from alembic.script import ScriptDirectory

    rev = ScriptDirectory.from_config(config()).get_current_head()
    assert rev is not None
    return rev


def migrate(conn: sa.Connection) -> None:
    """Bring the schema to the newest revision, on ``conn`` and in its transaction.

    Replicas starting together serialise on a PostgreSQL advisory lock held until this
    transaction commits (DDL is transactional there, so the next one sees the finished schema).
    SQLite has a single writer anyway. A database made before migrations (a ``jobs`` table but no
    ``alembic_version``) is stamped at the baseline, then upgraded like any other.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": LOCK_KEY})
    cfg = config(conn)
    insp = sa.inspect(conn)
    if insp.has_table("jobs") and not insp.has_table("alembic_version"):
        command.stamp(cfg, BASELINE)
    command.upgrade(cfg, "head")
