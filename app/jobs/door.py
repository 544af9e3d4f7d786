"""The one door between HTTP and the core: everything a router asks of the service.

Routers (``app/api``) import this module (with the types that cross it: the job's view, an
event subscription, a transfer's hold), the plain data modules of the vocabulary
(``app.engine.languages``, ``app.speakers.limits``) and the API types (``app/results``):
nothing else of ``app/jobs``, and nothing of the pipeline behind it (an import-linter contract
in pyproject.toml keeps it so). It holds job and engine operations only: constants the routes
need live where they belong, not here. The shape is text-embeddings-inference's ``Infer`` and
vLLM's ``EngineClient``: one small interface, implemented by the core
(:class:`app.jobs.core.Core`), that a test can replace with a fake.

What crosses it are plain values, not the core's objects: an :class:`Upload` goes in (handed
over once: from the call on, the core owns its file whatever happens, and removes it when the
upload is refused or loses an idempotency race), a :class:`JobView` comes out (a job as its owner
may see it, with this replica's live progress), and a :class:`Subscription` to the job's feed
for whatever follows a job: every event stream and every wait (app/jobs/events.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.config import Settings
from app.jobs.events import EventFeed, Subscription
from app.jobs.transfers import Hold
from app.jobs.views import JobView
from app.metrics import Metrics
from app.windows import JobOptions

__all__ = ["Door", "EventFeed", "Health", "Hold", "JobView", "LiveCall", "LiveEnd", "Readiness",
           "ServiceStatus", "Subscription", "Upload", "Writer"]

# Copies the request's audio to the path the core gives, refusing more than the byte limit
# (PayloadTooLarge); returns the bytes written. Blocking: the core runs it on a worker thread.
Writer = Callable[[Path, int], int]


@dataclass(frozen=True)
class Upload:
    """A request's audio and what to do with it: :meth:`Door.submit`'s one argument."""

    options: JobOptions
    owner: str | None  # the API key's tenant; None when keys are off
    write: Writer | None = None  # the request's file; None: ``audio_url``
    filename: str | None = None  # the client's name for the file (display only)
    audio_url: str | None = None  # fetched by the service instead of a file
    callback_url: str | None = None  # webhooks: POSTed the job's summary when it ends
    idempotency_key: str | None = None  # the request's Idempotency-Key, parsed
    check: Callable[[float], None] | None = None  # may refuse the probed duration (raises)


@dataclass(frozen=True)
class LiveCall:
    """A live transcription socket, as the core sees it (:meth:`Door.live`): the transport's
    three moves and who is calling. The core accepts (with these response headers), reads and
    sends; the transport closes the socket afterwards with :attr:`LiveEnd.code`."""

    owner: str | None
    accept: Callable[[dict[str, str]], Awaitable[None]]
    receive: Callable[[], Awaitable[str | bytes | None]]  # None: the client has gone
    send: Callable[[dict[str, Any]], Awaitable[None]]  # one server event (a JSON object)
    callback_url: str | None = None  # webhooks: the kept transcript's job, when it ends
    session: dict[str, Any] | None = None  # the client secret's session (Door.live_session)


@dataclass(frozen=True)
class LiveEnd:
    reason: str  # disconnected, idle_timeout, session_expired, session_limit, ...
    job_id: str | None  # the job the transcript was kept as
    code: int  # the WebSocket close code


@dataclass(frozen=True)
class Health:
    """Liveness: ``ok``, ``engine_stalled`` (a call running past ``batcher.stall_after_s``) or
    ``engine_failing`` (the engines keep failing), with what the answer shows of it."""

    status: str = "ok"
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    model: str
    device: str
    compute_type: str
    engines: list[dict[str, Any]]
    sizing: dict[str, Any] | None


@dataclass(frozen=True)
class ServiceStatus:
    """GET /status's numbers (see app/api/health.py for what each means)."""

    ready: bool
    model: str
    device: str
    workers: int
    backlog_s: float
    pending_windows: int
    jobs: dict[str, int]
    span_s: float
    throughput: float | None
    rtf: float | None
    batch_size: float | None


