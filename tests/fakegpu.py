"""A fake GPU that behaves like one, for a machine without one: the whole service runs on it.

What is faked is the device, at the libraries' own boundaries, so the service's code runs as on
a real GPU (whisperx's WhisperModel, the engine, the warm-up, the sizing, the batcher):

* ``ctranslate2.models.Whisper`` -> :class:`FakeWhisper`: the surface the engine uses
  (``encode``, ``detect_language``, ``generate``, ``align``, ``is_multilingual``, ``n_mels``,
  ``device``, ``device_index``...), computed by a real CPU model of the same folder, so
  transcripts are real, while every call draws on a **memory meter**: the weights at load, then
  per call bytes per window (x beam for the decoder) x padded length / 30 s. Past the device's
  memory a call raises the real CUDA out-of-memory texts in turn (:data:`OOM_TEXTS`).
* ``ctranslate2.get_cuda_device_count`` / ``get_supported_compute_types``: the fake's devices.
* ``pynvml``: NVML readings of the fake's devices (used = CUDA context + what the model holds +
  another tenant's pressure), what DeviceMonitor and sizing read on a real GPU.
* :mod:`app.engine.gpumem`'s pool meter: the allocations' current and high-watermark bytes.

Switches: a slow first call per device (CUDA's lazy initialisation), a device fault (every call
on that device raises a device error, e.g. :data:`INVALID_DEVICE_TEXT`: ``FakeDevice.fault``,
``FAKEGPU_FAULT_DEVICES``), and a control file read at every call: ``{"pressure_mb": N}``
(another process takes N MiB: an OOM storm) and ``{"sticky": true}`` (the next call raises an
illegal address, and every call after it, as a lost CUDA context does). Events (first call, OOMs
raised, sticky, faults) go to a JSON-lines file.
Configured from ``FAKEGPU_*`` variables by :func:`install_from_env` (tests/fakegpu_app.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
FULL_FRAMES = 3000  # mel frames of 30 s

# The texts a real GPU raises when memory runs out, each quoted from its source (the classifier
# in app/engine/device.py must recognise every one):
OOM_TEXTS = (
    # CTranslate2 src/cuda/utils.h CUDA_CHECK + cudaGetErrorString(cudaErrorMemoryAllocation)
    "CUDA failed with error out of memory",
    # CTranslate2 CUBLAS_CHECK + cublasGetStatusName (src/cuda/utils.cc)
    "cuBLAS failed with status CUBLAS_STATUS_ALLOC_FAILED",
    # thrust's system_error in CTranslate2's element-wise kernels ("what: category: message")
    "parallel_for failed: cudaErrorMemoryAllocation: out of memory",
    # cuDNN 9 via CUDNN_CHECK (cudnn_graph.h status name)
    "cuDNN failed with status CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)
# What a device that cannot run the call raises, every call (never out of memory: the classifier
# must not count them as OOM). CTranslate2 4.8's align() on a T4 (OpenNMT/CTranslate2#2064):
INVALID_DEVICE_TEXT = "parallel_for failed: cudaErrorInvalidDevice: invalid device ordinal"
DEVICE_ERROR_TEXTS = (
    INVALID_DEVICE_TEXT,
    # a wheel without kernels for the card's architecture (thrust, and CTranslate2's CUDA_CHECK)
    "parallel_for failed: cudaErrorNoKernelImageForDevice: no kernel image is available for "
    "execution on the device",
    "CUDA failed with error no kernel image is available for execution on the device",
    "CUDA failed with error invalid device function",
    "CUDA failed with error CUDA driver version is insufficient for CUDA runtime version",
    "CUDA failed with error initialization error",
    "CUDA error: invalid device ordinal",  # torch's wording
)
# cudaErrorIllegalAddress through CTranslate2's CUDA_CHECK: the context is lost for good.
STICKY_TEXT = "CUDA failed with error an illegal memory access was encountered"


@dataclass
class FakeDevice:
    index: int
    total: int
    context: int  # the CUDA context and libraries: NVML sees it, the pool does not
    allocated: int = 0  # through the pool: weights + calls in flight
    high: int = 0  # the pool's high watermark since the last reset
    sticky: bool = False
    fault: str | None = None  # every call raises this (a device that cannot run the model)
    calls: int = 0
    active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class FakeGpu:
    devices: list[FakeDevice]
    decode_bytes: int  # per 30 s window and beam (attention caches)
    encode_bytes: int  # per 30 s window (activations)
    align_bytes: int  # per 30 s window
    weights_bytes: int = 0  # 0: the size of model.bin
    first_call_s: float = 0.0
    compute_types: tuple[str, ...] = ("float32", "float16", "bfloat16", "int8", "int8_float16",
                                      "int8_float32", "int8_bfloat16")
    control: Path | None = None
    events: Path | None = None
    pressure: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # calls by kind: encode, generate...
    _control_mtime: float = 0.0
    _ooms: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, kind: str, **data: Any) -> None:
        if self.events is not None:
            with self._lock, self.events.open("a") as f:
                f.write(json.dumps({"t": time.time(), "event": kind, **data}) + "\n")

    def _read_control(self, dev: FakeDevice) -> None:
        if self.control is None or not self.control.exists():
            return
        mtime = self.control.stat().st_mtime
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        data = json.loads(self.control.read_text() or "{}")
        self.pressure = int(data.get("pressure_mb", 0)) * MiB
        if data.get("sticky"):
            for d in self.devices:
                d.sticky = True  # armed: the next call on each device raises it

    @contextmanager
    def allocate(self, index: int, nbytes: int, what: str, call: bool = True) -> Any:
        """Hold ``nbytes`` on device ``index`` for the body, or raise the real OOM texts."""
        dev = self.devices[index]
        with dev.lock:
            self._read_control(dev)
            if dev.sticky:
                self.event("sticky", device=index, what=what)
                raise RuntimeError(STICKY_TEXT)
            if dev.fault and call:
                self.event("fault", device=index, what=what, text=dev.fault)
                raise RuntimeError(dev.fault)
            if dev.context + dev.allocated + self.pressure + nbytes > dev.total:
                text = OOM_TEXTS[self._ooms % len(OOM_TEXTS)]
                self._ooms += 1
                self.event("oom", device=index, what=what, bytes=nbytes, text=text)
                raise RuntimeError(text)
            self.counts[what] = self.counts.get(what, 0) + 1
            dev.allocated += nbytes
            dev.high = max(dev.high, dev.allocated)
            dev.active += 1
            first = call and dev.calls == 0
            dev.calls += call
        try:
            if first and self.first_call_s:
                time.sleep(self.first_call_s)  # CUDA's lazy init: cuBLAS handles, kernels
                self.event("first_call", device=index, seconds=self.first_call_s)
            yield
        finally:
            with dev.lock:
                dev.allocated -= nbytes
                dev.active -= 1


FAKE: FakeGpu | None = None


def fake() -> FakeGpu:
    assert FAKE is not None, "install() the fake GPU first"
    return FAKE


class FakeWhisper:
    """``ctranslate2.models.Whisper`` on a fake GPU; a real CPU model computes the answers."""

    def __new__(cls, model_path: str, device: str = "cpu", **kw: Any) -> Any:
        if device != "cuda":  # the CPU path is the real one
            return _REAL_WHISPER(model_path, device, **kw)
        return super().__new__(cls)

    def __init__(self, model_path: str, device: str = "cpu", *, device_index: Any = 0,
                 compute_type: Any = "default", inter_threads: int = 1, intra_threads: int = 0,
                 **kw: Any) -> None:
        gpu = fake()
        index = device_index[0] if isinstance(device_index, list) else int(device_index)
        if index >= len(gpu.devices):
            raise RuntimeError("CUDA failed with error invalid device ordinal")
        ct = "float16" if compute_type in ("default", "auto") else str(compute_type)
        if ct not in gpu.compute_types:  # CTranslate2's own text (src/utils.cc)
            raise ValueError(f"Requested {ct} compute type, but the target device or backend do "
                             f"not support efficient {ct} computation.")
        self.device, self.device_index, self.compute_type = "cuda", [index], ct
        self.num_workers, self.tensor_parallel = inter_threads, False
        self._index = index
        self._cpu = _REAL_WHISPER(model_path, "cpu", compute_type="int8",
                                  inter_threads=inter_threads, intra_threads=1)
        weights = gpu.weights_bytes or os.path.getsize(os.path.join(model_path, "model.bin"))
        self._weights = gpu.allocate(index, weights, "weights", call=False)
        self._weights.__enter__()  # held until unload: the resident model

    # ---- what the engine reads ---------------------------------------------------------------
    @property
    def is_multilingual(self) -> bool:
        return bool(self._cpu.is_multilingual)

    @property
    def n_mels(self) -> int:
        return int(self._cpu.n_mels)

    @property
    def num_languages(self) -> int:
        return int(self._cpu.num_languages)

    def model_is_loaded(self) -> bool:
        return True

    def unload_model(self, to_cpu: bool = False) -> None:
        self._weights.__exit__(None, None, None)

    # ---- calls, each drawing on the meter -----------------------------------------------------
    def _bytes(self, features: Any, per_window: int, beam: int = 1) -> int:
        """Mel features [n, n_mels, frames] or an encoder output [n, frames / 2, d_model]."""
        n, a, b = (int(d) for d in features.shape)
        frames = b if a == self.n_mels else 2 * a
        return n * beam * per_window * frames // FULL_FRAMES

    def encode(self, features: Any, to_cpu: bool = False) -> Any:
        with fake().allocate(self._index, self._bytes(features, fake().encode_bytes), "encode"):
            return self._cpu.encode(features, to_cpu=to_cpu)

    def detect_language(self, features: Any) -> Any:
        with fake().allocate(self._index, self._bytes(features, fake().encode_bytes // 8),
                             "detect_language"):
            return self._cpu.detect_language(features)

    def generate(self, features: Any, prompts: Any, **kw: Any) -> Any:
        beam = int(kw.get("beam_size", 5))
        with fake().allocate(self._index, self._bytes(features, fake().decode_bytes, beam),
                             "generate"):
            return self._cpu.generate(features, prompts, **kw)

    def align(self, features: Any, start_sequence: Any, text_tokens: Any, num_frames: Any,
              **kw: Any) -> Any:
        with fake().allocate(self._index, self._bytes(features, fake().align_bytes), "align"):
            return self._cpu.align(features, start_sequence, text_tokens, num_frames, **kw)


def fake_nvml(gpu: FakeGpu) -> types.ModuleType:
    """The part of ``pynvml`` the service reads, backed by the fake's devices."""
    nv = types.ModuleType("pynvml")

    def memory(h: FakeDevice) -> Any:
        used = h.context + h.allocated + gpu.pressure
        return types.SimpleNamespace(total=h.total, used=used, free=h.total - used)

    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: len(gpu.devices)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: gpu.devices[i]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByUUID = lambda u: gpu.devices[int(u.rsplit("-", 1)[1])]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=h.context + h.allocated)]
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        gpu=100 if h.active else 0, memory=0)
    return nv


