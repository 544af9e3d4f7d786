"""Give the process's freed heap back to the OS after an engine call that left much of it free.

An engine call's transient memory is large next to what stays resident: on CPU, 8 windows of
30 s (encoder attention, then the decoder's states) took RSS from 988 to 1,824 MiB here, and
after the call 831 MiB of it sat free in tcmalloc's page heap, still counted in RSS. tcmalloc
(preloaded for CPU batching, scripts/env.sh) hands free pages back only slowly, so the largest
pair of batches the workers ever ran together set the process's floor for good: the 20-minute
soak on the multilingual corpus (long clips, so 30 s windows) stepped from 3,352 to 4,453 MiB at
~330 s and stayed there. Released after the call (``MallocExtension_ReleaseFreeMemory``:
55 ms for those 831 MiB, and the same batch ran again in 9.6 s against 9.5 s), the floor
follows what is in use. With glibc's malloc, ``malloc_trim(0)`` does the same.

Only when more than ``threshold`` bytes are free, and **at most once per ``every_s``** while
the engine is busy: a release hands back the pages the very next calls need again, and faulting
them in costs CPU. Released after every large call, as at first, 2 workers x batches of 8 corpus
windows released after half their calls and ran 3.9 M minor page faults against 0.7 M, 110 CPU-s
against 94 (``python -m loadtest.offline engine --heap-release-mb 256``, tcmalloc): ~0.8 CPU-s per
release, the ~12 % the 32-client bench lost against the engine alone. Once a minute it costs
~1 % of a core; a one-off peak is back with the OS within a minute under load, and
``idle_s`` after the engine falls idle (:class:`app.engine.placement.EngineRunner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

FREE_PROPERTY = b"tcmalloc.pageheap_free_bytes"


class HeapTrim:
    """Called after each engine call (on the engine's threads), and when the engine is idle."""

    def __init__(self, threshold_bytes: int = 256 << 20, every_s: float = 60.0, lib: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold_bytes
        self.every_s = every_s
        self.released = 0  # releases done
        self._clock = clock
        self._last = -float("inf")
        self._lock = threading.Lock()
        self._lib = lib if lib is not None else ctypes.CDLL(None)
        self._tcmalloc = hasattr(self._lib, "MallocExtension_ReleaseFreeMemory")
        self._glibc = not self._tcmalloc and hasattr(self._lib, "malloc_trim")

    def free_bytes(self) -> int | None:
        """Bytes the allocator holds free (tcmalloc's page heap; glibc's free chunks)."""
        if self._tcmalloc:
            value = ctypes.c_size_t()
            ok = self._lib.MallocExtension_GetNumericProperty(FREE_PROPERTY, ctypes.byref(value))
            return int(value.value) if ok else None
        if self._glibc and hasattr(self._lib, "mallinfo2"):
            self._lib.mallinfo2.restype = _MallInfo2
            return int(self._lib.mallinfo2().fordblks)
        return None

    def __call__(self) -> bool:
        """After an engine call: release if the last release is ``every_s`` old."""
        if self._clock() - self._last < self.every_s:
            return False
        return self.release()

    def release(self) -> bool:
        """Give the free heap back now if more than ``threshold`` is free (the engine idle)."""
        with self._lock:
            free = self.free_bytes()
            if free is None or free < self.threshold:
                return False
            if self._tcmalloc:
                self._lib.MallocExtension_ReleaseFreeMemory()
            else:
                self._lib.malloc_trim(0)
            self._last = self._clock()
            self.released += 1
        log.debug("returned %d MiB of free heap to the OS", free >> 20)
        return True


class IdleRelease:
    """The event loop's side of a runner's trim: calls in flight counted, and the free heap
    released ``idle_s`` after the last one ended when none started since (on ``submit``: the
    engine's own threads, off the loop)."""

    def __init__(self, trim: HeapTrim, submit: Callable[[Callable[[], bool]], object],
                 idle_s: float = 5.0) -> None:
        self.trim, self.submit, self.idle_s = trim, submit, idle_s
        self.in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def started(self) -> None:
        self.cancel()
        self.in_flight += 1

    def ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and not self.closed:
            self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._idle)

    def _idle(self) -> None:
        self._timer = None
        if self.in_flight == 0 and not self.closed:
            with contextlib.suppress(RuntimeError):  # the pool shut down meanwhile
                self.submit(self.trim.release)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
