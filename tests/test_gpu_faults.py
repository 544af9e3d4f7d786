"""A GPU that fails without running out of memory (issue 33), on the fake GPU (tests/fakegpu.py).

Item 3: a device error (an invalid device ordinal, no kernel image for the card, a driver too
old...) is never an out-of-memory error: the batch cap stays, and the engine is blamed instead
(re-placed batches, strikes, the rotation). Item 5: one GPU of two that fails its load or
warm-up is left out; the service starts, serves on the other and reports the failed one in
``/readyz`` and the ``engine_up`` gauge; with none left the start is refused as before.

Model-less engines (:class:`~tests.fakegpu.MeterEngine`) draw on the fake's meter behind the real
engine pool and batcher, and for the start behind the real lifespan (``create_app``). The same
over HTTP with the real model on a fake GPU: tests/test_gpu_service.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.batching.batcher import Batcher
from app.config import BatcherSettings, Settings
from app.engine import Engine
from app.engine.device import DeviceMonitor, is_device_error, is_oom, is_sticky, may_be_oom
from app.engine.loading import DeviceUnavailable, StartupRefused
from app.engine.placement import EnginePool, EngineRunner
from app.engine.startup import start_engines
from app.engine.warmup import WarmupFailed
from app.errors import TranscriptionFailed
from app.main import create_app
from app.metrics import Metrics
from app.windows import DecodeOptions, WindowResult
from loadtest.lib.corpus import Clip
from models.registry import ModelUnavailable
from tests.fakegpu import DEVICE_ERROR_TEXTS, INVALID_DEVICE_TEXT, OOM_TEXTS, FakeGpu, MeterEngine
from tests.fakes import gather, tagged_window
from tests.helpers import serve, value, wait_done

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
    # 96 windows (24 batches), so GPU 1 is handed its three strikes whichever GPU frees up
    # first: with 24 (6 batches) it got only two in 3 of 25 runs on a loaded host.
    results, batcher, pool, metrics = await run_on_fake_gpus(gpu, windows=96)
    assert all(isinstance(r, WindowResult) for r in results), results  # re-placed on GPU 0
    assert metrics.oom_events._value.get() == 0
    assert metrics.batch_cap._value.get() == 4 == batcher.cap  # the cap was not halved
    bad = pool.slots[1]
    assert not bad.in_rotation and INVALID_DEVICE_TEXT in (bad.error or "")  # 3 strikes: out
    assert pool.slots[0].in_rotation and pool.unhealthy() is None


async def test_an_invalid_device_error_on_the_only_gpu_fails_its_windows_not_the_cap(
        gpu_patch: Callable[..., FakeGpu]) -> None:
    gpu = gpu_patch(decode_mb=10, encode_mb=10)
    gpu.devices[0].fault = INVALID_DEVICE_TEXT
    results, batcher, pool, metrics = await run_on_fake_gpus(gpu, windows=8)
    assert all(isinstance(r, TranscriptionFailed) for r in results), results
    assert {r.details["cause"] for r in results} == {"engine_error"}  # not "out_of_memory"
    assert metrics.oom_events._value.get() == 0 and batcher.cap == 4
    assert metrics.batches.labels("error")._value.get() > 0
    assert INVALID_DEVICE_TEXT in (pool.unhealthy() or "")  # calls keep failing: restart it


# ---- item 5: one GPU that fails its start does not take the others down ------------------------
def meter_factory(gpu: FakeGpu, made: list[MeterEngine],
                  load_fails: dict[int, Exception] | None = None) -> Callable[[Settings], Engine]:
    def factory(settings: Settings) -> Engine:
        k = settings.model.device_index
        if load_fails and k in load_fails:
            raise load_fails[k]
        made.append(MeterEngine(gpu, k))
        return made[-1]

    return factory


def gpu_settings(tmp: Path, gpus: int) -> Settings:
    """``gpus`` engines on the fake, warmed up; the batch bounded to 4 so the warm-up's
    synthetic windows stay few."""
    return Settings(storage={"data_dir": tmp}, shutdown_grace_s=5,  # type: ignore[arg-type]
                    model={"device": "cuda", "engines": gpus, "vad": "silero"},  # type: ignore[arg-type]
                    batcher={"max_batch_size": 4})  # type: ignore[arg-type]


def test_a_gpu_failing_its_warmup_is_left_out_and_the_other_serves(
        gpu_patch: Callable[..., FakeGpu], tmp_path: Path, clips: list[Clip]) -> None:
    gpu = gpu_patch(totals_mb=(4096, 4096), decode_mb=10, encode_mb=10)
    gpu.devices[1].fault = INVALID_DEVICE_TEXT
    made: list[MeterEngine] = []
    app = create_app(gpu_settings(tmp_path, 2), engine_factory=meter_factory(gpu, made))
    clip = min((c for c in clips if c.duration_s >= 5), key=lambda c: c.duration_s)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        ready = client.get("/readyz")
        warmed = [len(e.batches) for e in made]
        r = client.post("/transcribe", files={"file": (clip.path.name, clip.path.read_bytes())},
                        data={"language": "en"})
        assert r.status_code == 202, r.text
        job = wait_done(client, r.json()["id"])
        metrics = client.get("/metrics").text
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    engines = {e["engine"]: e for e in ready.json()["engines"]}
    assert engines["cuda:0"]["started"] and engines["cuda:0"]["in_rotation"]
    failed = engines["cuda:1"]
    assert not failed["started"] and not failed["in_rotation"]
    assert failed["error"].startswith("warm-up failed: WarmupFailed") and \
        INVALID_DEVICE_TEXT in failed["error"]
    assert [s["engine"] for s in ready.json()["sizing"]["engines"]] == ["cuda:0"]
    assert job["status"] == "done", job
    assert len(made[0].batches) > warmed[0] and len(made[1].batches) == warmed[1]  # GPU 0 only
    assert value(metrics, "batchscribe_engine_up", engine="cuda:0") == 1
    assert value(metrics, "batchscribe_engine_up", engine="cuda:1") == 0
    assert 'batchscribe_engine_up{engine="cuda:1"} 0.0' in metrics  # present, not absent


async def test_a_gpu_failing_its_load_is_left_out_even_the_first(
        gpu_patch: Callable[..., FakeGpu], tmp_path: Path) -> None:
    gpu = gpu_patch(totals_mb=(4096, 4096), decode_mb=10, encode_mb=10)
    made: list[MeterEngine] = []
    dead = DeviceUnavailable("cannot load fake on cuda:0: RuntimeError: CUDA failed with error "
                             "initialization error")
    started = await start_engines(gpu_settings(tmp_path, 2), meter_factory(gpu, made, {0: dead}),
                                  DeviceMonitor("cuda"))
    assert [e.info.name for e in started.engines] == ["cuda:1"] and len(started.sizings) == 1
    [failure] = started.failed
    assert (failure.engine, failure.stage, failure.exc) == ("cuda:0", "load", dead)
    for e in started.engines:
        e.close()


@pytest.mark.parametrize("gpus", [1, 2])
async def test_with_no_gpu_left_the_start_is_refused_with_every_reason(
        gpu_patch: Callable[..., FakeGpu], tmp_path: Path, gpus: int) -> None:
    gpu = gpu_patch(totals_mb=(4096,) * gpus, decode_mb=10, encode_mb=10, weights_bytes=500 << 20)
    for d in gpu.devices:
        d.fault = INVALID_DEVICE_TEXT
    made: list[MeterEngine] = []
    with pytest.raises(StartupRefused) as info:
        await start_engines(gpu_settings(tmp_path, gpus), meter_factory(gpu, made),
                            DeviceMonitor("cuda"))
    if gpus == 1:  # as before: the warm-up's own refusal
        assert isinstance(info.value, WarmupFailed) and "on cuda:0" in str(info.value)
    else:
        assert str(info.value).startswith("no engine started: cuda:0 warm-up failed")
        assert "cuda:1 warm-up failed" in str(info.value)
    assert INVALID_DEVICE_TEXT in str(info.value)
    assert all(d.allocated == 0 for d in gpu.devices)  # every failed engine was closed


async def test_an_unusable_model_refuses_at_the_first_engine(
        gpu_patch: Callable[..., FakeGpu], tmp_path: Path) -> None:
    gpu_patch(totals_mb=(4096, 4096))
    tried: list[int] = []

    def factory(settings: Settings) -> Engine:
        tried.append(settings.model.device_index)
        raise ModelUnavailable("the model in /models/x takes 128 mel bins but ...")

    with pytest.raises(ModelUnavailable):
        await start_engines(gpu_settings(tmp_path, 2), factory, DeviceMonitor("cuda"))
    assert tried == [0]  # every GPU would fail the same way, each after loading the weights
