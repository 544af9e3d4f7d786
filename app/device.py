"""The one seam to accelerator specifics: device choice, memory readings, OOM classification.

Everything GPU-only is imported lazily and guarded, so the CPU path never needs CUDA, NVML or a
driver, and tests can inject faults (NVML missing, NVML errors, several GPUs) by passing a fake
``nvml`` module to :class:`DeviceMonitor`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def cuda_device_count() -> int:
    """GPUs CTranslate2 can use (0 when the wheel or driver has no CUDA)."""
    try:
        import ctranslate2

        return int(ctranslate2.get_cuda_device_count())
    except Exception:  # no CUDA runtime at all: that is simply "no GPU"
        return 0


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    return requested


def resolve_compute_type(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    # int8 keeps whisper-base at ~40x realtime on 2 CPU cores; float16 is the GPU sweet spot.
    return "float16" if device == "cuda" else "int8"


def is_oom(exc: BaseException) -> bool:
    """True for the out-of-memory errors the engine can raise on any device.

    CTranslate2 raises ``RuntimeError("... out of memory ...")`` (CUDA and allocator failures),
    torch raises ``torch.cuda.OutOfMemoryError`` (a RuntimeError subclass), and the CPU allocator
    raises ``MemoryError``.
    """
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass(frozen=True)
class MemoryReading:
    device: str  # "cuda:0", "cuda:1", ... or "cpu"
    used_bytes: int
    total_bytes: int


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class DeviceMonitor:
    """Reads device memory: NVML per GPU when available, else torch, else process RSS on CPU."""

    def __init__(self, device: str, nvml: ModuleType | Any | None = None) -> None:
        self.device = device
        self._nvml = nvml
        self._nvml_ok = False
        if device == "cuda":
            self._nvml_ok = self._init_nvml()

    def _init_nvml(self) -> bool:
        try:
            if self._nvml is None:
                import pynvml  # from nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
            return True
        except Exception as exc:  # NVML missing or broken: fall back, say why once
            log.warning("NVML unavailable (%s); using torch.cuda.mem_get_info", exc)
            return False

    def read(self) -> list[MemoryReading]:
        if self.device != "cuda":
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return [MemoryReading("cpu", _rss_bytes(), total)]
        if self._nvml_ok:
            try:
                return self._read_nvml()
            except Exception as exc:
                log.warning("NVML read failed (%s); using torch.cuda.mem_get_info", exc)
        return self._read_torch()

    def _read_nvml(self) -> list[MemoryReading]:
        nv = self._nvml
        assert nv is not None
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            info = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i))
            out.append(MemoryReading(f"cuda:{i}", int(info.used), int(info.total)))
        return out

    def _read_torch(self) -> list[MemoryReading]:
        try:
            import torch

            out = []
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                out.append(MemoryReading(f"cuda:{i}", int(total - free), int(total)))
            return out
        except Exception as exc:
            log.warning("cannot read GPU memory: %s", exc)
            return []
