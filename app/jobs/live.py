"""Live sessions behind the door: admission (per key and in total), the session itself
(:class:`app.live.session.LiveSession` on the shared batcher and Silero), its metrics, and its
transcript kept as a job once it closes.

The transport (``app/api/realtime``) hands over a :class:`app.jobs.door.LiveCall`: how to
accept the socket, read a message and send an event. Everything after that is here, so the API
module only moves bytes.

* **Admission.** ``live.max_sessions`` on this replica and ``live.max_sessions_per_key`` per
  tenant (for the deployment: on replicas sharing PostgreSQL each session is a leased hold,
  app/jobs/holds.py): past either, the socket is accepted, gets one ``error`` event
  (``session_limit``) and is closed: a WebSocket client sees why, where a refused handshake
  shows only "403". The slot
  is taken before the first ``await`` and given back however the handshake ends: issue 51 sent
  six handshakes at once with a limit of 1 and four sessions opened (the count was checked,
  the ``callback_url`` lookup awaited, then the count raised).
* **The key's share.** A session's audio not yet transcribed (its open turn, its finals
  decoding) counts in its key's ``limits.max_queued_s_per_key`` like queued uploads
  (:meth:`LiveHall.pending_s`, read by app/jobs/admission.py), and an append past the share
  is answered with an error event instead of taken: live finals go before every upload, and
  uncounted, 4 commits x 16 sessions of one key could queue ~26 h of audio.
* **Audio work** (base64, G.711, resampling, Silero) runs on this module's own two threads, not
  the prep pool: the prep pool runs an upload's 60 s chunks (decode + VAD, about a second each
  on this CPU) in rank order, and a 100 ms append must not wait behind one.
* **Decodes** ride the shared batcher (:func:`app.live.decoding.batcher_decoder`), counted for
  ``live_interim_decodes_total`` on the way.
* **Kept as a job**: with ``live.keep_as_job`` the job id is fixed before the handshake
  (the ``x-batchscribe-job`` response header) and the row is written, finished, when the
  session ends however it ends (client gone, limit, drain): every committed turn's final is
  awaited first (the session's wind-down), so nothing said is lost to a disconnect. Its end is
  told where every job's is (the event hub, app/jobs/events.py): counted in ``jobs_finished``,
  its followers woken, its webhook sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from app.audio.vad import Vad
from app.batching.batcher import Batcher
from app.config import Settings
from app.errors import ServiceError
from app.jobs.admission import Admission
from app.jobs.door import LiveCall, LiveEnd
from app.jobs.holds import SharedHolds, make_holds
from app.jobs.intake import new_job_id
from app.jobs.store import JobStore
from app.jobs.webhooks import check_callback_url
from app.live.decoding import Decode, batcher_decoder
from app.live.events import ErrorEvent
from app.live.offload import Offload
from app.live.protocol import ProtocolError
from app.live.session import LiveSession, serve
from app.live.turns import LiveItem, VadModel
from app.metrics import Metrics
from app.net.outbound import OutboundGuard
from app.windows import JobOptions

log = logging.getLogger(__name__)
KIND = "live"  # a live session's hold (app/jobs/holds.py)
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_LATER = 1000, 1008, 1013


class LiveHall:
    """The open sessions of this replica, and what opens and keeps them."""

    def __init__(self, settings: Settings, metrics: Metrics, store: JobStore, batcher: Batcher,
                 vad: Vad, outbound: OutboundGuard, ended: Callable[[str, str], None],
                 admission: Admission | None = None) -> None:
        self.settings = settings
        self._admission: Admission | None = None
        self._sessions: dict[str | None, set[LiveSession]] = {}
        if admission is not None:
            self.share(admission)
        self._metrics, self._store, self._batcher = metrics, store, batcher
        self._vad: VadModel | None = vad if hasattr(vad, "probability_stream") else None  # type: ignore[assignment]
        self._outbound = outbound
        self._ended = ended  # the event hub's end: counted, its followers, its webhook
        self._executor = Offload()  # every session's audio work (app/live/offload.py)
        self._open: Counter[str | None] = Counter()  # this replica's sessions per key
        # Per key across replicas sharing PostgreSQL (app/jobs/holds.py); SQLite: _open alone.
        self._holds = make_holds(store, settings.storage.replica(), settings.storage.lease_s)

    @property
    def open_sessions(self) -> int:
        return sum(self._open.values())

    def close(self) -> None:
        self._executor.close()

    async def serve(self, call: LiveCall) -> LiveEnd:
        """Accept the socket and run one session on it to its end."""
        live = self.settings.live
        job_id = new_job_id() if live.keep_as_job else None
        refusal = self._refusal(call.owner)
        hold: str | None = None
        if refusal is None:  # reserved before any await; given back however this ends
            self._open[call.owner] += 1
            self._metrics.live_sessions.inc()
        try:
            if refusal is None and isinstance(self._holds, SharedHolds):  # the deployment's count
                try:
                    hold = await self._holds.take(KIND, call.owner, live.max_sessions_per_key)
                    refusal = self._key_refusal() if hold is None else None
                except ServiceError:  # the store is away for a moment
                    refusal = ("store", "The service's job store is unavailable for a moment; "
                               "try again shortly.")
                if refusal is not None:
                    self._release(call.owner)
            await call.accept({"x-batchscribe-job": job_id} if job_id else {})
            if refusal is not None:
                self._metrics.live_refused.labels(refusal[0]).inc()
                await call.send(ErrorEvent.of(ProtocolError(
                    refusal[1], code="session_limit", type="invalid_request_error")).as_dict())
                return LiveEnd("session_limit", None, CLOSE_TRY_LATER)
            try:
                callback = await self._callback(call.callback_url)
            except Exception as exc:  # a refused callback_url: say why, open nothing
                message = exc.message if isinstance(exc, ServiceError) else "callback_url refused"
                await call.send(ErrorEvent.of(ProtocolError(message, code="invalid_value",
                                                            param="callback_url")).as_dict())
                return LiveEnd("invalid_callback_url", None, CLOSE_POLICY)
            return await self._run(call, job_id, callback)
        finally:
            if hold is not None:
                self._holds.give_back(hold)
            if refusal is None:
                self._release(call.owner)

    def _release(self, owner: str | None) -> None:
        self._open[owner] -= 1
        if not self._open[owner]:
            del self._open[owner]
        self._metrics.live_sessions.dec()

    async def _run(self, call: LiveCall, job_id: str | None, callback: str | None) -> LiveEnd:
        started = time.time()
        session = LiveSession(self._decoder(call.owner), self._vad, self.settings.live,
                              self._executor, initial=call.session,
                              admit=functools.partial(self._admit, call.owner))
        mine = self._sessions.setdefault(call.owner, set())
        mine.add(session)
        try:
            arrived = [0.0]  # when the client's latest message came in
            reason = await serve(session, timed_receive(call, arrived),
                                 self._timed_send(call, arrived))
        finally:
            mine.discard(session)
            if not mine:
                self._sessions.pop(call.owner, None)
            if job_id is not None:  # shielded: a cancelled handler still keeps what was said
                await asyncio.shield(self._keep(job_id, call.owner, callback, session, started))
        code = CLOSE_NORMAL if reason == "disconnected" else CLOSE_POLICY
        return LiveEnd(reason, job_id, code)

    def share(self, admission: Admission) -> None:
        """Count this hall's untranscribed live audio in its keys' shares (and ask the shares
        before each append): the core's admission, built after the hall."""
        self._admission = admission
        admission.live_s = self.pending_s

    def pending_s(self, owner: str | None) -> float:
        """Audio of ``owner``'s sessions here not transcribed yet (their key's share counts it)."""
        return sum(s.pending_s() for s in self._sessions.get(owner, ()))

    async def _admit(self, owner: str | None, seconds: float) -> str | None:
        if self._admission is None:
            return None
        return await self._admission.live_room(owner, seconds)

    # ---- admission ------------------------------------------------------------------------------
    def _refusal(self, owner: str | None) -> tuple[str, str] | None:
        live = self.settings.live
        if self.open_sessions >= live.max_sessions:
            return ("total", f"This service has {live.max_sessions} live sessions open, its "
                    "maximum; try again later.")
        if self._open[owner] >= live.max_sessions_per_key:
            return self._key_refusal()
        return None

    def _key_refusal(self) -> tuple[str, str]:
        n = self.settings.live.max_sessions_per_key
        return ("key", f"This API key has {n} live sessions open, its maximum; close one first.")

    async def _callback(self, url: str | None) -> str | None:
        return await check_callback_url(self.settings.webhooks, self._outbound, url)

    # ---- decodes and timing ---------------------------------------------------------------------
    def _decoder(self, owner: str | None) -> Decode:
        interim = self._metrics.live_interim
        return batcher_decoder(self._batcher, new_job_id()[:12], owner,
                               interim_pad_margin_s=self.settings.live.interim_pad_margin_s,
                               final_pad_margin_s=self.settings.live.final_pad_margin_s,
                               on_interim=lambda outcome: interim.labels(outcome).inc())

    def _timed_send(self, call: LiveCall, arrived: list[float]
                    ) -> Callable[[dict[str, Any]], Awaitable[None]]:
        """The session's events out; turn latency and stream lag read off them as they pass."""
        ended: dict[str, tuple[float, float]] = {}  # item id -> (end of turn, its message's arrival)
        m = self._metrics

        async def send(event: dict[str, Any]) -> None:
            kind = event.get("type")
            if kind == "input_audio_buffer.committed":
                ended[event["item_id"]] = (time.monotonic(), arrived[0] or time.monotonic())
            elif kind in ("conversation.item.input_audio_transcription.completed",
                          "conversation.item.input_audio_transcription.failed"):
                at = ended.pop(event.get("item_id", ""), None)
                if at is not None and kind.endswith("completed"):
                    now = time.monotonic()
                    m.live_turn_latency.observe(now - at[0])
                    m.live_lag.observe(now - at[1])
            await call.send(event)

        return send

    # ---- the transcript as a job ----------------------------------------------------------------
    async def _keep(self, job_id: str, owner: str | None, callback: str | None,
                    session: LiveSession, started: float) -> None:
        try:
            tr = session.config.transcription
            result = live_result(session.items, tr.language if tr is not None else None)
            now = time.time()
            ttl = self.settings.storage.result_ttl_s
            hook = {"webhook_status": "pending", "webhook_next_at": now} if callback else {}
            await self._store.insert(
                id=job_id, owner=owner, status="done", created_at=started, started_at=started,
                finished_at=now, expires_at=now + ttl, filename=f"live {session.id}",
                upload_path=f"{job_id}.live",  # no upload: deleting it is a no-op
                options=JobOptions(language=result["language"]).to_dict(),
                audio_seconds=result["duration"], windows_total=len(session.items),
                windows_done=len(session.items), attempts=1, queue_wait_s=0.0,
                processing_s=now - started, result=result, callback_url=callback, **hook)
            self._ended(job_id, "done")
        except Exception:  # the session is over either way; say so in the log
            log.exception("live session %s: its transcript could not be kept as job %s",
                          session.id, job_id)


def timed_receive(call: LiveCall, arrived: list[float]) -> Callable[[], Awaitable[str | bytes | None]]:
    """The client's messages, each one's arrival kept in ``arrived[0]`` (the stream-lag metric)."""

    async def receive() -> str | bytes | None:
        msg = await call.receive()
        arrived[0] = time.monotonic()
        return msg

    return receive


def live_result(items: list[LiveItem], language: str | None) -> dict[str, Any]:
    """A session's turns as a job result: one segment per committed turn, on the session's
    audio clock (what the formats render: srt, vtt, tsv, text)."""
    segments: list[dict[str, Any]] = [{"id": k, "start": it.start_ms / 1000, "end": it.end_ms / 1000,
                 "text": (it.transcript or "").strip(), "language": language,
                 "avg_logprob": None, "no_speech_prob": None, "compression_ratio": None,
                 "temperature": 0.0, "seek": round(it.start_ms / 10), "tokens": [],
                 **({"error": it.error} if it.error else {})}
                for k, it in enumerate(items)]
    return {"text": " ".join(s["text"] for s in segments if s["text"]), "language": language,
            "language_probability": None,
            "duration": items[-1].end_ms / 1000 if items else 0.0,
            "segments": segments, "words": None}
