"""Signed job webhooks: when a job with a ``callback_url`` ends done or failed, POST its summary.

Durability: the job store marks the delivery ``pending`` in the same UPDATE that finishes the
job (:meth:`app.jobs.store.JobStore.finish`), so no crash can lose one. The dispatcher claims due
deliveries under a short lease (``webhook_next_at`` pushed forward), so replicas sharing a
database never send the same attempt twice, and deliveries pending at a restart resume.
The loop is event-driven: woken by a finished job, or sleeping until the next retry is due.

Signing (Stripe's scheme): ``X-Batchscribe-Signature: sha256=HEX(HMAC_SHA256(secret,
"{timestamp}.{body}"))`` with ``X-Batchscribe-Timestamp``, where ``secret`` is the job's API
key's own (:func:`key_secret`: derived from ``webhooks.secret`` and the key's id, shown to that
key by ``GET /webhooks/secret``; without keys, ``webhooks.secret`` itself). The key's id is in
the signed body (``key_id``) and in ``X-Batchscribe-Key-Id``: tenant A can point a job at B's
receiver, but B, verifying with B's secret, rejects it, and no tenant can sign for another.
Receivers reject old timestamps (replay) and compare in constant time (:func:`verify`).
Semantics are at-least-once: a receiver that answered 2xx but whose answer was lost gets the
same ``X-Batchscribe-Delivery`` again, and should deduplicate on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from typing import Any

import sqlalchemy as sa

from app.config import WebhookSettings
from app.errors import BadRequest, public_error
from app.jobs.store import JobRow, JobStore, claim_rows, db_now, jobs
from app.net.outbound import OutboundError, OutboundGuard

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Batchscribe-Signature"
TIMESTAMP_HEADER = "X-Batchscribe-Timestamp"
DELIVERY_HEADER = "X-Batchscribe-Delivery"
EVENT_HEADER = "X-Batchscribe-Event"
ATTEMPT_HEADER = "X-Batchscribe-Attempt"
KEY_HEADER = "X-Batchscribe-Key-Id"
KEY_SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300  # receivers: refuse signatures older (or newer) than this
CLAIM_BATCH = 16
MAX_IDLE_S = 60.0  # also catches deliveries another replica released or left behind
BUSY_RETRY_S = 1.0  # a delivery that got no slot in SLOT_WAIT_S is due again this much later
SLOT_WAIT_S = 20.0  # a claimed delivery waits this long for a slot (inside its claim's lease)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def key_secret(secret: str, owner: str | None) -> str:
    """The webhook secret of one API key (``owner``: its id): HMAC-SHA256 of the server's secret
    over the key's id, so each tenant can verify only its own deliveries and forge none, and
    nothing per key is stored. Without keys (``owner`` None) the one tenant uses the server's."""
    if owner is None:
        return secret
    mac = hmac.new(secret.encode(), b"batchscribe webhook key " + owner.encode(), hashlib.sha256)
    return KEY_SECRET_PREFIX + mac.hexdigest()


def verify(secret: str, body: bytes, timestamp: str | None, signature: str | None,
           tolerance_s: float = TOLERANCE_S, now: float | None = None) -> bool:
    """What a receiver does: fresh timestamp, and the signature matches in constant time."""
    if not timestamp or not signature:
        return False
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature.strip())


async def check_callback_url(settings: WebhookSettings, guard: OutboundGuard,
                             url: str | None) -> str | None:
    """Validate a request's callback_url through the outbound guard; a 400 names the field
    (before any upload is spooled)."""
    url = (url or "").strip() or None
    if url is None:
        return None
    if not settings.enabled:
        raise BadRequest("webhooks are off on this service (no webhooks secret configured)",
                         field="callback_url")
    return await guard.check_url(url, "callback_url")


