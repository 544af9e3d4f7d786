"""The one builder of the pipeline: engines, pool, stages, batcher, VAD, prep, speakers, live hall.

Both ways in use it: the service's lifespan (app/main.py) and the Ray actors' in-process
pipeline (app/dataset/local.py), and the tests' rigs build their batchers and prep with its
parts. Three places built it before and had drifted: the dataset path built the batcher's
stages without the decoder's ``redo=False`` (Whisper's fallbacks then ran inside decoder
batches there, beside every other window of the batch, and in calls of their own in the
service), and both guarded ``restore_slots`` with ``getattr``.

What is built here is what every copy of the pipeline shares; what only the service has (the
job store, the blob store, the job runner, admission, webhooks) stays with the lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from app.audio.vad import Vad, make_vad
from app.batching.batcher import Batcher
from app.batching.stages import Stages
from app.config import BatcherSettings, Settings
from app.engine import Engine, StagedEngine
from app.engine.device import DeviceMonitor, resolve_device
from app.engine.placement import EnginePool, make_pool
from app.engine.sizing import EngineSizing, resolve_batcher
from app.engine.startup import EngineFactory, start_engines
from app.engine.whisper import size_class
from app.jobs.live import LiveHall
from app.jobs.prep import Prep, make_prep
from app.jobs.store import JobStore
from app.metrics import Metrics
from app.net.outbound import OutboundGuard
from app.speakers.service import SpeakerService

log = logging.getLogger(__name__)


def make_stages(settings: Settings, pool: EnginePool) -> Stages | None:
    """The encoder and decoder as separate batcher stages, where the engines allow it (CPU).
    The decoder leaves Whisper's fallbacks to calls of their own (stage ``redo``): a looping
    window's 30 s fallback inside a decoder batch of 8 made that batch take 8.23 s against
    1.25 s (app/batching/urgency.py)."""
    if not (settings.batcher.split_stages and pool.staged):
        return None
    engine = cast(StagedEngine, pool.engine)
    return Stages(pool.encode, partial(pool.decode, redo=False), engine.padded_samples,
                  redo=pool.redo)


def make_batcher(settings: Settings, pool: EnginePool, metrics: Metrics, *,
                 batcher_settings: BatcherSettings | None = None, device: str = "cpu",
                 base_memory_mb: float = 0.0, cls: type[Batcher] = Batcher) -> Batcher:
    """The cross-request batcher on ``pool``, wired to it: an engine leaving the rotation
    retires its worker slots, and coming back restores them."""
    staged = make_stages(settings, pool)
    padded: Callable[..., int] | None = getattr(pool.engine, "padded_samples", None)
    batcher = cls(pool.run, batcher_settings or settings.batcher, pool.workers, metrics,
                  size_class=size_class(settings.model, device), base_memory_mb=base_memory_mb,
                  stages=staged, padded=padded)
    pool.on_remove, pool.on_restore = batcher.retire_slots, batcher.restore_slots
    return batcher


def held_mb(monitor: DeviceMonitor) -> float:
    """Memory this process holds now (RSS on CPU, its VRAM on GPU): the budget's baseline."""
    return sum(r.used_bytes if r.process_bytes is None else r.process_bytes
               for r in monitor.read()) / 2**20


@dataclass
class Pipeline:
    """Everything a transcription passes through, built once per process by :func:`build`."""

    settings: Settings
    metrics: Metrics
    monitor: DeviceMonitor
    device: str  # "cpu" or "cuda": where the engines run
    vad: Vad
    vad_kind: str
    pool: EnginePool
    batcher: Batcher
    batcher_settings: BatcherSettings  # with the GPU sizing filled in
    prep: Prep  # decode, VAD, cut: prep processes (app/audio/procs), or threads
    speakers: SpeakerService
    sizings: list[EngineSizing]

    @property
    def engine(self) -> Engine:
        return self.pool.engine

    @property
    def engines(self) -> int:
        return len(self.pool.slots)

    def sizing(self) -> dict[str, Any]:
        """The batch sizing the warm-up measured (GET /readyz, the start-up log)."""
        return {"engines": [z.as_dict() for z in self.sizings],
                "max_batch_size": self.batcher_settings.max_batch_size,
                "max_batch_beams": self.batcher_settings.max_batch_beams}

    def live_hall(self, store: JobStore, outbound: OutboundGuard,
                  ended: Callable[[str, str], None]) -> LiveHall:
        """The live sessions' hall (service only: it keeps sessions as jobs in ``store``);
        ``ended`` is told a kept session's end, as every job's (the runner's event hub:
        ``jobs_finished``, followers, webhooks)."""
        return LiveHall(self.settings, self.metrics, store, self.batcher, self.vad, outbound,
                        ended)

    def start(self) -> None:
        self.batcher.start()

    async def close(self) -> None:
        """After the batcher and prep have stopped (the runner's drain, or the dataset
        pipeline's own): the speaker models, then the engines."""
        await self.speakers.stop()
        await asyncio.to_thread(self.pool.close)


async def build(settings: Settings, engine_factory: EngineFactory,
                metrics: Metrics | None = None) -> Pipeline:
    """Load and warm up the engines (on a GPU the warm-up measures the batch cap:
    app/engine/sizing.py), then build the rest around them. Raises one of
    :data:`app.engine.loading.REFUSALS` when no engine starts, and the speaker service's
    :class:`app.errors.ServiceError` when its models were asked for and fail to load."""
    metrics = metrics or Metrics()
    monitor = await asyncio.to_thread(DeviceMonitor, resolve_device(settings.model.device))
    started = await start_engines(settings, engine_factory, monitor)  # a GPU that fails is left out
    engine = started.engines[0]  # model, device and compute type are the same on every engine
    device = engine.info.device if engine.info.device != "auto" else resolve_device("auto")
    if device != monitor.device:  # an injected engine on another device (tests)
        monitor = await asyncio.to_thread(DeviceMonitor, device)
    # Silero runs in the prep processes (or threads), on their CPU.
    vad_kind = "silero" if settings.model.vad == "auto" else settings.model.vad
    vad = await asyncio.to_thread(make_vad, vad_kind, device, settings.prep.speech_pad_s,
                                  settings.model.cache_dir)
    pool = make_pool(started.engines, settings, started.failed)  # least loaded engine first
    # GPU: the cap the warm-up measured per engine (the smallest); CPU: as configured.
    batcher_settings = resolve_batcher(settings.batcher, started.sizings)
    batcher = make_batcher(settings, pool, metrics, batcher_settings=batcher_settings,
                           device=device,
                           base_memory_mb=held_mb(monitor) if device == "cpu" else 0.0)
    # Speaker diarization: loaded on the first diarize job unless speakers.load says.
    speakers = SpeakerService(settings.speakers, settings.model.cache_dir)
    try:
        await speakers.start()
    except BaseException:
        await asyncio.to_thread(pool.close)
        raise
    # Prep processes, spawned now (they start while the rest does; ready before the service).
    prep = make_prep(settings, len(started.engines), batch=batcher_settings.max_batch_size,
                     workers=pool.workers, vad=vad)
    await prep.start()
    return Pipeline(settings, metrics, monitor, device, vad, vad_kind, pool, batcher,
                    batcher_settings, prep, speakers, started.sizings)