class FakePools:
    """app.engine.gpumem.PoolMeter over the fake's devices."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def used(self, index: int) -> int | None:
        return self.gpu.devices[index].allocated

    def peak(self, index: int) -> int | None:
        return self.gpu.devices[index].high

    def reset(self, index: int) -> None:
        dev = self.gpu.devices[index]
        with dev.lock:
            dev.high = dev.allocated


_REAL_WHISPER: Any = None


def install(gpu: FakeGpu) -> FakeGpu:
    """Put the fake in place of the GPU at the libraries' boundaries (see the module doc)."""
    import sys

    import ctranslate2

    from app.engine.gpumem import use_pool_meter

    global FAKE, _REAL_WHISPER
    FAKE = gpu
    if _REAL_WHISPER is None:
        _REAL_WHISPER = ctranslate2.models.Whisper
    real_types = ctranslate2.get_supported_compute_types

    def supported(device: str, device_index: int = 0) -> set[str]:
        if device != "cuda":
            return set(real_types(device, device_index))
        if device_index >= len(gpu.devices):
            raise RuntimeError("CUDA failed with error invalid device ordinal")
        return set(gpu.compute_types)

    ctranslate2.models.Whisper = FakeWhisper
    ctranslate2.get_cuda_device_count = lambda: len(gpu.devices)
    ctranslate2.get_supported_compute_types = supported
    sys.modules["pynvml"] = fake_nvml(gpu)
    use_pool_meter(FakePools(gpu))
    return gpu


