"""GPU batch size from measurements, not from a guess: one budget per engine.

The approach of NeMo's batch-size guide (find the largest batch the device holds, then let an
out-of-memory backoff adapt at run time), measured on the service's own device at start:

1. After the model loaded, the warm-up runs a probe batch (detection, beam search, word
   alignment) and reads what it allocated at most (the CUDA pool's high watermark,
   app/engine/gpumem.py). Per 30 s window and beam: ``unit = peak / (windows x beam)``.
   Beam search keeps ``beam`` decoder states per window, each with its own self- and
   cross-attention caches (large-v3: the cross-attention cache alone is 2 x 32 layers x 1500
   frames x 1280 x 2 bytes = 246 MB per window and beam), so memory is counted in windows x beam;
   the encoder's share does not grow with the beam, which makes the count conservative.
2. The engine's budget is the device's free memory after that probe (weights, CUDA context,
   cuBLAS workspaces already held) less ``memory_headroom`` of the device; each of its
   ``workers`` runs one batch at a time, so one batch gets ``budget / workers``.
3. Windows x beam per batch = ``budget / workers / unit``, at most ``AUTO_LIMIT``.
4. The warm-up then runs that batch on every worker at once; if it still runs out of memory, it
   halves until it fits (without a pool reading it starts that search from the limit). The
   largest batch that ran is the cap; the batcher's OOM backoff adapts from there.

Engines are sized apart (each GPU's own free memory) and the batcher's cap is the smallest, so
a batch placed on any engine fits it; it is never one budget summed over all GPUs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.config import BatcherSettings

MiB = 1 << 20
# Windows per batch at most when derived. A bound on latency and on a batch's host work (mel,
# results), not a measured optimum: `scripts/gpu-check` sweeps the cap on a real device.
AUTO_LIMIT = 128


@dataclass
class EngineSizing:
    engine: str  # "cuda:0"
    workers: int
    free_bytes: int | None = None  # device memory free after the probe batch
    total_bytes: int | None = None
    probe_units: int = 0  # the probe's windows x beam
    peak_bytes: int | None = None  # what the probe allocated at most (pool watermark - before)
    unit_bytes: int | None = None  # one 30 s window at beam 1
    budget_bytes: int | None = None  # what this engine's batches may use together
    units: int | None = None  # windows x beam per batch, derived
    verified: int | None = None  # windows per batch the warm-up ran on every worker at once
    oom_steps: int = 0  # halvings the verification needed
    warmup_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unit_bytes(peak: int | None, units: int, explicit_mb: float | None) -> int | None:
    """Bytes per 30 s window x beam: the operator's figure, else the probe's peak per unit."""
    if explicit_mb is not None:
        return int(explicit_mb * MiB)
    if peak is None or peak <= 0 or units <= 0:
        return None
    return -(-peak // units)


def budget_bytes(free: int | None, total: int | None, headroom: float,
                 explicit_mb: int | None) -> int | None:
    """Device memory the engine's batches may use: free less the headroom (or the operator's)."""
    derived = None if free is None or total is None else max(0, free - int(headroom * total))
    if explicit_mb:
        cap = explicit_mb * MiB
        return cap if derived is None else min(cap, derived)
    return derived


def units_per_batch(budget: int | None, unit: int | None, workers: int,
                    limit: int = AUTO_LIMIT) -> int | None:
    """Windows x beam one batch may hold (None: not measurable, search from the limit)."""
    if budget is None or unit is None:
        return None
    return max(1, min(limit, budget // max(1, workers) // unit))


def resolve_batcher(settings: BatcherSettings, sizings: list[EngineSizing]) -> BatcherSettings:
    """The batcher's settings with the GPU cap filled in: the smallest engine's verified batch
    (an explicit ``max_batch_size`` stays an upper bound); windows x beam likewise.

    The per-job ledger is re-derived too. Its defaults (``window_memory_mb`` 100, and
    ``job_memory_mb`` 300 for one job's windows in engine calls) are CPU figures: left as they
    are, one long upload alone on a GPU would hold ~3 windows in flight and run batches of 1
    per worker while the sizing allowed a hundred. On a GPU a window costs the warm-up's
    measured ``unit_bytes``, and one job may fill every worker's batch: the sizing already
    keeps each batch within the device's budget, so a job cap below that only idles it."""
    verified = [s.verified for s in sizings if s.verified]
    if not verified:
        return settings  # CPU: as configured (measured there: see the README)
    cap = min(verified)
    if "max_batch_size" in settings.model_fields_set:
        cap = min(cap, settings.max_batch_size)
    beams = settings.max_batch_beams or cap
    update: dict[str, Any] = {"max_batch_size": cap, "max_batch_beams": beams,
                              # The GPU budget replaces the CPU one (RSS-based, windows in
                              # flight): a batch's share is fixed per worker, so nothing is left
                              # to count in flight.
                              "memory_budget_mb": 0}
    units = [s.unit_bytes for s in sizings if s.verified and s.unit_bytes]
    window_mb = explicit(settings, "window_memory_mb")
    if window_mb is None and units:
        window_mb = update["window_memory_mb"] = max(units) / MiB
    if explicit(settings, "job_memory_mb") is None:
        workers = sum(s.workers for s in sizings if s.verified)
        # Half a window over cap per worker: float sums of cap windows never fall just short.
        update["job_memory_mb"] = (window_mb or settings.window_memory_mb) * (cap + 0.5) * workers
    return settings.model_copy(update=update)


def explicit(settings: BatcherSettings, field: str) -> Any:
    """The operator's value for ``field`` if they set one, else None (GPU sizing derives it)."""
    return getattr(settings, field) if field in settings.model_fields_set else None
