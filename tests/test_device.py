"""Device memory readings under fault injection: no GPU, NVML missing or failing, two GPUs.

A fake ``pynvml`` module stands in for NVML (and a fake ``torch`` for its fallback), so these
run on any machine; the same code path reads real GPUs in production.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.engine.device import DeviceMonitor, MemoryReading, host_memory, is_oom
from app.metrics import Metrics

GiB = 1 << 30


class NVMLError(Exception):
    pass


@dataclass
class Gpu:
    uuid: str
    total: int
    used: int
    procs: dict[int, int | None]  # pid -> used bytes (None: NVML does not know)


@dataclass
class Mem:
    total: int
    used: int
    free: int


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None  # NVML's field name


class FakeNvml:
    """The subset of pynvml that DeviceMonitor uses, with switches to inject faults."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[Gpu], init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.read_error: str | None = None
        self.procs_error: str | None = None
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Gpu:
        if i >= len(self.gpus):
            raise NVMLError("Invalid Argument")
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise NVMLError("Not Found")

    def nvmlDeviceGetMemoryInfo(self, h: Gpu) -> Mem:
        self.calls.append("meminfo")
        if self.read_error:
            raise NVMLError(self.read_error)
        return Mem(h.total, h.used, h.total - h.used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Gpu) -> list[Proc]:
        if self.procs_error:
            raise NVMLError(self.procs_error)
        return [Proc(pid, b) for pid, b in h.procs.items()]


