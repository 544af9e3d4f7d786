"""Service settings: one pydantic-settings tree, read from the environment.

Every field is bounded and documented, so a typo in a deployment fails at start-up with a clear
message instead of surfacing as odd behaviour under load. Nested groups map to environment
variables with a double underscore, e.g. ``BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE=16``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    compute_type: str = Field("auto", description="auto: float16 on GPU, int8 on CPU.")
    cpu_threads: int = Field(1, ge=1, le=256, description="CTranslate2 threads per worker.")
    num_workers: int = Field(
        0, ge=0, le=16,
        description="Batches run concurrently (CTranslate2 workers). 0: 1 on GPU, one per core "
        "on CPU (two 1-thread workers beat one 2-thread worker on 2 cores).",
    )
    vad: Literal["auto", "silero", "pyannote"] = Field(
        "auto", description="auto: Silero (ONNX, ~760x realtime) on CPU, pyannote on GPU."
    )
    torch_threads: int = Field(
        1, ge=1, le=256,
        description="torch intra-op threads (mel, pyannote VAD). Kept small on purpose: torch's "
        "OpenMP pool spinning beside CTranslate2's made pyannote 15-25x slower on 2 cores.",
    )
    local_files_only: bool = Field(True, description="Never reach a model hub at run time.")


class BatcherSettings(BaseModel):
    """The cross-request micro-batcher."""

    max_batch_size: int = Field(16, ge=1, le=256, description="Windows per batch (the cap).")
    max_wait_ms: int = Field(
        50, ge=0, le=60_000, description="Oldest window waits at most this long for a fuller batch."
    )
    regrow_after: int = Field(
        8, ge=1, le=10_000, description="Successful batches before a halved cap doubles again."
    )
    duration_bucket_s: float = Field(
        5.0, gt=0, le=30, description="Windows whose lengths differ by less than this batch together."
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


class Settings(BaseSettings):
    """Top-level settings; see the nested groups."""

    model_config = SettingsConfigDict(
        env_prefix="BATCHSCRIBE_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=1, le=65535, description="Bind port.")
    prep_workers: int = Field(
        1, ge=1, le=64, description="Threads decoding and VAD-cutting uploads beside the engine."
    )
    default_beam_size: int = Field(
        1, ge=1, le=10, description="Beam size when a request gives none (1: greedy, fastest)."
    )
    shutdown_grace_s: float = Field(
        25.0, ge=0, le=3600, description="SIGTERM: time to finish the batch in flight."
    )
    model: ModelSettings = ModelSettings()
    batcher: BatcherSettings = BatcherSettings()
    storage: StorageSettings = StorageSettings()
    limits: LimitSettings = LimitSettings()

    def database_url(self) -> str:
        if self.storage.database_url:
            return self.storage.database_url
        return f"sqlite+aiosqlite:///{self.storage.data_dir / 'jobs.db'}"
