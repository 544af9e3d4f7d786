"""What a job's work sees of its upload's preparation: a feed of windows, read ahead by credits.

Two feeds implement it: prep processes (app/audio/procs, the default) and prep threads of the
service process (app/jobs/prep.py: the pyannote VAD, and a fallback). Either way a job asks for
its next :class:`Delivery` and hands each window back (:meth:`Feed.release`) once its batch is
done; a window not yet handed back holds a credit.

**Credits** (:class:`Credits`). A job used to be prepared a 60 s chunk at a time, and only
while fewer than ``prep.ahead_windows`` (24) of its windows waited for the engine: on a GPU
whose batch holds 128 windows, a long upload alone could never fill one, even with instant prep
(loadtest/results/gpu-h200.json: batches of 2.2 windows for one 60-minute upload). Now the
engines' appetite sets it: the jobs being prepared together may hold at least two full batches
per engine worker (``feed``), shared evenly, and each at least ``floor`` (``ahead_windows``),
so a job alone reads ahead by two batches per worker and sixteen together by an eighth of that
each. On 2 CPU cores (batch 8, 2 workers) that is 32 for one job, about today's 24.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from app.windows import SAMPLE_RATE, Window


@dataclass(frozen=True)
class Credits:
    """Windows a job may hold prepared and not yet transcribed."""

    feed: int  # across the jobs in flight: two full batches per engine worker
    floor: int  # each job, whatever the number of jobs

    @classmethod
    def sized(cls, batch: int, workers: int, floor: int) -> Credits:
        return cls(max(floor, 2 * batch * workers), floor)

    def per_job(self, jobs: int) -> int:
        return max(self.floor, math.ceil(self.feed / max(1, jobs)))


@dataclass(frozen=True)
class Request:
    """One upload to prepare, as a job asks for it."""

    job_id: str
    path: str
    max_audio_s: float
    chunk_s: float
    separate: bool = False  # channels=separate: each channel its own windows
    vad: dict[str, float] | None = None  # server_vad settings (chunking_strategy)
    audio: bool = False  # each chunk's samples too (speakers)
    split: bool = True  # may be cut into parts prepared side by side (app/audio/parts.py)
    # Its language is detected once, from its first speech window: a split upload's later
    # parts then get no slot (make no window) until the first part has made one, or ended.
    first_part_first: bool = False
    duration_s: float = 0.0  # by its header (where it is placed: the least loaded process)


@dataclass
class Delivery:
    """Windows of one part of the upload, in its order, and what they hold."""

    windows: list[Window]
    channels: list[int]
    tokens: list[int]  # one per window: hand it back with Feed.release
    part: int = 0
    ended: bool = False  # the part's last delivery
    audio: np.ndarray | None = None  # the chunk's samples (Request.audio)
    audio_start_s: float = 0.0


class Feed(Protocol):
    """One job's upload being prepared."""

    parts: int  # parts it is prepared in (known after start)

    async def start(self) -> None:
        """The upload is open (raises its 4xx: not audio, too long, a decoder that fails)."""
        ...

    async def next(self) -> Delivery | None:
        """The next windows ready (None: all delivered)."""
        ...

    def release(self, token: int) -> None:
        """A window's batch is done: its credit (and its slot) go back."""
        ...

    @property
    def samples(self) -> int:
        """The upload's samples decoded so far (its length once all is delivered)."""
        ...

    async def close(self) -> None:
        """Stop (the job ended or failed); windows not yet delivered are dropped."""
        ...


def seconds(samples: int) -> float:
    return samples / SAMPLE_RATE


def released(feed: Feed, tokens: Sequence[int]) -> None:
    for t in tokens:
        feed.release(t)
