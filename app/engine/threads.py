"""The process's thread pools beside CTranslate2's: torch's intra-op pool and numpy's BLAS.

The engine sets both once (:func:`limit_pools`), and torch is then imported only where it is
used (:func:`load_torch`): by the mel on a GPU, the pyannote VAD and the speaker models. A CPU
service that transcribes never imports it (the import alone cost 2.9 of a cold start's 4.9 CPU-s
here), so the thread count it must run at is kept here and applied when something imports it.

- torch at ``model.torch_threads`` (1): its OpenMP pool spinning beside CTranslate2's made the
  pyannote VAD 15-25x slower on 2 cores.
- numpy's BLAS (OpenBLAS) at one thread: the mel's filter-bank product on the CPU
  (app/engine/mel.py) cost 0.19 CPU-s per batch of eight 30 s windows on OpenBLAS's two threads
  (their spin) against 0.085 on one, for the same wall time. What else multiplies matrices here
  (the speakers' clustering) runs beside the engine's threads too.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

_lock = threading.Lock()
_torch_threads: list[int] = []  # the engine's setting; empty until limit_pools


def limit_pools(torch_threads: int) -> None:
    """Keep torch at ``torch_threads`` (now if it is loaded, else when :func:`load_torch`
    imports it) and numpy's BLAS at one thread."""
    from threadpoolctl import threadpool_limits

    with _lock:
        _torch_threads[:] = [torch_threads]
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(torch_threads)
    threadpool_limits(1, user_api="blas")


def load_torch() -> ModuleType:
    """torch, its pool at the engine's setting (blocking: seconds the first time)."""
    import torch

    with _lock:
        if _torch_threads and torch.get_num_threads() != _torch_threads[0]:
            torch.set_num_threads(_torch_threads[0])
    return torch