def summary(row: JobRow) -> dict[str, Any]:
    """The POSTed body: the job's outcome, not its transcript (fetch result_url for that)."""
    result = row.result or {}
    return {
        "event": f"job.{row.status}", "id": row.id, "status": row.status, "key_id": row.owner,
        "filename": row.filename, "created_at": row.created_at, "finished_at": row.finished_at,
        "audio_seconds": row.audio_seconds, "language": result.get("language"),
        "status_url": f"/jobs/{row.id}", "result_url": f"/jobs/{row.id}/result",
        "error": public_error(row.error),
    }


class WebhookDispatcher:
    """Claims due deliveries and sends them through the outbound guard: every attempt is
    checked where it connects, ends by ``timeout_s`` whatever the receiver does, and reads at
    most ``outbound.max_answer_bytes`` of the answer. ``last_error`` records a category
    (``HTTP 503``, ``timeout``, ``refused``...), never an address or exception text.

    Deliveries are the owner's: each holds one of its API key's outbound slots (at most
    ``outbound.max_per_key`` in all, ``max_per_host_per_key`` at one receiver's address), and
    claims go round robin across keys (a key's n-th due delivery after every other key's
    first) and skip keys whose slots are all taken here: issue 51 measured one key's webhooks
    filling every outbound slot, the dispatcher ignoring whose they were."""

    def __init__(self, settings: WebhookSettings, store: JobStore, guard: OutboundGuard) -> None:
        self.settings = settings
        self.store = store
        self.guard = guard
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        # A claimed attempt is not claimed again before it must have ended (its deadline + slack).
        self._lease_s = settings.timeout_s + 30.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="webhooks")

    def wake(self, *_: object) -> None:
        """Called when a job ends (the event hub's end hooks, app/jobs/events.py): its delivery
        is due now."""
        self._wake.set()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop claiming; attempts still in flight after ``grace_s`` resume after a restart."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=grace_s)
            for t in self._inflight:
                t.cancel()
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            timeout = MAX_IDLE_S
            try:
                free = min(CLAIM_BATCH, self.guard.free() - self.guard.slots.waiting())
                for row in await self._claim(free):
                    task = asyncio.create_task(self._deliver(row), name=f"webhook-{row.id}")
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                due = await self._next_due() if free > 0 else None  # full: an ending attempt wakes us
                if due is not None:
                    timeout = min(MAX_IDLE_S, max(0.0, due))
            except Exception:
                log.exception("webhook dispatch pass failed; retrying")
                timeout = 5.0
            # Not asyncio.wait_for: on Python 3.11 it returns normally when a cancel lands as the
            # event is set (the inner wait has finished), so stop()'s cancel was lost and the loop
            # went on waiting (2 of 12 runs of tests/test_webhooks_guard.py hung until the
            # 900 s test timeout). asyncio.timeout lets the cancel through; every event wait in
            # the service is written this way.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def _claim(self, limit: int) -> list[JobRow]:
        if limit <= 0:
            return []

        full = [k for k in self.guard.slots.by_key() if self.guard.slots.key_full(k)]

        def claim(conn: sa.Connection) -> list[JobRow]:
            due = (jobs.c.webhook_status == "pending", jobs.c.webhook_next_at <= db_now(conn),
                   *not_owned_by(full))
            frm, order = fair_due(conn)
            return claim_rows(conn, due, order, limit,
                              lambda c: {"webhook_next_at": db_now(c) + self._lease_s}, frm)

        return await self.store.run(claim)

    async def _next_due(self) -> float | None:
        """Seconds until the next pending delivery is due (database clock), None if none."""
        def due(conn: sa.Connection) -> float | None:
            q = sa.select(sa.func.min(jobs.c.webhook_next_at) - db_now(conn)).where(
                jobs.c.webhook_status == "pending")
            value = conn.execute(q).scalar_one_or_none()
            return float(value) if value is not None else None

        return await self.store.run(due)

    async def _deliver(self, row: JobRow) -> None:
        attempt = (row.webhook_attempts or 0) + 1
        body = json.dumps(summary(row), separators=(",", ":")).encode()
        ts = int(time.time())
        headers = {
            "Content-Type": "application/json", EVENT_HEADER: f"job.{row.status}",
            DELIVERY_HEADER: row.id, ATTEMPT_HEADER: str(attempt), TIMESTAMP_HEADER: str(ts),
            SIGNATURE_HEADER: sign(key_secret(self.settings.secret.get_secret_value(), row.owner),
                                   ts, body),
            KEY_HEADER: row.owner or "",
        }
        error: str | None = None
        try:
            assert row.callback_url is not None
            answer = await self.guard.send(
                "POST", row.callback_url, content=body, headers=headers, key=row.owner,
                wait_s=SLOT_WAIT_S, deadline_s=self.settings.timeout_s,
                max_bytes=self.guard.settings.max_answer_bytes)
            if not 200 <= answer.status < 300:
                error = f"HTTP {answer.status}"
        except OutboundError as exc:
            if exc.category == "busy":  # no slot of the key's or the receiver's: not an attempt
                await self._record(row.id, {}, BUSY_RETRY_S)
                return
            error = exc.public  # never a port's state: app/net/outbound.py
            log.info("webhook attempt failed", extra={"job_id": row.id, "attempt": attempt,
                                                      "error": exc.category, "detail": exc.detail})
        values: dict[str, Any] = {"webhook_attempts": attempt, "webhook_last_error": error}
        retry_in: float | None = None
        if error is None:
            values.update(webhook_status="delivered", webhook_delivered_at=time.time(),
                          webhook_next_at=None)
            log.info("webhook delivered", extra={"job_id": row.id, "attempt": attempt})
        elif attempt >= self.settings.max_attempts:
            values.update(webhook_status="failed", webhook_next_at=None)
            log.warning("webhook gave up", extra={"job_id": row.id, "attempt": attempt,
                                                  "error": error})
        else:
            retry_in = min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (attempt - 1))
            log.info("webhook retry scheduled", extra={"job_id": row.id, "attempt": attempt,
                                                       "error": error, "retry_in_s": retry_in})
        await self._record(row.id, values, retry_in)

    async def _record(self, job_id: str, values: dict[str, Any], retry_in: float | None) -> None:
        """Write an attempt's outcome; ``retry_in``: the next attempt is due that much later
        (database clock)."""
        def write(conn: sa.Connection) -> None:
            v = dict(values)
            if retry_in is not None:
                v["webhook_next_at"] = db_now(conn) + retry_in
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**v))

        try:
            await self.store.run(write)
        except Exception:  # the lease expires and the attempt is made again: at-least-once
            log.exception("cannot record the webhook attempt for job %s", job_id)
        self._wake.set()  # the next due time may have moved earlier


def not_owned_by(owners: list[str | None]) -> tuple[sa.ColumnElement[bool], ...]:
    """Rows of none of ``owners`` (None: the keyless tenant)."""
    named = [o for o in owners if o is not None]
    out: list[sa.ColumnElement[bool]] = []
    if None in owners:
        out.append(jobs.c.owner.is_not(None))
    if named:
        out.append(sa.or_(jobs.c.owner.is_(None), jobs.c.owner.notin_(named)))
    return tuple(out)


def fair_due(conn: sa.Connection) -> tuple[sa.FromClause, sa.ColumnElement[Any]]:
    """Claim order of due deliveries: a delivery's rank among its key's due ones, so one key
    with a thousand pending deliveries delays another key's first by one turn at most."""
    q = jobs.alias("w")
    key = sa.func.coalesce(q.c.owner, sa.literal_column("''"))
    ranked = (sa.select(q.c.id.label("id"), sa.func.row_number().over(
        partition_by=key, order_by=(q.c.webhook_next_at, q.c.id)).label("rk"))
        .where(q.c.webhook_status == "pending", q.c.webhook_next_at <= db_now(conn))
        .subquery("due"))
    return jobs.join(ranked, ranked.c.id == jobs.c.id), ranked.c.rk