def two_gpus() -> list[Gpu]:
    me = os.getpid()
    return [Gpu("GPU-aaaa", 16 * GiB, 3 * GiB, {me + 1: 2 * GiB}),  # someone else's process
            Gpu("GPU-bbbb", 24 * GiB, 5 * GiB, {me: 4 * GiB, me + 1: 1 * GiB})]


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A torch whose CUDA reports what the test sets (``gpus``: list of (free, total))."""
    state = types.SimpleNamespace(gpus=[], calls=0)

    def mem_get_info(i: int) -> tuple[int, int]:
        state.calls += 1
        return state.gpus[i]

    cuda = types.SimpleNamespace(device_count=lambda: len(state.gpus), mem_get_info=mem_get_info)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    return state


def test_cpu_never_touches_nvml_and_reports_host_memory_and_rss() -> None:
    nv = FakeNvml(two_gpus())
    readings = DeviceMonitor("cpu", nvml=nv).read()
    assert nv.calls == []
    [r] = readings
    assert r.device == "cpu"
    assert 0 < r.used_bytes <= r.total_bytes
    assert r.process_bytes is not None and 0 < r.process_bytes <= r.total_bytes


def test_two_gpus_each_reported_with_this_process_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU NVML sees
    m = DeviceMonitor("cuda", nvml=FakeNvml(two_gpus()))
    assert m.read() == [
        MemoryReading("cuda:0", 3 * GiB, 16 * GiB, None),  # our pid holds nothing there
        MemoryReading("cuda:1", 5 * GiB, 24 * GiB, 4 * GiB),
    ]


@pytest.mark.parametrize(("visible", "expected"), [
    ("1", [("cuda:0", 24)]),  # CUDA renumbers: physical GPU 1 is the engine's cuda:0
    ("1,0", [("cuda:0", 24), ("cuda:1", 16)]),
    ("GPU-aaaa", [("cuda:0", 16)]),
    ("0,bogus,1", [("cuda:0", 16)]),  # CUDA ignores an invalid entry and all after it
    ("", []),  # no GPU visible
])
def test_cuda_visible_devices_is_honoured(visible: str, expected: list[tuple[str, int]]) -> None:
    readings = DeviceMonitor("cuda", nvml=FakeNvml(two_gpus()), visible=visible).read()
    assert [(r.device, r.total_bytes // GiB) for r in readings] == expected


def test_env_cuda_visible_devices_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    [r] = DeviceMonitor("cuda", nvml=FakeNvml(two_gpus())).read()
    assert (r.device, r.total_bytes) == ("cuda:0", 24 * GiB)


def test_nvml_missing_falls_back_to_torch(fake_torch: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake_torch.gpus = [(6 * GiB, 8 * GiB)]
    nv = FakeNvml(two_gpus(), init_error="NVML Shared Library Not Found")
    with caplog.at_level(logging.WARNING, "app.engine.device"):
        mon = DeviceMonitor("cuda", nvml=nv, visible="")
        assert mon.read() == [MemoryReading("cuda:0", 2 * GiB, 8 * GiB, None)]
        assert mon.read() == [MemoryReading("cuda:0", 2 * GiB, 8 * GiB, None)]
    assert "meminfo" not in nv.calls  # never used NVML after a failed init
    assert [r.message for r in caplog.records].count(
        "NVML unavailable (NVML Shared Library Not Found); using torch.cuda.mem_get_info") == 1


def test_gpu_absent_driver_not_loaded_reads_nothing(fake_torch: Any) -> None:
    fake_torch.gpus = []  # CPU-only torch: no CUDA device
    mon = DeviceMonitor("cuda", nvml=FakeNvml([], init_error="Driver Not Loaded"), visible="")
    assert mon.read() == []


def test_nvml_read_error_falls_back_logs_once_and_recovers(
    fake_torch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake_torch.gpus = [(10 * GiB, 16 * GiB), (20 * GiB, 24 * GiB)]
    nv = FakeNvml(two_gpus())
    mon = DeviceMonitor("cuda", nvml=nv, visible="0,1")
    nv.read_error = "GPU is lost"
    with caplog.at_level(logging.INFO, "app.engine.device"):
        for _ in range(3):  # every scrape falls back, but the log says it once
            assert [(r.device, r.used_bytes) for r in mon.read()] == [
                ("cuda:0", 6 * GiB), ("cuda:1", 4 * GiB)]
        nv.read_error = None
        assert [r.used_bytes for r in mon.read()] == [3 * GiB, 5 * GiB]  # NVML again
        nv.read_error = "Unknown Error"
        mon.read()
    msgs = [r.message for r in caplog.records]
    assert sum("NVML read failed (GPU is lost)" in m for m in msgs) == 1
    assert msgs.count("NVML readings work again") == 1
    assert sum("NVML read failed (Unknown Error)" in m for m in msgs) == 1


def test_nvml_and_torch_both_failing_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.SimpleNamespace(cuda=types.SimpleNamespace(
        device_count=lambda: 1, mem_get_info=lambda i: (_ for _ in ()).throw(RuntimeError("x"))))
    monkeypatch.setitem(sys.modules, "torch", broken)
    nv = FakeNvml(two_gpus())
    nv.read_error = "Unknown Error"
    assert DeviceMonitor("cuda", nvml=nv, visible="0").read() == []


def test_per_process_query_unsupported_keeps_used_and_total() -> None:
    nv = FakeNvml(two_gpus())
    nv.procs_error = "Not Supported"
    readings = DeviceMonitor("cuda", nvml=nv, visible="0,1").read()
    assert [(r.used_bytes, r.process_bytes) for r in readings] == [(3 * GiB, None), (5 * GiB, None)]


def test_metrics_expose_two_gpus_and_engine_share() -> None:
    m = Metrics()
    m.record_memory(DeviceMonitor("cuda", nvml=FakeNvml(two_gpus()), visible="0,1").read())
    text = generate_latest(m.registry).decode()
    got = {(s.name, s.labels.get("device")): s.value
           for f in text_string_to_metric_families(text) for s in f.samples
           if s.name.startswith(("batchscribe_device_memory", "batchscribe_engine_memory"))}
    assert got == {
        ("batchscribe_device_memory_used_bytes", "cuda:0"): 3 * GiB,
        ("batchscribe_device_memory_used_bytes", "cuda:1"): 5 * GiB,
        ("batchscribe_device_memory_total_bytes", "cuda:0"): 16 * GiB,
        ("batchscribe_device_memory_total_bytes", "cuda:1"): 24 * GiB,
        ("batchscribe_engine_memory_bytes", "cuda:1"): 4 * GiB,  # unknown on cuda:0: no series
    }


def test_host_memory_prefers_the_cgroup_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert host_memory(str(tmp_path), "/nonexistent") == (1 * GiB, 4 * GiB)


def test_host_memory_without_a_limit_reads_meminfo(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\nMemFree:  1 kB\nMemAvailable:   6291456 kB\n")
    assert host_memory(str(tmp_path), str(meminfo)) == (2 * GiB, 8 * GiB)


@pytest.mark.parametrize(("exc", "oom"), [
    (MemoryError(), True),
    (RuntimeError("CUDA failed with error out of memory"), True),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate"), True),
    (RuntimeError("cuDNN error"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom(exc: BaseException, oom: bool) -> None:
    assert is_oom(exc) is oom
