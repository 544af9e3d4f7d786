"""Warm-up on the real device, before ``/readyz`` turns green, and the batch size it measures.

A GPU path that has never run fails on its first batch: a driver or cuBLAS that cannot start,
a compute type the card cannot run, a model whose mel bins do not match its features, memory
too small for one window. Without a warm-up that first batch is a user's. So the lifespan runs,
per engine, on its thread and device, before the service accepts work:

1. a probe batch: 30 s windows with language detection, beam search (beam 2) and word
   timestamps, and, if the synthetic audio decoded to no words, one ``align`` call on known
   tokens, so every kernel a request can reach has run once (CUDA's first calls also pay its
   lazy initialisation, cuBLAS handles and workspaces: not the first request's latency);
2. on GPU, the batch the sizing derives (app/engine/sizing.py) on every worker at once, halved
   on out of memory until it fits (and on the device error a starved card also raises, until
   one window shows which it was: app/engine/device.may_be_oom).

Anything else that fails leaves that engine out with the library's own message, and with no
engine left the start is refused with it (app/engine/startup.py: the service exits; the
orchestrator shows why). On CPU only the probe runs, one window: the CPU path's cap is the
one measured on CPU (README), and its start stays fast.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from app.config import Settings
from app.engine import Engine
from app.engine.device import DeviceMonitor, is_oom, may_be_oom
from app.engine.gpumem import PoolMeter
from app.engine.loading import StartupRefused
from app.engine.sizing import (
    AUTO_LIMIT,
    EngineSizing,
    budget_bytes,
    explicit,
    unit_bytes,
    units_per_batch,
)
from app.windows import N_SAMPLES, SAMPLE_RATE, DecodeOptions, Window, WindowResult

log = logging.getLogger(__name__)

PROBE_WINDOWS = 2
PROBE_BEAM = 2  # beam search runs other kernels than greedy decoding (top-k, gathers)


class WarmupFailed(StartupRefused):
    """The device cannot run the model; the message is the library's, with the engine named."""


def synthetic_windows(n: int) -> list[Window]:
    """30 s windows of a voiced, syllable-paced buzz over faint noise: deterministic, and shaped
    like speech for the VAD-free engine (what Whisper makes of it does not matter)."""
    t = np.arange(N_SAMPLES, dtype=np.float32) / SAMPLE_RATE
    out = []
    for k in range(n):
        f0 = 110.0 + 15.0 * k
        voice = sum(np.sin(2 * np.pi * f0 * h * t) / h for h in range(1, 8))
        syllables = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2
        noise = np.random.default_rng(k).normal(0.0, 0.003, N_SAMPLES)
        audio = (0.1 * voice * syllables + noise).astype(np.float32)
        out.append(Window(audio, 30.0 * k, 30.0 * (k + 1)))
    return out


def _options(beam: int) -> DecodeOptions:
    return DecodeOptions(beam_size=beam, word_timestamps=True)  # windows carry no language


def _run(engine: Engine, n: int, beam: int) -> list[WindowResult]:
    return engine.transcribe_batch(synthetic_windows(n), _options(beam))


def _run_on_workers(engine: Engine, n: int, workers: int) -> None:
    """The batch on every worker at once: what the device holds at full load."""
    if workers <= 1:
        _run(engine, n, 1)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="warmup") as pool:
        futures = [pool.submit(_run, engine, n, 1) for _ in range(workers)]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:  # an OOM on one worker is the answer the search wants; else the first error
        raise next((e for e in failed if may_be_oom(e)), failed[0])


def align_directly(engine: Engine) -> bool:
    """One CTranslate2 ``align`` on known tokens (the probe's audio may decode to no words, and
    then the engine never aligns). False if the engine has no CTranslate2 model to ask."""
    wrapper: Any = getattr(engine, "model", None)
    model: Any = getattr(wrapper, "model", None)
    if model is None or not hasattr(model, "align"):
        return False
    import ctranslate2
    from faster_whisper.tokenizer import Tokenizer

    tok = Tokenizer(wrapper.hf_tokenizer, bool(model.is_multilingual), task="transcribe",
                    language="en")
    frames = N_SAMPLES // 160
    mel = np.zeros((1, int(model.n_mels), frames), dtype=np.float32)
    model.align(ctranslate2.StorageView.from_array(mel), tok.sot_sequence,
                [tok.encode(" warm up")], [frames], median_filter_width=7)
    return True


