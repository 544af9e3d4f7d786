"""Several engines in one process (one per GPU), each batch placed on the least loaded one.

The batcher stays unaware of how many engines there are: it calls :meth:`EnginePool.run` with
``workers`` slots, the sum of every engine's workers. Per batch the pool picks, among engines in
rotation, the one with the least in-flight work (batches per worker thread, then the device's
utilisation as NVML reports it, then windows in flight, then the one idle longest), so idle
engines take turns and a busy one is passed over.

Failures. An out-of-memory error is the batcher's business (it halves its cap and splits the
batch), so it is passed up as is and never counts against an engine (app/engine/device.py
classifies CUDA, cuBLAS, cuDNN and thrust texts); only a single window, which cannot be split,
that ran out of memory beside other batches on its engine waits for one of them to end and runs
again (a GPU shared with another process: an OOM storm then costs latency, not jobs). Any other
error is first blamed on neither side: the batch is re-run on another engine. If that one
succeeds, the engine that failed gets a strike; ``model.engine_strikes`` strikes in a row (or one
sticky CUDA error, after which the device's context is lost) take it out of rotation, and it is
tried again after ``model.engine_retry_s`` (doubling on each relapse): a passing fault costs a
GPU for a while, not for good. If every engine fails the same batch, the batch is at fault (a
poison input must not take every GPU out one by one), and the error goes up for the batcher to
split and isolate the window. The last engine in rotation is never removed; instead,
``batcher.unhealthy_after`` calls in a row failing on every engine (or a sticky error on the last
one) make :meth:`EnginePool.unhealthy` say why, and ``/healthz`` answers 503 so the orchestrator
restarts the process. Engines that never started (app/engine/startup.py) are no slots: the pool
only lists them in :meth:`EnginePool.status`, out of rotation, with their error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from app.config import Settings
from app.engine import Engine, EngineFailure, StagedEngine
from app.engine.device import cuda_device_count, is_oom, is_sticky, resolve_device
from app.engine.heap import HeapTrim, IdleRelease
from app.windows import DecodeOptions, Encoded, Window, WindowResult

log = logging.getLogger(__name__)

T = TypeVar("T")
Utilisation = Callable[[int], float | None]  # CUDA ordinal -> busy fraction 0..1, None: unknown


class NoEngineLeft(RuntimeError):
    pass


@dataclass(eq=False)
class Slot:
    """One engine and what the pool knows of its load and health."""

    index: int
    name: str  # "cuda:1", "cpu:0": for logs and status
    runner: EngineRunner
    in_rotation: bool = True
    suspect: bool = False  # failed a batch not yet re-run elsewhere: passed over meanwhile
    batches: int = 0  # in flight: running or waiting for one of its threads
    windows: int = 0
    last_start: float = 0.0
    done: int = 0  # batches completed here (status and tests)
    error: str | None = None  # why it last left the rotation
    strikes: int = 0  # batches in a row it failed and another engine then ran
    sticky: bool = False  # its last failure was a sticky CUDA error
    removals: int = 0  # times it left the rotation (the retry delay doubles with each)
    retry_at: float | None = None  # monotonic time it is tried again, while out of rotation
    freed: asyncio.Event | None = None  # set when one of its calls ends (see _placed)
    ended: int = 0  # calls ended here, however they ended

    @property
    def workers(self) -> int:
        return self.runner.workers

    @property
    def device(self) -> int:
        """Its GPU's CUDA ordinal (a GPU that failed to load leaves a gap), else its position."""
        info = self.runner.engine.info
        return info.device_index if info.device == "cuda" else self.index


