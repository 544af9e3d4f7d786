"""Loading the model: explicit settings per engine, the real cause when a load fails, and the
quick checks ``python -m app`` runs before anything heavy (one line and a non-zero exit).

A load used to report every RuntimeError or ValueError as a corrupt model, including a driver
that does not match the CUDA runtime, memory too small for the weights and "float16 not
supported". Now only CTranslate2's own texts for an unreadable file say so
(:data:`models.registry.CORRUPT_TEXTS`); everything else keeps its message and names the device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from app.config import ModelSettings, Settings
from app.engine import Engine
from app.engine.device import (
    UnsupportedComputeType,
    cuda_device_count,
    cuda_unavailable_reason,
    is_oom,
    resolve_compute_type,
    resolve_device,
)
from app.engine.whisper import time_axis
from models.registry import ModelUnavailable, broken_model_message, is_broken_file, resolve

log = logging.getLogger(__name__)

GPU_WORKERS = 2  # per GPU by default: see ModelSettings.num_workers


class StartupRefused(RuntimeError):
    """The service cannot run with this configuration on this machine; the message says why."""


class DeviceUnavailable(StartupRefused):
    pass


REFUSALS: tuple[type[BaseException], ...] = (StartupRefused, ModelUnavailable)


def engine_settings(m: ModelSettings) -> ModelSettings:
    """Every ``auto`` made explicit for one engine: device, compute type (from what the device
    supports), workers (2 per GPU, one per core on CPU), the time axis
    (:func:`app.engine.whisper.time_axis`)."""
    device = resolve_device(m.device)
    index = m.device_index if device == "cuda" else 0
    try:
        compute = resolve_compute_type(m.compute_type, device, index)
    except UnsupportedComputeType as exc:
        raise StartupRefused(str(exc)) from exc
    workers = m.num_workers or (GPU_WORKERS if device == "cuda" else len(os.sched_getaffinity(0)))
    axis = time_axis(m, device)
    return m.model_copy(update={"device": device, "device_index": index, "compute_type": compute,
                                "num_workers": workers, "time_axis": axis})


def preflight(settings: Settings) -> str:
    """What can be known in a second, before the model loads: a GPU that is asked for but absent
    (with CTranslate2's reason), a compute type the device cannot run, a missing or malformed
    model folder. Returns the model's folder."""
    m = settings.model
    if resolve_device(m.device) == "cuda":
        n = cuda_device_count()
        if n == 0:
            raise DeviceUnavailable(
                f"BATCHSCRIBE_MODEL__DEVICE={m.device} but CTranslate2 finds no usable GPU: "
                f"{cuda_unavailable_reason()}. To run on CPU: BATCHSCRIBE_MODEL__DEVICE=cpu")
        if m.engines > n:
            raise DeviceUnavailable(f"BATCHSCRIBE_MODEL__ENGINES={m.engines} but {n} GPU(s) are "
                                    "visible (one engine per GPU)")
        if m.device_index >= n:
            raise DeviceUnavailable(f"BATCHSCRIBE_MODEL__DEVICE_INDEX={m.device_index} but {n} "
                                    "GPU(s) are visible")
    engine_settings(m)
    return resolve(m.name, m.cache_dir, m.local_files_only)


def load_error(exc: BaseException, path: str, m: ModelSettings) -> RuntimeError:
    """The failure of a load, kept as it is and attributed: a broken file, memory, compute type,
    the device, or (anything else) the model in ``path``."""
    where = f"{m.device}:{m.device_index}"
    if is_broken_file(exc):
        return ModelUnavailable(broken_model_message(path, exc))
    size_gb = _size_gb(path)
    if is_oom(exc):
        return DeviceUnavailable(f"not enough memory on {where} to load {m.name} ({size_gb:.1f} GB "
                                 f"of weights at {m.compute_type}): {exc}")
    if "compute type" in str(exc):
        return StartupRefused(f"compute_type {m.compute_type} on {where}: {exc}")
    if m.device == "cuda":
        return DeviceUnavailable(f"cannot load {m.name} on {where}: {type(exc).__name__}: {exc}")
    return StartupRefused(f"cannot load the model in {path}: {type(exc).__name__}: {exc}")


def _size_gb(path: str) -> float:
    try:
        return os.path.getsize(os.path.join(path, "model.bin")) / 1e9
    except OSError:
        return 0.0


def mel_bins(engine: Any) -> tuple[int | None, int | None]:
    """(mel bins the model takes, mel bins the engine computes), None where unknown. The model's
    count is CTranslate2's ``Whisper.n_mels`` (its encoder's input size)."""
    model = getattr(getattr(engine, "model", None), "model", None)
    takes = getattr(model, "n_mels", None)
    feeds = getattr(engine, "n_mels", getattr(engine, "_n_mels", None))
    return (int(takes) if takes is not None else None, int(feeds) if feeds is not None else None)


def load_whisper(settings: Settings) -> Engine:
    """The engine factory of the service (app/engine/startup.load_engines calls it per GPU)."""
    from app.engine.whisper import WhisperEngine

    m = engine_settings(settings.model)
    path = resolve(m.name, m.cache_dir, m.local_files_only)
    try:
        engine = WhisperEngine(path, m, m.name)
    except Exception as exc:
        raise load_error(exc, path, m) from exc
    engine.info = replace(engine.info, device_index=m.device_index)
    takes, feeds = mel_bins(engine)
    if takes is not None and feeds is not None and takes != feeds:
        engine.close()
        raise ModelUnavailable(
            f"the model in {path} takes {takes} mel bins but the engine would compute {feeds} "
            "(faster-whisper assumes 80 when the folder has no preprocessor_config.json): every "
            f"batch would fail. Provision it: python -m models.provision {m.name} --from {path}")
    return engine
