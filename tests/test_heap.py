"""app.engine.heap: freed heap goes back to the OS after a large call, not after small ones."""

from __future__ import annotations

import numpy as np

from app.engine.heap import HeapTrim
from loadtest.lib.common import proc_status_kb


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
