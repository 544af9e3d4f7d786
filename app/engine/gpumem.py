"""What the model's own allocations on a GPU peaked at: the CUDA memory pool's high watermark.

CTranslate2 allocates device memory with ``cudaMallocAsync`` from the device's current memory
pool whenever the GPU supports pools (its default allocator, ``cuda_malloc_async``;
src/cuda/allocator.cc), and the pool hands memory back to the driver at every synchronisation,
so NVML's "used" after a batch says nothing about what the batch took. The pool itself counts:
``CU_MEMPOOL_ATTR_USED_MEM_HIGH`` is the most memory the process had allocated from it since
the watermark was last reset. Sizing reads it around the warm-up batch (app/engine/warmup.py).

Read through the CUDA driver API (``libcuda.so.1``, which the NVIDIA driver installs and every
CUDA process already has loaded), with ctypes: no extra package, and the pool is the driver's
object, shared by CTranslate2's statically linked runtime and anyone else in the process.
Where that is not possible (no driver, ``CT2_CUDA_ALLOCATOR=cub_caching``, a GPU without pools)
the readings are ``None`` and sizing falls back to an out-of-memory search (app/engine/sizing.py).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

log = logging.getLogger(__name__)

# cuda.h: enum CUmemPool_attribute_enum (REUSE_FOLLOW_EVENT_DEPENDENCIES = 1, ...).
CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8


class PoolMeter(Protocol):
    """Per CUDA ordinal: memory allocated from the device's pool now, and at most since reset."""

    def used(self, index: int) -> int | None: ...

    def peak(self, index: int) -> int | None: ...

    def reset(self, index: int) -> None: ...


class CudaPoolMeter:
    def __init__(self, lib: object | None = None) -> None:
        self._lib = lib
        self._failed = False

    def _cuda(self) -> object | None:
        if self._lib is None and not self._failed:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                if lib.cuInit(0) != 0:
                    raise OSError("cuInit failed")
                self._lib = lib
            except OSError as exc:
                log.info("no CUDA driver API for pool readings (%s)", exc)
                self._failed = True
        return self._lib

    def _pool(self, index: int) -> ctypes.c_void_p | None:
        lib = self._cuda()
        if lib is None:
            return None
        dev, pool = ctypes.c_int(), ctypes.c_void_p()
        if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:  # type: ignore[attr-defined]
            return None
        if lib.cuDeviceGetMemPool(ctypes.byref(pool), dev) != 0:  # type: ignore[attr-defined]
            return None
        return pool

    def _get(self, index: int, attr: int) -> int | None:
        pool = self._pool(index)
        if pool is None:
            return None
        value = ctypes.c_uint64()
        rc = self._lib.cuMemPoolGetAttribute(pool, attr, ctypes.byref(value))  # type: ignore[union-attr]
        return int(value.value) if rc == 0 else None

    def used(self, index: int) -> int | None:
        return self._get(index, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)

    def peak(self, index: int) -> int | None:
        return self._get(index, CU_MEMPOOL_ATTR_USED_MEM_HIGH)

    def reset(self, index: int) -> None:
        pool = self._pool(index)
        if pool is not None:  # "High watermark can only be reset to zero" (driver_types.h)
            zero = ctypes.c_uint64(0)
            self._lib.cuMemPoolSetAttribute(  # type: ignore[union-attr]
                pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, ctypes.byref(zero))


_meter: PoolMeter | None = None


def pool_meter() -> PoolMeter:
    """The process's meter (a fake GPU in tests installs its own with :func:`use_pool_meter`)."""
    global _meter
    if _meter is None:
        _meter = CudaPoolMeter()
    return _meter


def use_pool_meter(meter: PoolMeter) -> None:
    global _meter
    _meter = meter