class EnginePool:
    def __init__(self, runners: Sequence[EngineRunner], utilisation: Utilisation | None = None,
                 on_remove: Callable[[int], None] | None = None, *, strikes: int = 3,
                 retry_s: float = 60.0, unhealthy_after: int = 12,
                 failed: Sequence[EngineFailure] = ()) -> None:
        if not runners:
            raise ValueError("an engine pool needs at least one engine")
        self.slots = [Slot(k, r.engine.info.name if r.engine.info.device == "cuda"
                           else f"{r.engine.info.device}:{k}", r) for k, r in enumerate(runners)]
        self.failed = list(failed)  # engines that did not start: reported, never tried
        self._utilisation = utilisation
        # Called with the worker count of an engine leaving / re-entering the rotation (the
        # batcher retires that many slots, so batches keep forming only for threads that can
        # run them, and gets them back when the engine returns).
        self.on_remove = on_remove
        self.on_restore: Callable[[int], None] | None = None
        self.strikes = strikes
        self.retry_s = retry_s
        self.unhealthy_after = unhealthy_after
        self.failing = 0  # calls in a row that failed on every engine tried (not OOM)
        self._last_error: str | None = None

    # ---- what the rest of the service reads ---------------------------------------------------
    @property
    def engine(self) -> Engine:
        """An engine in rotation: model, device and compute type are the same on all."""
        live = self.live()
        return (live[0] if live else self.slots[0]).runner.engine

    @property
    def workers(self) -> int:
        return sum(s.workers for s in self.live()) or 1

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.in_rotation]

    def status(self) -> list[dict[str, Any]]:
        """Every engine, those that did not start included (``started`` false, never retried)."""
        now = time.monotonic()
        return [{"engine": s.name, "started": True, "in_rotation": s.in_rotation,
                 "batches_in_flight": s.batches, "batches_done": s.done, "error": s.error,
                 "strikes": s.strikes,
                 "retry_in_s": None if s.retry_at is None else round(max(0.0, s.retry_at - now), 1)}
                for s in self.slots] + [
                {"engine": f.engine, "started": False, "in_rotation": False,
                 "batches_in_flight": 0, "batches_done": 0, "error": f.error, "strikes": 0,
                 "retry_in_s": None} for f in self.failed]

    def unhealthy(self) -> str | None:
        """Why the process should be restarted, or None. Only the last engine in rotation can
        make it so (others are taken out of rotation instead): a sticky CUDA error there, or
        ``unhealthy_after`` calls in a row that no engine could run."""
        live = self.live()
        if len(live) == 1 and live[0].sticky:
            return f"sticky CUDA error on {live[0].name}: {live[0].error}"
        if self.failing >= self.unhealthy_after:
            return f"{self.failing} engine calls in a row failed: {self._last_error}"
        return None

    # ---- placement ----------------------------------------------------------------------------
    def pick(self, exclude: Sequence[Slot] = ()) -> Slot | None:
        candidates = [s for s in self.live() if s not in exclude]
        if not candidates:
            return None
        return min(candidates, key=self._load)

    def _load(self, s: Slot) -> tuple[bool, float, float, int, float]:
        util = self._utilisation(s.device) if self._utilisation else None
        # Utilisation rounded to 10 %: NVML samples are noisy, and near-equal devices should
        # fall through to the cheaper, exact keys (our own windows in flight, then idle time).
        return (s.suspect, s.batches / s.workers, round(util or 0.0, 1), s.windows, s.last_start)

    @property
    def staged(self) -> bool:
        """Every engine can run its encoder and decoder as separate calls (CPU)."""
        return all(s.runner.staged for s in self.slots)

    async def run(self, windows: Sequence[Window], options: DecodeOptions) -> list[WindowResult]:
        """The batcher's ``run_batch``: place the batch, re-place it if its engine breaks."""
        return await self._placed(len(windows), lambda r: r.run(windows, options))

    async def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        return await self._placed(len(windows), lambda r: r.encode(windows, options))

    async def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
                     options: DecodeOptions, redo: bool = True) -> list[WindowResult]:
        # Encoder outputs are host arrays (staged engines are CPU ones): any engine decodes them.
        return await self._placed(len(windows),
                                  lambda r: r.decode(windows, encoded, options, redo))

    async def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
                   options: DecodeOptions) -> list[WindowResult]:
        return await self._placed(len(windows), lambda r: r.redo(windows, encoded, options))

    async def _placed(self, n_windows: int, call: Callable[[EngineRunner], Awaitable[T]]) -> T:
        tried: list[Slot] = []
        first: Exception | None = None
        waits = 0
        while True:
            slot = self.pick(exclude=tried)
            if slot is None:
                for s in tried:  # every engine failed it: the batch, not they, is at fault
                    s.suspect = False
                if first is not None:
                    self.failing += 1
                    self._last_error = f"{type(first).__name__}: {first}"
                    raise first
                raise NoEngineLeft("no engine left in rotation")
            tried.append(slot)
            ended = slot.ended
            try:
                results = await self._run_on(slot, n_windows, call)
            except Exception as exc:
                others_ended = slot.ended - ended - 1  # calls beside it that ended meanwhile
                if is_oom(exc) and n_windows == 1 and (slot.batches or others_ended) \
                        and waits < slot.workers:
                    # One window that did not fit beside the engine's other batches: a smaller
                    # batch cannot exist, so run it again once one of them has ended, rather
                    # than fail its job (an OOM storm on a shared GPU).
                    waits += 1
                    log.warning("one window ran out of memory on %s beside %d batch(es); "
                                "retrying when one ends (%s)", slot.name, slot.batches, exc)
                    if not others_ended:
                        slot.freed = slot.freed or asyncio.Event()
                        await slot.freed.wait()
                    tried.pop()
                    continue
                if is_oom(exc):
                    raise  # the batcher halves its cap and splits; no engine is to blame
                log.warning("batch of %d windows failed on engine %s (%s: %s); re-placing it",
                            n_windows, slot.name, type(exc).__name__, exc)
                slot.suspect = True
                slot.sticky = is_sticky(exc)
                slot.error = f"{type(exc).__name__}: {exc}"
                first = first or exc
                continue
            self.failing = 0
            for bad in tried[:-1]:  # failed what another engine could run: a strike
                bad.suspect = False
                bad.strikes += 1
                if bad.sticky or bad.strikes >= self.strikes:
                    self._remove(bad)
            return results

    async def _run_on(self, slot: Slot, n_windows: int,
                      call: Callable[[EngineRunner], Awaitable[T]]) -> T:
        slot.batches += 1
        slot.windows += n_windows
        slot.last_start = time.monotonic()
        try:
            results = await call(slot.runner)
        finally:
            slot.batches -= 1
            slot.windows -= n_windows
            slot.ended += 1
            if slot.freed is not None:  # wake windows waiting for room on this engine
                slot.freed.set()
                slot.freed = None
        slot.suspect = slot.sticky = False
        slot.strikes = 0
        slot.done += 1
        return results

    def _remove(self, slot: Slot) -> None:
        if not slot.in_rotation or len(self.live()) <= 1:
            return
        slot.in_rotation = False
        slot.removals += 1
        delay = self.retry_s * 2 ** min(4, slot.removals - 1)
        slot.retry_at = time.monotonic() + delay
        log.error("engine %s taken out of rotation: %s; %d engine(s) left; retried in %.0f s",
                  slot.name, slot.error, len(self.live()), delay)
        asyncio.get_running_loop().call_later(delay, self._restore, slot)
        if self.on_remove is not None:
            self.on_remove(slot.workers)

    def _restore(self, slot: Slot) -> None:
        """Back on probation: one more failure there takes it out again, for twice as long;
        a success clears its record (``_run_on``)."""
        if slot.in_rotation:
            return
        slot.in_rotation, slot.retry_at = True, None
        slot.strikes = max(0, self.strikes - 1)
        slot.suspect = slot.sticky = False
        log.warning("engine %s back in rotation on probation (out since: %s)", slot.name, slot.error)
        if self.on_restore is not None:
            self.on_restore(slot.workers)

    def close(self) -> None:
        for s in self.slots:
            s.runner.close()


