"""The one seam to accelerator specifics: device choice and order, compute types, memory
readings, error classification (out of memory, sticky CUDA errors).

Everything GPU-only is imported lazily and guarded, so the CPU path never needs CUDA, NVML or a
driver, and tests can inject faults (NVML missing, NVML errors, several GPUs) by passing a fake
``nvml`` module to :class:`DeviceMonitor`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def use_pci_bus_order() -> str:
    """Number GPUs as NVML does (by PCI bus id) rather than CUDA's default FASTEST_FIRST.

    Must run before CUDA initialises (the first CTranslate2 or torch CUDA call): engine k runs
    on CUDA ordinal k, and the memory readings, utilisation and sizing read NVML's device k.
    With FASTEST_FIRST on a host with mixed GPUs those are different devices. An operator's
    explicit choice is kept (and warned about)."""
    order = os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if order != "PCI_BUS_ID":
        log.warning("CUDA_DEVICE_ORDER=%s: NVML numbers GPUs by PCI bus id, so memory readings "
                    "and sizing may be attributed to the wrong GPU on a mixed host", order)
    return order


def cuda_device_count() -> int:
    """GPUs CTranslate2 can use (0 when the wheel or driver has no CUDA)."""
    try:
        import ctranslate2

        return int(ctranslate2.get_cuda_device_count())
    except Exception:  # no CUDA runtime at all: that is simply "no GPU"
        return 0


def cuda_unavailable_reason() -> str:
    """Why CTranslate2 sees no GPU, in the library's own words where it has some: on this
    (driverless) machine "CUDA failed with error CUDA driver version is insufficient for CUDA
    runtime version"; on a host whose GPUs are hidden, "... no CUDA-capable device is detected"."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import ctranslate2

        ctranslate2.get_supported_compute_types("cuda", 0)
    except Exception as exc:
        return str(exc)
    if visible is not None:
        return f"no GPU visible (CUDA_VISIBLE_DEVICES={visible!r})"
    return "no GPU visible"


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    return requested


# Preferred compute types, best first. GPU: float16 is Whisper's native precision and what
# tensor cores run; bfloat16 where float16 is not efficient; the int8 mixes for cards without
# either (e.g. Pascal). CPU: int8 (measured here: whisper-base at ~40x realtime on 2 cores).
PREFERRED_COMPUTE = {
    "cuda": ("float16", "bfloat16", "int8_float16", "int8_bfloat16", "int8_float32", "int8",
             "float32"),
    "cpu": ("int8", "int8_float32", "float32"),
}


class UnsupportedComputeType(ValueError):
    pass


def supported_compute_types(device: str, index: int = 0) -> set[str]:
    """What CTranslate2 can run efficiently on this device (``get_supported_compute_types``)."""
    import ctranslate2

    return set(ctranslate2.get_supported_compute_types(device, index))


def resolve_compute_type(requested: str, device: str, index: int = 0) -> str:
    """``auto``: the first of :data:`PREFERRED_COMPUTE` the device supports. An explicit type the
    device cannot run is refused here, naming the ones it can (CTranslate2's own error says only
    "do not support efficient float16 computation")."""
    try:
        supported = supported_compute_types(device, index)
    except Exception:  # no CUDA at all: the load reports that with the library's message
        supported = set()
    if requested == "auto":
        for ct in PREFERRED_COMPUTE.get(device, ()):
            if ct in supported:
                return ct
        return "float16" if device == "cuda" else "int8"
    if supported and requested not in supported and requested != "default":
        raise UnsupportedComputeType(
            f"compute_type {requested} is not supported on {device}:{index} (supported: "
            f"{', '.join(sorted(supported))}); set BATCHSCRIBE_MODEL__COMPUTE_TYPE=auto")
    return requested


def torch_device(device: str, index: int = 0) -> str:
    """Where torch work for engine ``index`` belongs (batched mel): its GPU when torch sees one,
    else the CPU (a CPU-only torch, or a fake GPU in tests)."""
    if device == "cuda":
        try:
            from app.engine.threads import load_torch

            torch = load_torch()  # at the engine's thread count (limit_pools ran before)
            if torch.cuda.is_available() and index < torch.cuda.device_count():
                return f"cuda:{index}"
        except Exception:
            pass
    return "cpu"


