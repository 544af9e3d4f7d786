"""Alembic environment: always on the connection :func:`app.jobs.migrations.migrate` hands over.

The service runs migrations itself (inside the start-up transaction that holds the migration
lock), so there is no alembic.ini and no URL here: a second way to reach the database would be a
second place to get its driver, credentials and SQLite pragmas wrong.
"""

from __future__ import annotations

from alembic import context

from app.jobs.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through app.jobs.migrations.migrate(connection)")

context.configure(
    connection=connection,
    target_metadata=metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table when a migration
    # needs it (adding a nullable column does not).
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