class EngineRunner:
    """Runs the engine's calls on its dedicated threads, one batch per thread. The heap a call
    freed goes back to the OS when it is large, at most once per ``trim.every_s`` while calls
    keep coming, and ``idle_s`` after the last call when none follows (:mod:`app.engine.heap`)."""

    def __init__(self, engine: Engine, trim: HeapTrim | None = None, idle_s: float = 5.0) -> None:
        self.engine = engine
        self.workers = max(1, engine.info.num_workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="engine")
        self._trim = trim
        self._idle = IdleRelease(trim, self._pool.submit, idle_s) if trim is not None else None

    @property
    def staged(self) -> bool:
        return bool(getattr(self.engine, "staged", False))

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        trim, idle = self._trim, self._idle

        def call() -> T:
            try:
                return fn(*args)
            finally:
                if trim is not None:
                    trim()
        if idle is not None:
            idle.started()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            if idle is not None:
                idle.ended()

    async def run(self, windows: Sequence[Window], options: DecodeOptions) -> list[WindowResult]:
        return await self._call(self.engine.transcribe_batch, windows, options)

    async def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        return await self._call(cast(StagedEngine, self.engine).encode, windows, options)

    async def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
                     options: DecodeOptions, redo: bool = True) -> list[WindowResult]:
        return await self._call(cast(StagedEngine, self.engine).decode, windows, encoded,
                                options, redo)

    async def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
                   options: DecodeOptions) -> list[WindowResult]:
        return await self._call(cast(StagedEngine, self.engine).redo, windows, encoded, options)

    def close(self) -> None:
        if self._idle is not None:
            self._idle.closed = True
            self._idle.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.engine.close()


