"""app.engine.heap: freed heap goes back to the OS after a large call, not after small ones,
at most once a period while the engine is busy, and once it falls idle."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from app.engine.heap import HeapTrim
from app.engine.placement import EngineRunner
from app.windows import DecodeOptions
from loadtest.lib.common import proc_status_kb
from tests.fakes import FakeEngine, tagged_window


class FakeLib:
    def __init__(self, free: int) -> None:
        self.free, self.released = free, 0

    def MallocExtension_GetNumericProperty(self, name: bytes, out: object) -> int:
        out._obj.value = self.free  # type: ignore[attr-defined]
        return 1

    def MallocExtension_ReleaseFreeMemory(self) -> None:
        self.released += 1


def test_releases_only_past_the_threshold() -> None:
    lib = FakeLib(free=100 << 20)
    trim = HeapTrim(threshold_bytes=256 << 20, lib=lib)
    trim()
    assert lib.released == 0
    lib.free = 300 << 20
    trim()
    assert lib.released == 1 and trim.released == 1


def test_rss_falls_after_a_large_transient_allocation() -> None:
    """In this process's own allocator (tcmalloc under scripts/env.sh, else glibc)."""
    trim = HeapTrim(threshold_bytes=64 << 20)
    blocks = [np.ones(1 << 20, dtype=np.float32) for _ in range(128)]  # 512 MiB in 4 MiB blocks
    del blocks
    free = trim.free_bytes()
    before = proc_status_kb("self", "VmRSS") or 0
    trim()
    after = proc_status_kb("self", "VmRSS") or 0
    if free is not None and free >= 64 << 20:  # the allocator kept them: they must go back
        assert trim.released == 1
        assert before - after > 256 * 1024, (before, after)  # kB
    else:  # glibc returned 4 MiB blocks (mmap) at once: nothing was held
        assert before - after < 64 * 1024


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_busy_engine_releases_at_most_once_per_period() -> None:
    """Released after every large call, the next calls fault the pages in again: ~0.8 CPU-s per
    release, 12 % of the 32-client bench's throughput (app/engine/heap.py)."""
    lib, clock = FakeLib(free=300 << 20), Clock()
    trim = HeapTrim(threshold_bytes=256 << 20, every_s=60.0, lib=lib, clock=clock)
    assert trim()  # the first large remainder goes back
    for t in (1.0, 30.0, 59.9):
        clock.t = t
        assert not trim()
    assert lib.released == 1
    clock.t = 60.0
    assert trim() and lib.released == 2
    lib.free = 100 << 20
    clock.t = 500.0
    assert not trim() and lib.released == 2  # small remainders stay, however long it has been
    lib.free = 300 << 20
    assert trim.release() and lib.released == 3  # the engine idle: no period to wait for


def test_the_runner_releases_once_the_engine_falls_idle() -> None:
    class Counting(HeapTrim):
        def __init__(self) -> None:
            super().__init__(threshold_bytes=0, every_s=3600.0, lib=FakeLib(free=1 << 30))
            self.after_calls = 0
            self.idle = threading.Event()

        def __call__(self) -> bool:
            self.after_calls += 1
            return super().__call__()

        def release(self) -> bool:
            done = super().release()
            if self.released == 2:  # the first went after the first call
                self.idle.set()
            return done

    async def main(trim: Counting) -> None:
        runner = EngineRunner(FakeEngine(), trim, idle_s=0.05)
        opts = DecodeOptions()
        await runner.run([tagged_window(1)], opts)  # released: the first large remainder
        await asyncio.gather(*(runner.run([tagged_window(1)], opts) for _ in range(3)))
        assert trim.released == 1  # within the period, busy: kept
        assert await asyncio.to_thread(trim.idle.wait, 5.0)  # idle 50 ms: released
        assert trim.released == 2
        await runner.run([tagged_window(1)], opts)  # a call cancels nothing it should not
        runner.close()

    trim = Counting()
    asyncio.run(main(trim))
    assert trim.after_calls == 5
