"""What ``scripts/gpu-check`` watches while a step runs, and the process that takes VRAM away.

* :class:`NvmlSampler`: GPU utilisation and used memory from NVML every 0.2 s on a thread of
  the client (mean and peak over the step); on a host without NVML it records nothing.
* :class:`MetricsSampler`: the service's own gauges every 0.25 s (the batch cap, so a halving
  and its regrowth are seen even when they happen between two steps; the CUDA pool's memory,
  which is CTranslate2's allocator; NVML's per-GPU memory as the service reads it).
* :class:`VramHog`: a side process that allocates all but ``keep`` bytes of a GPU's free memory
  with torch and holds it until released: a real out-of-memory condition for the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from typing import Any

from loadtest.lib.service import Client


class NvmlSampler:
    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.util: list[float] = []
        self.used: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self._nvml = None

    def __enter__(self) -> NvmlSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.util.append(float(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu))
                self.used.append(nv.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        if self._nvml is None or not self.util:
            return None
        return {"gpu_util_mean_percent": round(sum(self.util) / len(self.util), 1),
                "gpu_util_max_percent": max(self.util),
                "gpu_busy_fraction": round(sum(u > 0 for u in self.util) / len(self.util), 3),
                "nvml_used_peak_mb": round(max(self.used), 1), "samples": len(self.util)}


class MetricsSampler:
    """Peaks of the service's memory gauges and the batch cap's path over a step."""

    GAUGES = ("batchscribe_device_memory_used_bytes", "batchscribe_engine_memory_bytes")

    def __init__(self, client: Client, interval: float = 0.25) -> None:
        self.client = client
        self.interval = interval
        self.peak: dict[str, float] = {}
        self.caps: list[tuple[float, float]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()

    async def __aenter__(self) -> MetricsSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                m = await self.client.metrics()
                for (name, labels), v in m.items():
                    if name in self.GAUGES:
                        key = f"{name.removeprefix('batchscribe_').removesuffix('_bytes')}{labels}"
                        self.peak[key] = max(self.peak.get(key, 0.0), v)
                cap = m.get(("batchscribe_batch_cap_windows", ""))
                if cap is not None and (not self.caps or self.caps[-1][1] != cap):
                    self.caps.append((round(time.monotonic() - self._t0, 2), cap))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    def summary(self) -> dict[str, Any]:
        caps = [c for _, c in self.caps]
        return {"peak_memory_mb": {k: round(v / 2**20, 1) for k, v in sorted(self.peak.items())},
                "cap_path": self.caps[:40], "cap_min": min(caps, default=None),
                "cap_max": max(caps, default=None)}


HOG = r"""
import sys, torch, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
torch.zeros(1, device="cuda:0")  # this process's own CUDA context first, then what is free
free = pynvml.nvmlDeviceGetMemoryInfo(h).free
take = max(0, free - int(sys.argv[1]))
x = torch.empty(take, dtype=torch.uint8, device="cuda:0")
x.fill_(1)
torch.cuda.synchronize()
print(f"HELD {take} {pynvml.nvmlDeviceGetMemoryInfo(h).free}", flush=True)
sys.stdin.read()
"""


class VramHog:
    """All but ``keep`` bytes of GPU 0's free memory, held by another process until closed."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.held = 0
        self.free_after = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> VramHog:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG, str(self.keep)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("HELD "):
                self.held, self.free_after = (int(x) for x in line.split()[1:3])
                return self
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("the VRAM hog did not start")

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