def _fail(name: str, stage: str, exc: BaseException) -> WarmupFailed:
    text = f"warm-up {stage} on {name} failed: {type(exc).__name__}: {exc}"
    if "Invalid input features shape" in str(exc):
        text += ("; the features' mel bins do not match the model's (provision the folder with "
                 "`python -m models.provision NAME --from DIR`, which records them)")
    return WarmupFailed(text)


def _free(monitor: DeviceMonitor, index: int) -> tuple[int | None, int | None]:
    readings = monitor.read()
    if index >= len(readings):
        return None, None
    r = readings[index]
    return r.total_bytes - r.used_bytes, r.total_bytes


def warm_up(engine: Engine, settings: Settings, monitor: DeviceMonitor,
            meter: PoolMeter) -> EngineSizing:
    """Warm one engine up (blocking: run it on a worker thread) and size its batches."""
    index = engine.info.device_index
    info = engine.info
    name = info.name
    gpu = info.device == "cuda"
    sizing = EngineSizing(engine=name, workers=max(1, info.num_workers))
    start = time.monotonic()
    probe_n, probe_beam = (PROBE_WINDOWS, PROBE_BEAM) if gpu else (1, PROBE_BEAM)
    base = meter.used(index) if gpu else None
    if gpu:
        meter.reset(index)
    try:
        try:
            results = _run(engine, probe_n, probe_beam)
        except Exception as exc:
            if not (gpu and may_be_oom(exc)):
                raise
            log.warning("warm-up probe ran out of memory (or may have) on %s (%s); one window",
                        name, exc)
            probe_n, probe_beam = 1, 1
            results = _run(engine, 1, 1)
        if not any(r.words for r in results):
            align_directly(engine)
    except Exception as exc:
        raise _fail(name, "probe (detection, beam search, word alignment)", exc) from exc
    sizing.probe_units = probe_n * probe_beam
    if gpu:
        peak = meter.peak(index)
        sizing.peak_bytes = peak - base if peak is not None and base is not None else None
        _verify(engine, sizing, settings, monitor, index)
    sizing.warmup_s = round(time.monotonic() - start, 3)
    log.info("warm-up done", extra={"sizing": sizing.as_dict()})
    return sizing


def _verify(engine: Engine, sizing: EngineSizing, settings: Settings, monitor: DeviceMonitor,
            index: int) -> None:
    """Derive the batch (app/engine/sizing.py) and run it on every worker; halve on OOM."""
    b = settings.batcher
    sizing.free_bytes, sizing.total_bytes = _free(monitor, index)
    sizing.unit_bytes = unit_bytes(sizing.peak_bytes, sizing.probe_units,
                                   explicit(b, "window_memory_mb"))
    sizing.budget_bytes = budget_bytes(sizing.free_bytes, sizing.total_bytes, b.memory_headroom,
                                       explicit(b, "memory_budget_mb"))
    limit = min(AUTO_LIMIT, explicit(b, "max_batch_size") or AUTO_LIMIT)
    sizing.units = units_per_batch(sizing.budget_bytes, sizing.unit_bytes, sizing.workers, limit)
    n = sizing.units or limit
    while True:
        try:
            _run_on_workers(engine, n, sizing.workers)
            break
        except Exception as exc:
            if not may_be_oom(exc) or (n == 1 and not is_oom(exc)):
                raise _fail(sizing.engine, f"batch of {n} windows", exc) from exc
            if n == 1:
                raise WarmupFailed(f"{sizing.engine} has not the memory to run one window on "
                                   f"each of its {sizing.workers} workers: {exc}") from exc
            log.warning("warm-up batch of %d windows ran out of memory (or may have) on %s (%s); "
                        "halving", n, sizing.engine, exc)
            n, sizing.oom_steps = max(1, n // 2), sizing.oom_steps + 1
    sizing.verified = n