def install_from_env(env: dict[str, str] | None = None) -> FakeGpu:
    e = os.environ if env is None else env

    def mb(key: str, default: str) -> int:
        return int(float(e.get(key) or default) * MiB)

    gpus = int(e.get("FAKEGPU_GPUS", "1"))
    totals = [mb("FAKEGPU_TOTAL_MB", "4096")] * gpus
    for k, t in enumerate(e.get("FAKEGPU_TOTALS_MB", "").split(",")):
        if t.strip() and k < gpus:
            totals[k] = int(float(t) * MiB)
    devices = [FakeDevice(k, totals[k], mb("FAKEGPU_CONTEXT_MB", "300")) for k in range(gpus)]
    for k in (int(d) for d in e.get("FAKEGPU_FAULT_DEVICES", "").split(",") if d.strip()):
        devices[k].fault = e.get("FAKEGPU_FAULT_TEXT", INVALID_DEVICE_TEXT)
    types_ = tuple(t for t in e.get("FAKEGPU_COMPUTE_TYPES", "").split(",") if t)
    gpu = FakeGpu(
        devices=devices, decode_bytes=mb("FAKEGPU_DECODE_MB", "100"),
        encode_bytes=mb("FAKEGPU_ENCODE_MB", "50"), align_bytes=mb("FAKEGPU_ALIGN_MB", "20"),
        weights_bytes=mb("FAKEGPU_WEIGHTS_MB", "0"),
        first_call_s=float(e.get("FAKEGPU_FIRST_CALL_S", "0")),
        control=Path(e["FAKEGPU_CONTROL"]) if e.get("FAKEGPU_CONTROL") else None,
        events=Path(e["FAKEGPU_EVENTS"]) if e.get("FAKEGPU_EVENTS") else None,
    )
    if types_:
        gpu.compute_types = types_
    return install(gpu)


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MeterEngine:
    """An engine without a model for fast tests of warm-up and sizing: each batch draws on a
    fake device's meter as the real one would (the encoder's output, per window, is held while
    the decoder's caches, per window x beam, are allocated) and returns an empty result per
    window. ``meet``: concurrent batches meet while holding their memory (a barrier of that many
    parties, given up after 2 s when alone), so "every worker at once" overlaps for certain."""

    def __init__(self, gpu: FakeGpu, index: int = 0, workers: int = 2,
                 fail: BaseException | None = None, meet: int = 0) -> None:
        from app.engine import EngineInfo

        self.gpu, self.index, self.fail = gpu, index, fail
        self.info = EngineInfo("fake", "cuda", "float16", workers, index)
        self.batches: list[tuple[int, Any]] = []
        self._meet = threading.Barrier(meet) if meet > 1 else None
        self._weights = gpu.allocate(index, gpu.weights_bytes, "weights", call=False)
        self._weights.__enter__()

    def transcribe_batch(self, windows: Any, options: Any) -> list[Any]:
        from app.windows import WindowResult

        self.batches.append((len(windows), options))
        if self.fail is not None:
            raise self.fail
        n, g = len(windows), self.gpu
        with g.allocate(self.index, n * g.encode_bytes, "encode"), \
                g.allocate(self.index, n * options.beam_size * g.decode_bytes, "generate"):
            if self._meet is not None:
                try:
                    self._meet.wait(2.0)
                except threading.BrokenBarrierError:
                    self._meet.reset()
        return [WindowResult("", w.prompt.language or "en", None, -0.1, 0.0, 1.0)
                for w in windows]

    def close(self) -> None:
        self._weights.__exit__(None, None, None)
