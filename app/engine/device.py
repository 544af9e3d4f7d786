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
    device: str  # "cuda:0", "cuda:1", ... (CUDA ordinals, as the engine numbers them) or "cpu"
    used_bytes: int  # all processes on the device (cpu: the container's or the host's memory)
    total_bytes: int
    process_bytes: int | None = None  # what this process holds there; None when unknown


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # missing, or "max" (no limit)
        return None


def host_memory(cgroup: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> tuple[int, int]:
    """(used, total) bytes of the memory this process may use: its cgroup v2 limit if it has one
    (a container: what the OOM killer counts), else the host's (MemTotal - MemAvailable)."""
    limit = _read_int(f"{cgroup}/memory.max")
    current = _read_int(f"{cgroup}/memory.current")
    if limit is not None and current is not None:
        return current, limit
    fields: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, total - fields.get("MemAvailable", total)), total


class DeviceMonitor:
    """Reads device memory: NVML per GPU when available, else torch, else host memory on CPU.

    Called on every ``/metrics`` scrape, on the event loop: each reading is a few cheap NVML or
    /proc calls, never a lock the engine holds. A failure is logged once (not on every scrape)
    and falls back; the next successful NVML read is logged as a recovery.

    GPUs are those CUDA sees, numbered as CUDA numbers them: when ``CUDA_VISIBLE_DEVICES`` is set
    (indices or ``GPU-`` UUIDs) only those, in that order, else every GPU NVML reports.
    """

    def __init__(self, device: str, nvml: ModuleType | Any | None = None, pid: int | None = None,
                 visible: str | None = None) -> None:
        self.device = device
        self.pid = pid or os.getpid()
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        self._nvml = nvml
        self._nvml_ok = False
        self._failing: set[str] = set()  # failures already logged: each is logged once
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
            used, total = host_memory()
            return [MemoryReading("cpu", used, total, _rss_bytes())]
        if self._nvml_ok:
            try:
                out = self._read_nvml()
                if "nvml" in self._failing:
                    log.info("NVML readings work again")
                    self._failing.discard("nvml")
                return out
            except Exception as exc:
                self._warn_once("nvml", f"NVML read failed ({exc}); using torch.cuda.mem_get_info")
        return self._read_torch()

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._failing:
            log.warning(message)
            self._failing.add(kind)

    def _handles(self) -> list[Any]:
        nv = self._nvml
        assert nv is not None
        if self._visible is None:
            return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        handles = []
        for token in (t.strip() for t in self._visible.split(",")):
            if token.isdigit():
                handles.append(nv.nvmlDeviceGetHandleByIndex(int(token)))
            elif token.startswith(("GPU-", "MIG-")):
                handles.append(nv.nvmlDeviceGetHandleByUUID(token))
            else:  # CUDA ignores this entry and every one after it
                break
        return handles

    def _read_nvml(self) -> list[MemoryReading]:
        nv = self._nvml
        assert nv is not None
        out = []
        for k, handle in enumerate(self._handles()):
            info = nv.nvmlDeviceGetMemoryInfo(handle)
            out.append(MemoryReading(f"cuda:{k}", int(info.used), int(info.total),
                                     self._process_bytes(handle)))
        return out

    def _process_bytes(self, handle: Any) -> int | None:
        """This process's memory on the GPU, or None when NVML cannot say (e.g. in a container
        NVML reports host PIDs, which do not match ours)."""
        nv = self._nvml
        assert nv is not None
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        for proc in procs:
            if proc.pid == self.pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def _read_torch(self) -> list[MemoryReading]:
        try:
            import torch

            out = []
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                out.append(MemoryReading(f"cuda:{i}", int(total - free), int(total)))
            self._failing.discard("torch")
            return out
        except Exception as exc:
            self._warn_once("torch", f"cannot read GPU memory: {exc}")
            return []
