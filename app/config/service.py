"""Settings of the service around the pipeline: job storage, request limits, keys, webhooks
and outbound fetches (``BATCHSCRIBE_STORAGE__...``, ``BATCHSCRIBE_LIMITS__...``,
``BATCHSCRIBE_SECURITY__...``, ``BATCHSCRIBE_WEBHOOKS__...``, ``BATCHSCRIBE_OUTBOUND__...``).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import CliSuppress, NoDecode

from app.config.stages import DEFAULT_HOME, STRICT


class StorageSettings(BaseModel):
    """Where jobs and uploads live."""

    model_config = STRICT

    database_url: str = Field(
        "", description="SQLAlchemy URL. Empty: SQLite (WAL) at <data_dir>/jobs.db."
    )
    data_dir: Path = Field(DEFAULT_HOME / "data", description="Spooled uploads and the SQLite file.")
    result_ttl_s: int = Field(
        7 * 24 * 3600, ge=60, le=365 * 24 * 3600,
        description="Finished jobs (and their results) are deleted after this long.",
    )
    max_active_jobs: int = Field(
        64, ge=1, le=10_000, description="Jobs decoded and queued in the batcher at once."
    )
    replica_id: str = Field(
        "", max_length=128,
        description="This process's name on the jobs it holds. Empty: <hostname>-<pid>, unique "
        "among live processes and stable across a container restart in the same pod (pid 1).",
    )
    max_attempts: int = Field(
        3, ge=1, le=100,
        description="A job is claimed at most this many times: one whose runs keep dying with "
        "the process (a crash, a stalled engine) then fails instead of taking every restart "
        "down with it. A graceful drain gives the attempt back, unless the job was inside an "
        "engine call that outlived the grace.",
    )
    lease_s: float = Field(
        30.0, ge=1, le=3600,
        description="A replica that stops heartbeating (every lease_s/6) loses its running jobs "
        "to the others after this long (PostgreSQL; SQLite has one process and requeues at start).",
    )
    blob_url: str = Field(
        "",
        description="Where uploads live so any replica can read them. Empty: <data_dir>/uploads "
        "(a shared volume with several replicas); a path: that folder; s3://bucket/prefix: "
        "S3-compatible storage (needs boto3; credentials from the usual AWS_* variables).",
    )
    s3_endpoint_url: str = Field(
        "", description="S3-compatible endpoint (MinIO, Ceph, R2...). Empty: AWS."
    )
    idempotency_window_s: float = Field(
        24 * 3600.0, ge=60, le=30 * 24 * 3600,
        description="A POST with an Idempotency-Key the same caller used this recently answers "
        "with that first job instead of making a new one (also bounded by result_ttl_s: the key "
        "goes with its job's row). 24 h, as Stripe and the IETF draft suggest: long enough for "
        "any client retry or a resumed `batchscribe dataset` run.",
    )

    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"


class LimitSettings(BaseModel):
    """Input limits. Each violation is a 4xx that names the limit."""

    model_config = STRICT

    max_upload_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="Largest upload.")
    max_audio_s: float = Field(4 * 3600.0, gt=0, description="Longest audio accepted.")
    max_backlog_s: float = Field(
        6 * 3600.0, gt=0, description="Queued audio beyond this gets 429 with Retry-After."
    )
    sync_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="?wait=true gives up after this (the job continues)."
    )
    openai_wait_s: float = Field(
        540.0, gt=0, le=590,
        description="/v1 answers within this (or sync_timeout_s if shorter): under the OpenAI "
        "SDK's default 600 s time-out, after which the SDK uploads the file again. Audio the "
        "service cannot transcribe in this time at its current speed is refused up front (413, "
        "naming the async route); a job still running at the deadline is cancelled.",
    )
    max_queued_s_per_key: float = Field(
        3 * 3600.0, gt=0,
        description="Queued + running audio one API key may hold (429 with Retry-After past it), "
        "so one key cannot fill the whole backlog and push every other key into 429s. Each job "
        "counts at least one padded window (see min_job_s). Only with API keys: without them "
        "every caller is one tenant and max_backlog_s alone applies.",
    )
    max_queued_jobs_per_key: int = Field(
        1000, ge=1, le=1_000_000,
        description="Queued + running jobs one API key may hold (429; only with API keys)."
    )
    max_transfers_per_key: int = Field(
        16, ge=1, le=100_000,
        description="Uploads being received and audio_url downloads running at once per API key "
        "(without keys, for all callers together): past it, 429 before a body byte is read. "
        "Each also counts as a job of at least min_job_s in the key's share, so a key cannot "
        "hold every connection or outbound slot with transfers that trickle.",
    )
    max_event_streams_per_key: int = Field(
        16, ge=1, le=10_000,
        description="Open GET /jobs/{id}/events streams per API key (429 past it; without keys, "
        "for all callers together). Streams of one job share one reader of the store, whatever "
        "their number.",
    )


class SecuritySettings(BaseModel):
    """Optional API keys. Empty ``api_key_sha256``: no keys, every caller is the same tenant."""

    model_config = STRICT

    # NoDecode: the env value is a plain comma-separated list, not JSON (JSON is accepted too).
    api_key_sha256: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="SHA-256 hex digests of the accepted API keys (comma-separated in the env). "
        "Keys themselves are never configured: `printf %s KEY | sha256sum`.",
    )
    open_health: bool = Field(default=True, description="/healthz and /readyz answer without a key.")
    open_metrics: bool = Field(default=True, description="/metrics answers without a key.")
    allow_anonymous: bool = Field(
        default=False,
        description="Without API keys the service refuses to start on a non-loopback address "
        "(anyone who can reach it would read and cancel every job). true: serve everyone "
        "anyway, on purpose (e.g. behind an authenticating proxy).",
    )
    trusted_hosts: list[str] = Field(
        default_factory=list, max_length=1000,
        description="Without API keys, only requests whose Host header names a loopback address "
        "(localhost, 127.0.0.1, [::1]) are served, so a web page cannot read the API through DNS "
        "rebinding. Extra Host names to accept (JSON list; '*.example.com' for subdomains, '*' "
        "for any). Not used when keys are configured: a page cannot send the key.",
    )

    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, max_length=1000,
        description="Web origins (scheme://host[:port], comma-separated or a JSON list) whose "
        "pages may send state-changing requests (POST, DELETE, the realtime socket) to this "
        "service, e.g. a front end on another port. Every other cross-site request a browser "
        "marks (Origin, Sec-Fetch-Site) is refused with 403; clients that send no Origin (curl, "
        "the SDKs) and the service's own page are served.",
    )

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = json.loads(v) if v.strip().startswith("[") else v.split(",")
        if isinstance(v, list):
            v = [str(o).strip().lower().rstrip("/") for o in v if str(o).strip()]
        return v

    @field_validator("api_key_sha256", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = json.loads(v) if v.strip().startswith("[") else v.split(",")
        if isinstance(v, list):
            v = [str(h).strip().lower() for h in v if str(h).strip()]
            bad = [h for h in v if len(h) != 64 or any(c not in "0123456789abcdef" for c in h)]
            if bad:
                raise ValueError("api_key_sha256 entries must be 64-character hex SHA-256 digests")
        return v


class WebhookSettings(BaseModel):
    """Job webhooks (``callback_url``). Off unless a secret is set: every delivery is signed."""

    model_config = STRICT

    secret: CliSuppress[SecretStr] = Field(  # a variable only: a flag would show in ps
        default=SecretStr(""),
        description="HMAC-SHA256 key for X-Batchscribe-Signature. Empty: webhooks are off and a "
        "callback_url is refused.",
    )
    max_attempts: int = Field(default=8, ge=1, le=100, description="Attempts per delivery.")
    backoff_s: float = Field(
        default=2.0, gt=0, le=3600, description="Wait before the 2nd attempt; doubles after each."
    )
    max_backoff_s: float = Field(default=3600.0, gt=0, description="Cap on the wait between attempts.")
    timeout_s: float = Field(
        default=10.0, gt=0, le=300,
        description="Total deadline of one attempt: resolve, connect, send, read the status line "
        "(a receiver that trickles its answer cannot hold an attempt longer).",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, max_length=1000,
        description="Deprecated: use outbound.allowed_hosts (same syntax). Entries here are "
        "added to it.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.secret.get_secret_value())


class OutboundSettings(BaseModel):
    """Every request the service makes because a client named a URL (webhooks, audio_url).

    Addresses are resolved and checked when the connection is made (DNS rebinding cannot slip
    past a check made earlier), and the service connects to the address it checked.
    """

    model_config = STRICT

    allowed_hosts: list[str] = Field(
        default_factory=list, max_length=1000,
        description="JSON list. Empty: any host whose addresses are all public. Else only these: "
        "exact names, '.example.com' for a domain and its subdomains, IP addresses or CIDR "
        "networks. A listed host may resolve to private addresses (the operator named it); "
        "cloud metadata addresses stay refused unless listed as addresses.",
    )
    allow_private: bool = Field(
        default=False,
        description="Allow loopback, private, link-local, CGNAT, ULA and IPv4-mapped addresses "
        "for any host (a trusted network only). Metadata addresses stay refused.",
    )
    max_in_flight: int = Field(
        default=64, ge=1, le=10_000, description="Outbound requests at once, in all."
    )
    max_per_host: int = Field(
        default=8, ge=1, le=10_000,
        description="Outbound requests at once to one host; more wait (webhooks) or get 429 "
        "(audio_url), so one slow receiver cannot take every slot.",
    )
    max_per_key: int = Field(
        default=16, ge=1, le=10_000,
        description="Outbound requests (downloads and webhook deliveries) one API key may have in "
        "flight at once on this replica; more wait for one of its own to end. Issue 51: one "
        "key's 16 trickling downloads held every slot another key's audio_url needed.",
    )
    max_per_host_per_key: int = Field(
        default=4, ge=1, le=10_000,
        description="Of one destination's max_per_host slots, what one API key may hold, so a "
        "key's stalled downloads leave room at a destination (an address) others use too.",
    )
    min_fetch_rate_bytes_s: int = Field(
        default=32 * 1024, ge=0, le=1 << 30,
        description="An audio_url download whose average rate since its answer's headers falls "
        "under this (bytes per second, judged from fetch_rate_grace_s on) is cut off and its job "
        "fails naming the rule: a server sending a byte a second defeats any connect or header "
        "time-out and would hold its slot for the whole fetch_timeout_s. 0: no rate rule.",
    )
    fetch_rate_grace_s: float = Field(
        default=10.0, gt=0, le=600,
        description="How long after its headers an audio_url download is judged by "
        "min_fetch_rate_bytes_s (a burst already received buys time at that rate).",
    )
    answer_timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="An audio_url's server must send its answer's headers within this; "
        "counted as unreachable otherwise (what a silent port looks like too).",
    )
    max_answer_bytes: int = Field(
        default=4096, ge=0, le=1024 * 1024,
        description="Of a webhook receiver's answer body, at most this much is read.",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, le=120, description="Resolve + connect.")
    fetch_timeout_s: float = Field(
        default=300.0, gt=0, le=3600,
        description="Total deadline of one audio_url download (the size limit applies while it "
        "streams: limits.max_upload_bytes).",
    )
    s3_buckets: list[str] = Field(
        default_factory=list, max_length=1000,
        description="Buckets an s3:// audio_url may name ('bucket' or 'bucket/prefix'), read with "
        "the blob store's credentials. Empty: s3:// URLs are refused. The blob store's own "
        "prefix is never readable this way.",
    )


class LiveSettings(BaseModel):
    """Live transcription (``/v1/realtime``): how many sessions, and each session's bounds and
    pacing. A session holds at most one turn of audio (<= 30 s with server VAD,
    ``max_buffer_s`` in manual mode) and ``max_pending_finals`` turns decoding: a client faster
    than real time is slowed to the engine's pace (the socket is no longer read), not buffered."""

    model_config = STRICT

    max_sessions: int = Field(32, ge=0, description="Open sessions on this replica (0: live off).")
    max_sessions_per_key: int = Field(16, ge=1, description="Open sessions per API key (without "
                                      "keys, every session is the one anonymous key's).")
    max_event_bytes: int = Field(15 * 1024 * 1024, ge=1024,
                                 description="Largest client message (OpenAI's append bound).")
    max_buffer_s: float = Field(120.0, gt=0, description="Manual mode: uncommitted audio kept.")
    max_turn_s: float = Field(29.5, gt=1, le=30.0,
                              description="Server VAD: a longer turn is cut (one Whisper window).")
    idle_timeout_s: float = Field(60.0, gt=0, description="No client message for this long: closed.")
    max_session_s: float = Field(3600.0, gt=0, description="Longest session.")
    interim_interval_ms: int = Field(
        1000, ge=0, description="Re-decode an open turn after this much more audio (0: never).")
    interim_pad_margin_s: float = Field(
        3.0, ge=2.0, le=30.0,
        description="Dynamic time axis: silence padded after an interim decode's audio (finals: "
        "final_pad_margin_s). The encoder costs its padded length, and at 16 streams "
        "interim encodes took a quarter of the engine's time; the final supersedes what an "
        "interim reads.")
    final_pad_margin_s: float | None = Field(
        3.0, ge=2.0, le=30.0,
        description="Dynamic time axis: silence padded after a turn's final decode (None: the "
        "model's pad_margin_s, 8 s). At 16 streams final encodes were the engine's largest live "
        "cost (25 of 97 worker-seconds beside a long upload, 0.24 s each at 8 s); at 3 s the "
        "turn p95 beside the upload read 1.78-1.96 s in three runs (1.61-2.74 s at 8 s), the "
        "same alone, and WER the same within a word or two a run (loadtest/README.md "
        "at commit eadc09f).")
    early_final_ms: int = Field(
        100, ge=0, le=10_000,
        description="Server VAD: a turn's final decode starts once its speech has been quiet "
        "this long, while the VAD still waits out silence_duration_ms; if speech comes back "
        "the early decode's text serves as the turn's next interim (0: start at the end of "
        "the turn). The engine's time then overlaps the silence the VAD waits for: 400 ms off "
        "every turn at OpenAI's 500 ms. A pause that long inside speech starts a decode that "
        "comes to nothing, so shorter costs engine time: at 16 streams of 5-15 s read-speech "
        "turns beside a 20-minute upload (3 runs of 112 turns each, pooled), turn p95 read "
        "1.53 s at 50 ms, 1.34-1.38 s at 100, 1.60 s at 200 and 1.70 s at 300, WER the same "
        "(loadtest/README.md, live).")
    context_gap_ms: int = Field(
        0, ge=0, le=10_000,
        description="A turn's final decode reads the turn before it too and continues its text "
        "(Whisper's decoder prefix) when that turn ended at most this long before this one's "
        "audio begins; 0: when they touch (with server VAD: a pause shorter than "
        "silence_duration_ms + prefix_padding_ms, 0.8 s at OpenAI's defaults). Such a pause "
        "still ends the turn, so a sentence said with pauses arrives in pieces, and a piece read "
        "alone loses its words' context. At 8 / 16 streams: WER of the utterances cut into "
        "pieces 60.0 -> 52.0 % / 32.2 -> 28.8 %, the rest the same; at 1000 ms, turns of "
        "different sentences joined too, and WER came out mixed (loadtest/README.md "
        "at commit eadc09f).")
    context_max_s: float = Field(
        8.0, ge=0.0, le=28.0,
        description="The most audio such a final reads, the turn before included (0: never "
        "read a turn with the one before): the encoder costs its length. At 16 streams beside "
        "a long upload, turn p95 1.21-1.30 s at 8 s, 1.30-1.53 s at 15 s, 1.18-1.35 s off; "
        "WER the same at 8 and 15 s.")
    max_pending_finals: int = Field(
        4, ge=1, description="Turns decoding at once per session; appends wait beyond (a client "
        "faster than real time is slowed to the engine's pace, not buffered).")
    max_outbox_bytes: int = Field(
        1024 * 1024, ge=64 * 1024, le=1 << 30,
        description="Events (as JSON) queued for a client that does not read them; past this "
        "the session is closed with 1008. Issue 51: unbounded, 30 events echoing a 1 MB "
        "event_id left ~57 MB in the service for the session's hour.")
    max_speed: float = Field(
        4.0, ge=1.0, le=1000.0,
        description="Times real time a session may send audio once its burst_s is spent; "
        "faster appends wait (the socket is not read meanwhile). Silence sent at network "
        "speed kept the two shared live threads running Silero for every session.")
    burst_s: float = Field(
        30.0, gt=0, le=3600.0,
        description="Audio seconds a session may send ahead of max_speed at once (a client "
        "catching up after a stall, a file streamed in).")
    model: str = Field("whisper-base", description="The model name sessions report.")
    session_ttl_s: int = Field(3600, ge=1, description="expires_at of the session object.")
    per_message_deflate: bool = Field(
        False, description="Accept a client's permessage-deflate offer (RFC 7692) on the "
        "WebSocket. Off: base64 audio barely compresses, and inflating every append cost the "
        "event loop ~12 % of its time (48 sessions on 2 cores: 9.1 against 10.3 CPU-s, three "
        "runs each); the loop is what bounds the sessions one process carries.")
    keep_as_job: bool = Field(True, description="Keep each session's transcript as a job "
                              "(GET /jobs/{id}, formats, webhook) once it closes.")
    client_secret_ttl_s: int = Field(600, ge=10, le=7200,
                                     description="Default lifetime of a /v1/realtime/client_secrets token.")
    client_secret_key: CliSuppress[SecretStr | None] = Field(  # a variable only (ps)
        None, description="HMAC key that signs client secrets; replicas behind one balancer need "
        "the same one. Unset: a random key per process (a token works on the replica that made it).")
