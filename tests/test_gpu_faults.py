"""A GPU that fails without running out of memory (issue 33), on the fake GPU (tests/fakegpu.py).

Item 3: a device error (an invalid device ordinal, no kernel image for the card, a driver too
old...) is never an out-of-memory error: the batch cap stays, and the engine is blamed instead
(re-placed batches, strikes, the rotation).

Model-less engines (:class:`~tests.fakegpu.MeterEngine`) draw on the fake's meter behind the real
engine pool and batcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from app.batching.batcher import Batcher
from app.config import BatcherSettings
from app.engine.device import is_device_error, is_oom, is_sticky, may_be_oom
from app.engine.placement import EnginePool, EngineRunner
from app.errors import TranscriptionFailed
from app.metrics import Metrics
from app.windows import DecodeOptions, WindowResult
from tests.fakegpu import DEVICE_ERROR_TEXTS, INVALID_DEVICE_TEXT, OOM_TEXTS, FakeGpu, MeterEngine
from tests.fakes import gather, tagged_window

GREEDY = DecodeOptions(beam_size=1)


# ---- item 3: not every CUDA error is an OOM ----------------------------------------------------
@pytest.mark.parametrize("text", DEVICE_ERROR_TEXTS)
def test_device_errors_are_not_out_of_memory(text: str) -> None:
    exc = RuntimeError(text)
    assert is_device_error(exc) and not is_oom(exc) and not is_sticky(exc)
    assert not is_oom(RuntimeError(f"{text} (out of memory?)"))  # whatever else the text says


def test_only_the_warmup_search_halves_on_what_a_starved_card_may_raise() -> None:
    starved = RuntimeError(INVALID_DEVICE_TEXT)
    assert may_be_oom(starved) and not is_oom(starved)
    assert all(may_be_oom(RuntimeError(t)) for t in OOM_TEXTS)
    assert not may_be_oom(RuntimeError(DEVICE_ERROR_TEXTS[1]))  # no kernel image: never memory


async def run_on_fake_gpus(gpu: FakeGpu, windows: int = 24,
                           ) -> tuple[list[Any], Batcher, EnginePool, Metrics]:
    """``windows`` greedy windows through the real batcher and pool, one MeterEngine per GPU."""
    pool = EnginePool([EngineRunner(MeterEngine(gpu, k)) for k in range(len(gpu.devices))],
                      strikes=3, retry_s=600, unhealthy_after=3)
    metrics = Metrics()
    batcher = Batcher(pool.run, BatcherSettings(max_batch_size=4, max_wait_ms=5, job_memory_mb=0),
                      pool.workers, metrics)
    pool.on_remove = batcher.retire_slots
    batcher.start()
    try:
        results = await gather(batcher.submit("j", [tagged_window(i) for i in range(windows)],
                                              GREEDY))
    finally:
        await batcher.stop(5)
        pool.close()
    return results, batcher, pool, metrics


async def test_an_invalid_device_error_is_no_oom_and_the_other_gpu_takes_its_batches(
        gpu_patch: Callable[..., FakeGpu]) -> None:
    gpu = gpu_patch(totals_mb=(4096, 4096), decode_mb=10, encode_mb=10)
    gpu.devices[1].fault = INVALID_DEVICE_TEXT  # every call on GPU 1 raises it
    results, batcher, pool, metrics = await run_on_fake_gpus(gpu)
    assert all(isinstance(r, WindowResult) for r in results), results  # re-placed on GPU 0
    assert metrics.oom_events._value.get() == 0
    assert metrics.batch_cap._value.get() == 4 == batcher._cap.value  # the cap was not halved
    bad = pool.slots[1]
    assert not bad.in_rotation and INVALID_DEVICE_TEXT in (bad.error or "")  # 3 strikes: out
    assert pool.slots[0].in_rotation and pool.unhealthy() is None


async def test_an_invalid_device_error_on_the_only_gpu_fails_its_windows_not_the_cap(
        gpu_patch: Callable[..., FakeGpu]) -> None:
    gpu = gpu_patch(decode_mb=10, encode_mb=10)
    gpu.devices[0].fault = INVALID_DEVICE_TEXT
    results, batcher, pool, metrics = await run_on_fake_gpus(gpu, windows=8)
    assert all(isinstance(r, TranscriptionFailed) for r in results), results
    assert {r.details["cause"] for r in results} == {"RuntimeError"}  # not "out_of_memory"
    assert metrics.oom_events._value.get() == 0 and batcher._cap.value == 4
    assert metrics.batches.labels("error")._value.get() > 0
    assert INVALID_DEVICE_TEXT in (pool.unhealthy() or "")  # calls keep failing: restart it
