"""The jobs table: one row per job, its upload, its lease, its result and its webhook; and the
holds table: one row per per-key slot held with a replica's lease (app/jobs/holds.py).

Its own module so that the store (app/jobs/store.py) and the migrations' Alembic environment
(app/jobs/migrations/env.py) both read it without importing each other. A column added here
needs a migration too: ``tests/test_migrations.py`` fails until the migrated schema matches.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=True, index=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.Column("expires_at", sa.Float, index=True),
    sa.Column("filename", sa.String(512)),
    sa.Column("upload_path", sa.String(1024), nullable=False),
    sa.Column("options", sa.JSON, nullable=False),
    sa.Column("audio_seconds", sa.Float, nullable=False, default=0.0),
    sa.Column("windows_total", sa.Integer),
    sa.Column("windows_done", sa.Integer, nullable=False, default=0),
    sa.Column("queue_wait_s", sa.Float),
    sa.Column("processing_s", sa.Float),
    sa.Column("diarization_s", sa.Float),  # diarize jobs: wall seconds of their speaker work
    sa.Column("result", sa.JSON),
    sa.Column("error", sa.JSON),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("lease_owner", sa.String(128)),
    sa.Column("lease_expires_at", sa.Float),
    sa.Column("replica", sa.String(128)),  # who claimed it last; unlike lease_owner, kept at the end
    # Webhook delivery (app/jobs/webhooks.py). The state becomes "pending" in the same UPDATE that
    # finishes the job, so a crash between the two can never lose a delivery.
    sa.Column("callback_url", sa.String(2048)),
    sa.Column("webhook_status", sa.String(16), index=True),  # pending | delivered | failed
    sa.Column("webhook_attempts", sa.Integer),
    sa.Column("webhook_next_at", sa.Float),  # next attempt due (also the lease of one in flight)
    sa.Column("webhook_last_error", sa.String(512)),
    sa.Column("webhook_delivered_at", sa.Float),
    # sha256(owner, Idempotency-Key) of the POST that made the job (app/jobs/intake.py): the
    # owner is inside the digest, so one unique column scopes keys per caller, the keyless tenant
    # (owner NULL, which a unique index over (owner, key) would not constrain) included.
    sa.Column("idempotency_key", sa.String(64), unique=True, index=True),
)

# A slot of a per-key cap held somewhere in the deployment (an upload being received, an
# audio_url download, a live session): counted per (kind, owner) while its lease holds, the
# lease extended by its replica's heartbeat, so a replica that dies gives its slots back
# within storage.lease_s (app/jobs/holds.py). The keyless tenant's owner is ''.
holds = sa.Table(
    "holds",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("replica", sa.String(128), nullable=False, index=True),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Index("ix_holds_kind_owner", "kind", "owner"),
)