# ---- building the engines ---------------------------------------------------------------------
def engine_count(settings: Settings) -> int:
    """``model.engines``, or one per visible GPU (0), or one on CPU."""
    if settings.model.engines:
        return settings.model.engines
    if resolve_device(settings.model.device) == "cuda":
        return max(1, cuda_device_count())
    return 1


class NvmlUtilisation:
    """GPU busy fraction per CUDA ordinal from NVML (honours CUDA_VISIBLE_DEVICES); None if
    NVML is missing. Cheap enough to read per batch (a driver call, no lock we hold)."""

    def __init__(self) -> None:
        self._handles: list[Any] | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv: Any = pynvml
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is None:
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                                 for i in range(pynvml.nvmlDeviceGetCount())]
            else:
                self._handles = []
                for token in (t.strip() for t in visible.split(",")):
                    if token.isdigit():
                        self._handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(token)))
                    elif token.startswith(("GPU-", "MIG-")):
                        self._handles.append(pynvml.nvmlDeviceGetHandleByUUID(token))
                    else:  # CUDA ignores this entry and every one after it
                        break
        except Exception as exc:
            log.info("no GPU utilisation readings for placement (%s)", exc)
            self._handles = None

    def __call__(self, index: int) -> float | None:
        if not self._handles or index >= len(self._handles):
            return None
        try:
            return float(self._nv.nvmlDeviceGetUtilizationRates(self._handles[index]).gpu) / 100
        except Exception:
            return None


def make_pool(engines: Sequence[Engine], settings: Settings | None = None,
              failed: Sequence[EngineFailure] = ()) -> EnginePool:
    s = settings or Settings()
    mb = s.model.heap_release_mb
    runners = [EngineRunner(e, HeapTrim(mb << 20, s.model.heap_release_every_s) if mb else None)
               for e in engines]
    util = NvmlUtilisation() if engines[0].info.device == "cuda" and len(engines) > 1 else None
    return EnginePool(runners, util, strikes=s.model.engine_strikes, retry_s=s.model.engine_retry_s,
                      unhealthy_after=s.batcher.unhealthy_after, failed=failed)


__all__ = ["EnginePool", "EngineRunner", "NoEngineLeft", "Slot", "engine_count", "make_pool"]
