"""Starting the engines, one per GPU: load each, then warm each up; a GPU that fails is left out.

One bad GPU (a driver or ECC fault, a card another tenant has filled, a device the wheel has no
kernels for) used to stop the start of a service whose other GPUs were fine: the first warm-up
failure refused it, and so did a load failure on GPU 0. Now each engine is loaded and warmed up
on its own. One that fails is closed (its memory handed back) and reported with its error, as an
:class:`~app.engine.EngineFailure` the pool lists in ``/readyz`` and the ``engine_up`` gauge, and
the service serves on the rest. It is not retried: its cause (a card, a driver) outlives the
process, and a restart, which the operator chooses, tries it again.

The start is refused, as before, only when no engine is left: with the failure's own message
when one GPU was tried, else with every GPU's. A model that cannot be used at all
(:class:`~models.registry.ModelUnavailable`: missing, corrupt, the wrong mel bins) refuses it at
the first engine: every GPU would fail the same way, each after loading the weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.config import Settings
from app.engine import Engine, EngineFailure
from app.engine.device import DeviceMonitor, resolve_device
from app.engine.gpumem import PoolMeter, pool_meter
from app.engine.loading import REFUSALS, StartupRefused
from app.engine.placement import engine_count
from app.engine.sizing import EngineSizing
from app.engine.warmup import warm_up
from models.registry import ModelUnavailable

log = logging.getLogger(__name__)
EngineFactory = Callable[[Settings], Engine]


@dataclass
class Started:
    engines: list[Engine]  # loaded and warmed up, in GPU order
    sizings: list[EngineSizing] = field(default_factory=list)  # one per engine (warm-up on)
    failed: list[EngineFailure] = field(default_factory=list)


def _close(engine: Engine) -> None:
    """Close an engine that will not serve; a broken device may fail that too."""
    try:
        engine.close()
    except Exception:
        log.exception("closing engine %s failed", engine.info.name)


def load_engines(settings: Settings,
                 factory: EngineFactory) -> tuple[list[Engine], list[EngineFailure]]:
    """Engine k on GPU k (``model.device_index``), those that loaded and those that did not.
    Blocking: call it on a worker thread."""
    device = resolve_device(settings.model.device)
    engines: list[Engine] = []
    failed: list[EngineFailure] = []
    for k in range(engine_count(settings)):
        model = settings.model.model_copy(update={"device_index": k})
        try:
            engines.append(factory(settings.model_copy(update={"model": model})))
        except ModelUnavailable:
            for e in engines:
                _close(e)
            raise
        except Exception as exc:
            failed.append(EngineFailure(f"{device}:{k}", "load", exc))
            log.error("engine %s failed to load: %s: %s", f"{device}:{k}", type(exc).__name__, exc,
                      exc_info=not isinstance(exc, REFUSALS))  # a refusal's message says it all
    return engines, failed


def warm_up_engines(engines: Sequence[Engine], settings: Settings, monitor: DeviceMonitor,
                    meter: PoolMeter) -> Started:
    """Every engine in turn on its own GPU (app/engine/warmup.py); one that fails is closed and
    reported, the others keep their sizing. Blocking: call it on a worker thread."""
    started = Started([])
    for engine in engines:
        try:
            sizing = warm_up(engine, settings, monitor, meter)
        except Exception as exc:
            started.failed.append(EngineFailure(engine.info.name, "warm-up", exc))
            log.error("engine %s failed its warm-up: %s", engine.info.name, exc,
                      exc_info=not isinstance(exc, REFUSALS))
            _close(engine)
            continue
        started.engines.append(engine)
        started.sizings.append(sizing)
    return started


def refusal(failed: Sequence[EngineFailure]) -> BaseException:
    """Why the service cannot start when no engine did: the one failure as it was raised (its
    type decides whether ``python -m app`` prints one line or a traceback), or every engine's."""
    if len(failed) == 1:
        return failed[0].exc
    unexpected = [f.exc for f in failed if not isinstance(f.exc, REFUSALS)]
    if unexpected:  # a bug rather than a device: its traceback is wanted
        return unexpected[0]
    return StartupRefused("no engine started: " + "; ".join(f"{f.engine} {f.error}"
                                                              for f in failed))


async def start_engines(settings: Settings, factory: EngineFactory,
                        monitor: DeviceMonitor) -> Started:
    """Load every engine, then warm each up on its device and size its batches (both blocking,
    on a worker thread). Raises one of :data:`~app.engine.loading.REFUSALS` when no engine
    started, or when the model itself is unusable."""
    engines, failed = await asyncio.to_thread(load_engines, settings, factory)
    started = Started(engines)
    if settings.model.warmup and engines:
        try:
            started = await asyncio.to_thread(warm_up_engines, engines, settings, monitor,
                                              pool_meter())
        except BaseException:  # cancelled mid-way: hand back what was loaded
            for e in engines:
                _close(e)
            raise
    started.failed[:0] = failed
    if not started.engines:
        raise refusal(started.failed)
    for f in started.failed:
        log.warning("serving without engine %s: %s", f.engine, f.error)
    return started