class Door(Protocol):
    """What HTTP may ask of the core. Reads take the caller's tenant (``owner``): another
    tenant's job is not found, so ids never leak across API keys."""

    settings: Settings
    metrics: Metrics  # the HTTP middleware counts requests into it

    @property
    def ready(self) -> bool:
        """The model is loaded and warm, and the service is not draining."""
        ...

    @property
    def stopped(self) -> bool:
        """The drain has finished: nothing more ends in this process."""
        ...

    # ---- taking work ---------------------------------------------------------------------------
    def check_speakers(self) -> None:
        """400 when diarization is off here, 503 while its models cannot load."""
        ...

    def check_chunking(self, settings: dict[str, float] | None) -> None:
        """400 naming ``chunking_strategy`` when this service's VAD cannot cut uploads by a
        request's ``server_vad`` settings (the pyannote VAD has no such knobs)."""
        ...

    async def known_speakers(self, names: Sequence[str], clips: Sequence[bytes | str],
                             names_field: str, refs_field: str,
                             owner: str | None = None) -> list[dict[str, Any]]:
        """Named speakers' voices for a job's ``known_speakers`` option, from their names and
        reference clips (bytes, or OpenAI's data URLs; at most ``MAX_KNOWN``, in
        app/speakers/limits.py): 400 naming the field for a bad one (probed behind the
        allow-lists first), 429 when their audio does not fit ``owner``'s share (charged while
        they are decoded); loads the speaker models if nobody has asked for them yet."""
        ...

    async def gate(self, owner: str | None) -> None:
        """429 before an upload's body is read, when the backlog (or the key's share) is
        already full; may answer from a backlog reading up to half a second old."""
        ...

    async def submit(self, upload: Upload) -> str:
        """Spool (or fetch) the audio, probe it, admit it (429 past the backlog bounds) and
        commit its job: the new job's id, or the first job's made under the same
        Idempotency-Key."""
        ...

    def webhook_secret(self, owner: str | None) -> str | None:
        """The secret that signs this API key's webhook deliveries; None when webhooks are
        off."""
        ...

    async def transfer(self, owner: str | None) -> Hold:
        """One upload or download in flight for this key (429 past
        ``limits.max_transfers_per_key``, counted for the deployment); release the hold when
        its body is in."""
        ...

    async def replay(self, owner: str | None, key: str) -> JobView | None:
        """The caller's job made under Idempotency-Key ``key`` within the window, if any."""
        ...

    # ---- jobs ----------------------------------------------------------------------------------
    async def get(self, job_id: str, owner: str | None) -> JobView | None: ...

    async def jobs(self, owner: str | None, limit: int) -> list[JobView]:
        """The caller's newest jobs."""
        ...

    async def some(self, ids: list[str], owner: str | None) -> list[JobView]:
        """These of the caller's jobs that exist, in any order."""
        ...

    async def cancel(self, job_id: str, owner: str | None) -> JobView | None:
        """Cancel a queued or running job (idempotent): the job as it stands then."""
        ...

    def follow(self, job_id: str, owner: str | None, *, capped: bool = False) -> Subscription:
        """Follow the job: the one way every stream and every wait does (app/jobs/events.py).
        The subscription's ``wake`` is set whenever its ``feed`` has news (a change here, or a
        re-read every ``RECHECK_S`` for a job another replica runs); the feed is ``over`` once
        the job ended (``final``), is gone, or the service has drained (``closed``). Release
        it (or use it in a ``with``). ``capped``: an event stream the client opened for its own
        sake (GET /jobs/{id}/events), 429 past ``limits.max_event_streams_per_key``."""
        ...

    def finished_texts(self, job_id: str, start: int) -> list[str] | None:
        """Texts of windows ``start``, ``start + 1``, ... up to the first unfinished one; None
        when the job is not running here."""
        ...

    def finished_logprobs(self, job_id: str, start: int
                          ) -> list[tuple[str, list[dict[str, Any]]]] | None:
        """:meth:`finished_texts` with each window's token log-probabilities in OpenAI's shape
        (``include[]=logprobs``; app/results/logprobs.py)."""
        ...

    # ---- the service ---------------------------------------------------------------------------
    async def backlog_s(self, max_age_s: float = 0.0) -> float:
        """Accepted audio not yet transcribed (an answer up to ``max_age_s`` old may do)."""
        ...

    def speed(self) -> float:
        """Audio seconds transcribed per wall second now."""
        ...

    def model_name(self) -> str: ...

    def health(self) -> Health: ...

    def readiness(self) -> Readiness: ...

    async def status(self) -> ServiceStatus: ...

    async def metrics_text(self) -> bytes:
        """Prometheus' text exposition, its point-in-time gauges refreshed."""
        ...

    # ---- live transcription --------------------------------------------------------------------
    def live_session(self, session: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A client secret's ``session``, checked as a ``session.update``'s: (what the secret
        carries, for :attr:`LiveCall.session`; the session a socket opened with it starts as).
        400 naming the field, as OpenAI's API answers."""
        ...

    async def live(self, call: LiveCall) -> LiveEnd:
        """Accept a ``/v1/realtime`` socket and serve one transcription session on it until the
        client leaves or a limit ends it (app/jobs/live.py); its transcript is kept as a job."""
        ...