# ---- errors ------------------------------------------------------------------------------------
# Out-of-memory texts, lower-cased, each as its library writes it:
OOM_TEXTS = (
    # CTranslate2 CUDA_CHECK (src/cuda/utils.h) + cudaGetErrorString(cudaErrorMemoryAllocation):
    # "CUDA failed with error out of memory"; thrust (CTranslate2's element-wise kernels):
    # "parallel_for failed: cudaErrorMemoryAllocation: out of memory"; torch:
    # "CUDA out of memory. Tried to allocate ..." and "CUDA error: out of memory".
    "out of memory",
    "cudaerrormemoryallocation",
    # CTranslate2 CUBLAS_CHECK + cublasGetStatusName (src/cuda/utils.cc):
    # "cuBLAS failed with status CUBLAS_STATUS_ALLOC_FAILED".
    "cublas_status_alloc_failed",
    # cuDNN (CTranslate2 CUDNN_CHECK "cuDNN failed with status ...", torch "cuDNN error: ...")
    # via cudnnGetErrorString: cuDNN 8 "CUDNN_STATUS_ALLOC_FAILED"; cuDNN 9 (cudnn_graph.h)
    # "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED" / "..._HOST_ALLOCATION_FAILED".
    "cudnn_status_alloc_failed",
    "_allocation_failed",
    # torch's cuFFT (mel on the GPU): "cuFFT error: CUFFT_ALLOC_FAILED".
    "cufft_alloc_failed",
    # CTranslate2's CPU allocator (src/cpu/allocator.cc): "mkl_malloc: failed to allocate
    # memory", "aligned_alloc: failed to allocate memory"; src/storage_view.cc: "failed to
    # allocated memory" (sic).
    "failed to allocate memory",
    "failed to allocated memory",
)

# A device that cannot run this code at all, whatever the batch: cudaGetErrorString texts as
# CTranslate2's CUDA_CHECK ("CUDA failed with error ..."), thrust ("parallel_for failed:
# cudaErrorX: ...") and torch ("CUDA error: ...") wrap them. Never out of memory, even when a text
# also matches one of OOM_TEXTS: halving the batch cap cannot help, so it would halve for good.
# They go the way of any engine error: the batch is re-placed, the engine takes a strike (and
# leaves the rotation after a few), and calls that fail everywhere make /healthz unhealthy.
DEVICE_ERROR_TEXTS = (
    # cudaErrorInvalidDevice. Thrust raised it for a starved card in homelab-00/TranscriptionSuite
    # #268 (alternating with "out of memory"), but CTranslate2 4.8's align() raises it on a T4
    # with memory to spare, every call (OpenNMT/CTranslate2#2064, CCCL 2.7 in place of Thrust
    # 1.12): counted as OOM, that halved the cap to 1 and kept it there.
    "invalid device ordinal",
    "cudaerrorinvaliddevice",
    "no kernel image is available for execution on the device",  # cudaErrorNoKernelImageForDevice
    "cudaerrornokernelimagefordevice",
    "invalid device function",  # cudaErrorInvalidDeviceFunction
    "driver version is insufficient",  # cudaErrorInsufficientDriver
    "initialization error",  # cudaErrorInitializationError
    "no cuda-capable device is detected",  # cudaErrorNoDevice
    "cuda-capable device(s) is/are busy or unavailable",  # cudaErrorDevicesUnavailable
    "forward compatibility was attempted on non supported hw",  # cudaErrorCompatNotSupportedOnDevice
    "cublas_status_arch_mismatch",
    "was not compiled with cuda support",  # a CPU-only CTranslate2 wheel
)

# CUDA errors that corrupt the context: every later call in this process fails too, and only a
# restart recovers (cudaGetErrorString texts, as CTranslate2's CUDA_CHECK and thrust wrap them).
STICKY_TEXTS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "device-side assert triggered",  # cudaErrorAssert
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable
    "unrecoverable error",  # cudaErrorUnrecoverable (bus errors, "GPU has fallen off the bus")
)


def is_oom(exc: BaseException) -> bool:
    """True for the out-of-memory errors the engine can raise on any device: the batch is split
    and the cap halved, never an engine taken out of rotation for it.

    ``MemoryError`` (the CPU allocator), torch's ``OutOfMemoryError`` (a RuntimeError subclass),
    and RuntimeErrors whose text is one of :data:`OOM_TEXTS` and not a device error
    (:func:`is_device_error`).
    """
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if not isinstance(exc, RuntimeError) or is_device_error(exc):
        return False
    text = str(exc).lower()
    return any(t in text for t in OOM_TEXTS)


def is_device_error(exc: BaseException) -> bool:
    """A device or driver that cannot run the call (see :data:`DEVICE_ERROR_TEXTS`): never out
    of memory, so the batch cap is left alone and the engine is blamed instead."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError | ValueError) and any(t in text for t in DEVICE_ERROR_TEXTS)


# Device errors a starved card raised too (thrust, in TranscriptionSuite#268 above).
STARVED_TEXTS = ("parallel_for failed: cudaerrorinvaliddevice",)


def may_be_oom(exc: BaseException) -> bool:
    """Out of memory, or a device error a starved card also raises. Only a smaller batch that
    then runs tells the two apart: the warm-up's search can afford to try one (a real device
    error fails at one window too, and refuses the start with its text); a serving batch cannot,
    so the batcher and the engine pool go by :func:`is_oom` alone."""
    text = str(exc).lower()
    return is_oom(exc) or (isinstance(exc, RuntimeError) and any(t in text for t in STARVED_TEXTS))


def is_sticky(exc: BaseException) -> bool:
    """A CUDA error after which every call in this process fails (see :data:`STICKY_TEXTS`)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in STICKY_TEXTS)


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
            with contextlib.suppress(Exception):  # imported here, not on the first scrape:
                import torch  # noqa: F401  (seconds of import on the event loop otherwise)
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
