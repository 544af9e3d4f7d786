"""Signed job webhooks: when a job with a ``callback_url`` ends done or failed, POST its summary.

Durability: the job store marks the delivery ``pending`` in the same UPDATE that finishes the
job (:meth:`app.jobs.store.JobStore.finish`), so no crash can lose one. The dispatcher claims due
deliveries under a short lease (``webhook_next_at`` pushed forward), so replicas sharing a
database never send the same attempt twice, and deliveries pending at a restart resume.
The loop is event-driven: woken by a finished job, or sleeping until the next retry is due.

Signing (Stripe's scheme): ``X-Batchscribe-Signature: sha256=HEX(HMAC_SHA256(secret,
"{timestamp}.{body}"))`` with ``X-Batchscribe-Timestamp``; receivers reject old timestamps
(replay) and compare in constant time (:func:`verify`). Semantics are at-least-once: a
receiver that answered 2xx but whose answer was lost gets the same ``X-Batchscribe-Delivery``
again, and should deduplicate on it.
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
from urllib.parse import urlsplit

import httpx
import sqlalchemy as sa

from app.config import WebhookSettings
from app.errors import BadRequest
from app.jobs.store import JobRow, JobStore, claim_rows, jobs

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Batchscribe-Signature"
TIMESTAMP_HEADER = "X-Batchscribe-Timestamp"
DELIVERY_HEADER = "X-Batchscribe-Delivery"
EVENT_HEADER = "X-Batchscribe-Event"
ATTEMPT_HEADER = "X-Batchscribe-Attempt"
TOLERANCE_S = 300  # receivers: refuse signatures older (or newer) than this
CLAIM_BATCH = 16
MAX_IDLE_S = 60.0  # also catches deliveries another replica released or left behind


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


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


def check_callback_url(settings: WebhookSettings, url: str | None) -> str | None:
    """Validate a request's callback_url; a 400 names the field (before any upload is spooled)."""
    url = (url or "").strip() or None
    if url is None:
        return None
    if not settings.enabled:
        raise BadRequest("webhooks are off on this service (no webhooks secret configured)",
                         field="callback_url")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise BadRequest(f"callback_url is not a URL: {exc}", field="callback_url") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest("callback_url must be an absolute http(s) URL", field="callback_url")
    if settings.allowed_hosts and not host_allowed(parts.hostname, settings.allowed_hosts):
        raise BadRequest(f"callback_url host {parts.hostname!r} is not allowed on this service",
                         field="callback_url")
    return url


def host_allowed(host: str, allowed: list[str]) -> bool:
    """``host`` is listed, or falls under a listed '.domain' (names compared case-insensitively)."""
    host = host.lower().rstrip(".")
    for entry in (a.strip().lower().rstrip(".") for a in allowed):
        if entry.startswith("."):
            if host == entry[1:] or host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False


def summary(row: JobRow) -> dict[str, Any]:
    """The POSTed body: the job's outcome, not its transcript (fetch result_url for that)."""
    result = row.result or {}
    return {
        "event": f"job.{row.status}", "id": row.id, "status": row.status,
        "filename": row.filename, "created_at": row.created_at, "finished_at": row.finished_at,
        "audio_seconds": row.audio_seconds, "language": result.get("language"),
        "status_url": f"/jobs/{row.id}", "result_url": f"/jobs/{row.id}/result",
        "error": row.error,
    }


class WebhookDispatcher:
    def __init__(self, settings: WebhookSettings, store: JobStore,
                 client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.store = store
        self._client = client or httpx.AsyncClient(
            timeout=settings.timeout_s, follow_redirects=False,
            headers={"User-Agent": "batchscribe-webhooks/1"},
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        # A claimed attempt is not claimed again before it must have ended (timeout + slack).
        self._lease_s = settings.timeout_s + 30.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="webhooks")

    def wake(self, *_: object) -> None:
        """Called when a job ends (JobRunner.on_end): its delivery is due now."""
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
        await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            timeout = MAX_IDLE_S
            try:
                for row in await self._claim(time.time()):
                    task = asyncio.create_task(self._deliver(row), name=f"webhook-{row.id}")
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                due = await self._next_due()
                if due is not None:
                    timeout = min(MAX_IDLE_S, max(0.0, due - time.time()))
            except Exception:
                log.exception("webhook dispatch pass failed; retrying")
                timeout = 5.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _claim(self, now: float) -> list[JobRow]:
        due = (jobs.c.webhook_status == "pending", jobs.c.webhook_next_at <= now)

        def claim(conn: sa.Connection) -> list[JobRow]:
            return claim_rows(conn, due, jobs.c.webhook_next_at, CLAIM_BATCH,
                              lambda: {"webhook_next_at": now + self._lease_s})

        return await self.store.run(claim)

    async def _next_due(self) -> float | None:
        q = sa.select(sa.func.min(jobs.c.webhook_next_at)).where(jobs.c.webhook_status == "pending")
        value = await self.store.run(lambda c: c.execute(q).scalar_one_or_none())
        return float(value) if value is not None else None

    async def _deliver(self, row: JobRow) -> None:
        attempt = (row.webhook_attempts or 0) + 1
        body = json.dumps(summary(row), separators=(",", ":")).encode()
        ts = int(time.time())
        headers = {
            "Content-Type": "application/json", EVENT_HEADER: f"job.{row.status}",
            DELIVERY_HEADER: row.id, ATTEMPT_HEADER: str(attempt), TIMESTAMP_HEADER: str(ts),
            SIGNATURE_HEADER: sign(self.settings.secret.get_secret_value(), ts, body),
        }
        error: str | None = None
        try:
            assert row.callback_url is not None
            resp = await self._client.post(row.callback_url, content=body, headers=headers)
            if not 200 <= resp.status_code < 300:
                error = f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a URL httpx cannot use
            error = f"{type(exc).__name__}: {exc}"[:500]
        now = time.time()
        values: dict[str, Any] = {"webhook_attempts": attempt, "webhook_last_error": error}
        if error is None:
            values.update(webhook_status="delivered", webhook_delivered_at=now, webhook_next_at=None)
            log.info("webhook delivered", extra={"job_id": row.id, "attempt": attempt})
        elif attempt >= self.settings.max_attempts:
            values.update(webhook_status="failed", webhook_next_at=None)
            log.warning("webhook gave up", extra={"job_id": row.id, "attempt": attempt,
                                                  "error": error})
        else:
            wait = min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (attempt - 1))
            values["webhook_next_at"] = now + wait
            log.info("webhook retry scheduled", extra={"job_id": row.id, "attempt": attempt,
                                                       "error": error, "retry_in_s": wait})
        try:
            await self.store.update(row.id, **values)
        except Exception:  # the lease expires and the attempt is made again: at-least-once
            log.exception("cannot record the webhook attempt for job %s", row.id)
        self._wake.set()  # the next due time may have moved earlier
