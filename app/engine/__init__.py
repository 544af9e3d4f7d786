"""The one seam to the model: ``transcribe_batch(windows, options) -> results``.

The engine owns the resident Whisper model (:mod:`app.engine.whisper`). It is created in the
app's lifespan, never at import, and its calls only ever run on the engine's own dedicated
threads (:class:`app.engine.placement.EngineRunner`): the event loop never blocks on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.windows import DecodeOptions, Encoded, Window, WindowResult


@dataclass(frozen=True)
class EngineInfo:
    model: str
    device: str
    compute_type: str
    num_workers: int
    device_index: int = 0  # CUDA ordinal of its GPU (engine k runs on GPU k)

    @property
    def name(self) -> str:
        return f"{self.device}:{self.device_index}"


@dataclass(frozen=True)
class EngineFailure:
    """An engine that did not start (its GPU failed the load or the warm-up): the service runs
    on the others and reports this one (``/readyz``, the ``engine_up`` gauge) until a restart."""

    engine: str  # "cuda:1"
    stage: str  # "load" or "warm-up"
    exc: BaseException

    @property
    def error(self) -> str:
        return f"{self.stage} failed: {type(self.exc).__name__}: {self.exc}"


class Engine(Protocol):
    info: EngineInfo

    def transcribe_batch(
        self, windows: Sequence[Window], options: DecodeOptions
    ) -> list[WindowResult]: ...

    def close(self) -> None: ...


class StagedEngine(Engine, Protocol):
    """An engine whose encoder and decoder can run as separate calls (see :class:`Encoded`)."""

    @property
    def staged(self) -> bool: ...

    def padded_samples(self, window: Window) -> int: ...

    def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]: ...

    def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
               options: DecodeOptions, redo: bool = True) -> list[WindowResult]: ...

    def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
             options: DecodeOptions) -> list[WindowResult]: ...
