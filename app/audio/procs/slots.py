"""Fixed slots of shared memory that prepared windows come back in (``multiprocessing.shared_memory``).

A window is up to 30 s of 16 kHz audio: 960 kB as int16, which is what the decoder produces
(FFmpeg's s16), so a window read back from a slot is bit for bit the float32 window the
in-process stream made (float32 = int16 / 32768). Piping them instead would cost the service
process a copy of every window under the GIL (~1 GB/s of pickling at a GPU's feed rate).

The service process owns the free list; a prep process writes only into slots it was granted
(app/audio/procs/pool.py). Slots are handed out last freed first, so the pages that are ever
touched (and so resident) are about the most slots in use at once, not the whole arena. The
slots are the memory bound of prepared audio, whatever the number and length of uploads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from multiprocessing import shared_memory

import numpy as np

from app.windows import N_SAMPLES

log = logging.getLogger(__name__)
SLOT_SAMPLES = N_SAMPLES  # one window at most (app/audio/cut.py cuts at 30 s)
SLOT_BYTES = SLOT_SAMPLES * 2  # int16
SHM_DIR = "/dev/shm"


def engine_audio(window: np.ndarray) -> np.ndarray:
    """A window read from its slot as the engine takes it: the int16 slot itself (the engine
    reads int16 windows as x / 32768, and sends a batch of them to a GPU as int16: half the
    copy, app/engine/mel.py). No copy in the service: the slot is the window's memory until its
    batch is done. (Before the engine took int16 this was the one line that made float32.)"""
    return window


def shm_room(path: str = SHM_DIR) -> int | None:
    """Bytes free where shared memory lives (a container's /dev/shm is 64 MB by default)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Arena:
    """``count`` slots of one window each, int16."""

    def __init__(self, count: int, name: str | None = None) -> None:
        self.count = count
        self.owner = name is None
        if name is None:
            self._shm = shared_memory.SharedMemory(create=True, size=max(1, count * SLOT_BYTES))
        else:  # a prep process: spawned by the owner, so it shares the owner's resource
            # tracker, and attaching registers nothing new; the owner unlinks it
            self._shm = shared_memory.SharedMemory(name=name)
        self.name = self._shm.name
        self.slots = np.ndarray((count, SLOT_SAMPLES), dtype=np.int16, buffer=self._shm.buf)
        self._free = list(range(count - 1, -1, -1))  # owner only: a stack, slot 0 on top

    # ---- the owner's free list -----------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    # ---- samples ---------------------------------------------------------------------------
    def write(self, slot: int, audio: np.ndarray) -> int:
        """A float32 window (int16 / 32768, as the decoder made it) into ``slot``."""
        n = audio.size
        np.multiply(audio, 32768.0, out=audio)
        self.slots[slot, :n] = audio  # exact: every sample is an integer in int16's range
        return n

    def view(self, slot: int, n: int) -> np.ndarray:
        """The window in ``slot``: int16, valid until the slot is given back."""
        return self.slots[slot, :n]

    def close(self) -> None:
        """Unlink (the owner); the mapping itself stays until the process ends, since a window
        handed on may still be read (closing it under a view would crash the reader)."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
