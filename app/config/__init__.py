"""Service settings: one pydantic-settings tree, read from the environment.

Every field is bounded and documented, so a typo in a deployment fails at start-up with a clear
message instead of surfacing as odd behaviour under load. Nested groups map to environment
variables with a double underscore, e.g. ``BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE=16``. Every
group refuses fields it does not know (``extra="forbid"``), and a ``BATCHSCRIBE_*`` variable
that names no setting is refused too (:func:`unknown_variables`: pydantic-settings reads only
the variables of known fields, so it cannot see ``BATCHSCRIBE_PROT``), except the few that
configure the tools around the service (:data:`TOOL_VARIABLES`). :func:`problem` says what is
wrong in one line, naming the variable.

The groups live beside this module, one file per side of the service: ``stages`` (model, batcher,
prep, speakers) and ``service`` (storage, limits, security, webhooks, outbound).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.config.service import (
    LimitSettings,
    LiveSettings,
    OutboundSettings,
    SecuritySettings,
    StorageSettings,
    WebhookSettings,
)
from app.config.stages import (
    DEFAULT_HOME,
    BatcherSettings,
    ModelSettings,
    PrepSettings,
    SpeakerSettings,
)

__all__ = [
    "DEFAULT_HOME", "PREFIX", "TOOL_VARIABLES", "BatcherSettings", "LimitSettings", "LiveSettings",
    "ModelSettings", "OutboundSettings", "PrepSettings", "SecuritySettings", "Settings",
    "SpeakerSettings", "StorageSettings", "WebhookSettings", "problem", "unknown_variables",
]

PREFIX = "BATCHSCRIBE_"
# Variables with the prefix that configure the tools around the service, not the service: the
# client CLI (app/client), the benchmarks (loadtest/), set-up and the test suite (scripts/,
# tests/: every BATCHSCRIBE_TEST_*). A deployment may carry them beside the service's own.
TOOL_VARIABLES = frozenset({
    "BATCHSCRIBE_URL", "BATCHSCRIBE_API_KEY",  # app/client/cli.py
    "BATCHSCRIBE_CORPUS", "BATCHSCRIBE_MULTILINGUAL_CORPUS", "BATCHSCRIBE_ML_CORPUS",
    "BATCHSCRIBE_DIARIZATION_CORPUS", "BATCHSCRIBE_GIT_REVISION", "BATCHSCRIBE_BATCH_TRACE",
    "BATCHSCRIBE_CORPUS_MULTILINGUAL", "BATCHSCRIBE_CHROMIUM",  # tests/test_asr.py, test_web.py
    "BATCHSCRIBE_EXTRA_APT",  # scripts/setup.sh
})
TOOL_PREFIXES = ("BATCHSCRIBE_TEST_",)


class Settings(BaseSettings):
    """Top-level settings; see the nested groups."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    home: Path = Field(
        DEFAULT_HOME,
        description="The service's own folder: provisioned models (<home>/models, unless "
        "model.cache_dir is set) and job data (<home>/data, unless storage.data_dir is set).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="The service's log level (any case)."
    )
    progress_log_windows: int = Field(
        10, ge=1, le=1_000_000,
        description="A job of at least this many windows logs its progress: about ten "
        "'job progress' lines (every window's, below 20 windows). Shorter jobs stay quiet.",
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
    keep_alive_s: int = Field(
        75, ge=1, le=3600,
        description="An idle HTTP connection is closed after this. Longer than the pools of "
        "common clients (aiohttp keeps one 15 s, httpx 5 s), so the client closes first: with "
        "uvicorn's 5 s, an aiohttp client that POSTed after ~5 s idle raced the server's close and "
        "failed 'Can not write request body' (2 of 20 tries at 4.98-5.02 s idle). nginx's "
        "default is the same 75 s.",
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
    live: LiveSettings = LiveSettings()

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _refuse_unknown_variables(self) -> Settings:
        unknown = unknown_variables(os.environ)
        if unknown:
            raise ValueError("; ".join(unknown))
        return self

    @model_validator(mode="after")
    def _under_home(self) -> Settings:
        """The folders left at their defaults follow ``home``."""
        if "cache_dir" not in self.model.model_fields_set:
            self.model = self.model.model_copy(update={"cache_dir": self.home / "models"})
        if "data_dir" not in self.storage.model_fields_set:
            self.storage = self.storage.model_copy(update={"data_dir": self.home / "data"})
        return self

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


def unknown_variables(environ: Any) -> list[str]:
    """``BATCHSCRIBE_*`` variables that name no setting, each with the nearest one it may have
    meant. Nested ones (``BATCHSCRIBE_MODEL__NAMEE``) are pydantic's to refuse, as fields their
    group does not know; here, those whose first part names no top-level setting."""
    top = {name.upper() for name in Settings.model_fields}
    known = sorted(f"{PREFIX}{name}" for name in top)
    out = []
    for key in sorted(environ):
        upper = key.upper()
        if not upper.startswith(PREFIX) or upper in TOOL_VARIABLES or \
                upper.startswith(TOOL_PREFIXES):
            continue
        if upper[len(PREFIX):].split("__")[0] not in top:
            out.append(f"unknown setting {key}{_guess(upper, known)}")
    return out


def problem(exc: ValidationError, flags: Collection[str] = ()) -> str:
    """A settings error in one line, each fault naming its environment variable:
    ``unknown setting BATCHSCRIBE_MODEL__NAMEE (did you mean BATCHSCRIBE_MODEL__NAME?)``,
    ``BATCHSCRIBE_PORT: Input should be less than or equal to 65535``; or its flag, for the
    settings in ``flags`` (given on the command line, app/config/cli.py: ``model.cache_dir``):
    ``--port: Input should be ...``."""
    faults = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"] if not isinstance(part, int)]
        name = PREFIX + "__".join(loc).upper()
        if ".".join(loc) in flags:
            name = "--" + ".".join(loc).replace("_", "-")
        if err["type"] == "extra_forbidden":
            faults.append(f"unknown setting {name}{_guess(name, _nested_names(loc[:-1]))}")
        elif not loc:  # a model validator's own message (unknown top-level variables)
            faults.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            faults.append(f"{name}: {err['msg']}")
    return "; ".join(faults)


def _nested_names(group: list[str]) -> list[str]:
    model: Any = Settings
    for part in group:
        model = model.model_fields[part].annotation
    return [PREFIX + "__".join([*group, f]).upper() for f in model.model_fields]


def _guess(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f" (did you mean {near[0]}?)" if near else ""
