"""The service-level diarizer: both speaker models, a thread and a batcher for each.

Lifecycle (as the engine's): ``Diarizer.load(cache_dir)`` is blocking (imports pyannote.audio,
reads ~34 MB of weights: ~8 s here, mostly the import) and belongs in the lifespan's start-up
thread, never at import; ``start()`` runs inside the event loop; ``await stop()`` at shutdown.
Per job: ``stream(...)`` gives a :class:`~app.speakers.stream.SpeakerStream`; ``diarize`` is the
whole-array convenience on top of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from app.batching.primitive import ModelBatcher
from app.speakers.cluster import SpeakerBounds
from app.speakers.models import SAMPLE_RATE, FrameGrid
from app.speakers.report import SpeakerTurns
from app.speakers.stream import SpeakerStream

CHUNK_S = 60.0  # whole-array convenience: fed in chunks like the decoder's


class SpeakerModelsLike(Protocol):
    """The two batch calls and the segmentation geometry (app/speakers/models.py)."""

    window_s: float
    window_step_s: float
    frames: FrameGrid

    @property
    def window_samples(self) -> int: ...

    def segment(self, windows: np.ndarray) -> np.ndarray: ...

    def embed(self, crops: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class DiarizerSettings:
    # Batch caps: per item, segmentation costs the same from 4 windows up (26.5-26.9 ms) and
    # CAM++ is cheapest at 16-32 crops (24.7-24.8 ms; 26.7 at 64), one torch thread here.
    segment_batch: int = 16  # 16 x 10 s windows: 10 MB of input per call
    embed_batch: int = 32
    device: str = "cpu"


class Diarizer:
    def __init__(self, models: SpeakerModelsLike, settings: DiarizerSettings | None = None,
                 executor: Executor | None = None) -> None:
        self.models = models
        self.settings = settings or DiarizerSettings()
        # A thread per model: each model is called by one thread only (one batch at a time),
        # and a stream embeds one chunk's crops while it segments the next (stream.py), so
        # speaker work takes up to two cores beside the engine. On one thread for both, a long
        # diarize upload alone ran at the speaker thread's pace with the other core idle once
        # its transcription was done. ``executor`` (tests): one for both.
        self._executors = ([executor] if executor is not None else
                           [ThreadPoolExecutor(1, thread_name_prefix=f"speakers-{m}")
                            for m in ("seg", "emb")])
        self._own_executor = executor is None
        self.segmenter: ModelBatcher[np.ndarray, np.ndarray] = ModelBatcher(
            lambda w: list(models.segment(np.stack(w))), self._executors[0],
            self.settings.segment_batch, "speaker-segmentation")
        self.embedder: ModelBatcher[np.ndarray, np.ndarray] = ModelBatcher(
            lambda c: list(models.embed(np.stack(c))), self._executors[-1],
            self.settings.embed_batch, "speaker-embedding")
        self._ids = itertools.count()

    @classmethod
    def load(cls, cache_dir: Path, settings: DiarizerSettings | None = None) -> Diarizer:
        """Blocking: load the provisioned models (``ModelUnavailable`` names the command)."""
        from app.speakers.models import load

        settings = settings or DiarizerSettings()
        return cls(load(cache_dir, settings.device), settings)

    def start(self) -> None:
        self.segmenter.start()
        self.embedder.start()

    async def stop(self) -> None:
        await self.segmenter.stop()
        await self.embedder.stop()
        if self._own_executor:
            for ex in self._executors:
                ex.shutdown(wait=False, cancel_futures=True)

    def stream(self, job: Hashable | None = None, num_speakers: int | None = None,
               min_speakers: int | None = None, max_speakers: int | None = None,
               known: Sequence[dict[str, Any]] = ()) -> SpeakerStream:
        """A new job's stream. ``job`` keys fairness across jobs in the batchers; ``known``:
        reference voices that name the speakers they match (app/speakers/named.py)."""
        return SpeakerStream(job if job is not None else ("stream", next(self._ids)),
                             self.models, self.segmenter, self.embedder,
                             SpeakerBounds(num_speakers, min_speakers, max_speakers), known)

    async def diarize(self, audio: np.ndarray, num_speakers: int | None = None,
                      min_speakers: int | None = None, max_speakers: int | None = None,
                      chunk_s: float = CHUNK_S) -> SpeakerTurns:
        """Turns of a whole 16 kHz mono float32 array (fed in ``chunk_s`` pieces)."""
        s = self.stream(None, num_speakers, min_speakers, max_speakers)
        step = max(1, round(chunk_s * SAMPLE_RATE))
        for a in range(0, len(audio), step):
            await s.feed(audio[a: a + step], a / SAMPLE_RATE)
        return await s.finish()
