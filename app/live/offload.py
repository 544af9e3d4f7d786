"""The live sessions' audio work (base64, resampling, Silero) on a few threads, its results
handed back to the event loop in batches.

``loop.run_in_executor`` costs every call two hops through ``concurrent.futures``: a Future
wrapped in an asyncio Future, and on completion one ``call_soon_threadsafe``, which writes the
loop's self-pipe and wakes it, per call. A live session makes that call for every 100 ms
append, so 256 sessions make 2,560 a second, each paying it on the event loop. Measured here
(uvloop, 2 threads, a stand-in task of 0.3 ms; ``CPU per call``, this 2-core host):

==========  ======================  ===================
sessions    run_in_executor          :class:`Offload`
==========  ======================  ===================
64          49 us loop, 87 us all    14 us loop, 42 us all
256         50 us loop, 87 us all     5 us loop, 30 us all
==========  ======================  ===================

Here a call is a plain ``asyncio.Future`` on a deque; a thread takes one call at a time (the
threads share the work, so no call waits behind a batch taken by a busy thread) and keeps the
results while more calls are queued, giving them back in one ``call_soon_threadsafe`` when the
queue runs dry or :data:`HAND_BACK` are held (a bounded delay: a few appends' work). A session
awaits each append before taking the next, so its own calls still run one at a time and in
order. A call whose awaiting session was cancelled still runs (as with an executor) and its
result is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")
HAND_BACK = 8  # results a thread holds at most before handing them back
# A session's audio work costs ~6.5 ms of thread CPU per second of its audio on this host
# (live_capacity, 32 sessions: Silero ~2.2 ms, resampling ~0.4 ms, the rest Python around
# them); 256 sessions need ~1.7 threads' worth, and Silero's ONNX run releases the GIL. So
# the threads follow the cores: 2 on this 2-core host, 8 on a 16-core GPU host.
MIN_THREADS, MAX_THREADS = 2, 8

_Call = tuple["asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]
_Result = tuple["asyncio.Future[Any]", bool, Any]


def run_on(executor: Executor | Offload | None, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
    """``fn(*args)`` off the event loop: on an :class:`Offload`, or ``loop.run_in_executor``
    (``None``: the loop's default executor)."""
    if isinstance(executor, Offload):
        return executor.run(fn, *args)
    return asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def default_threads() -> int:
    """Half the cores this process may use, within [MIN_THREADS, MAX_THREADS]."""
    return max(MIN_THREADS, min(MAX_THREADS, len(os.sched_getaffinity(0)) // 2))


class Offload:
    """Run blocking calls for the event loop on ``threads`` threads (see the module doc)."""

    def __init__(self, threads: int | None = None, name: str = "live") -> None:
        self._calls: collections.deque[_Call] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{k}", daemon=True)
                         for k in range(threads or default_threads())]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on a thread; await the Future for its result (or its exception).
        Called on the event loop."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the live threads are closed")
            self._calls.append((fut, fn, args))
            self._ready.notify()
        return fut

    def close(self) -> None:
        """Stop the threads; calls not started are cancelled (as ``shutdown(cancel_futures)``)."""
        with self._ready:
            self._closed = True
            left = list(self._calls)
            self._calls.clear()
            self._ready.notify_all()
        if left:
            self._hand_back([(fut, False, None) for fut, _, _ in left], cancel=True)

    def _work(self) -> None:
        held: list[_Result] = []
        while True:
            with self._ready:
                while not self._calls and not self._closed:
                    if held:  # nothing queued: what this thread holds goes back now
                        break
                    self._ready.wait()
                if not self._calls:
                    call = None
                    if self._closed and not held:
                        return
                else:
                    call = self._calls.popleft()
            if call is None:
                self._hand_back(held)
                held = []
                continue
            fut, fn, args = call
            try:
                held.append((fut, True, fn(*args)))
            except BaseException as exc:  # the caller's to see, whatever it is
                held.append((fut, False, exc))
            if len(held) >= HAND_BACK:
                self._hand_back(held)
                held = []

    @staticmethod
    def _hand_back(results: list[_Result], cancel: bool = False) -> None:
        """To each Future's own loop, in one call per loop (one, in the service)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
        for r in results:
            by_loop.setdefault(r[0].get_loop(), []).append(r)
        for loop, mine in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits there
                loop.call_soon_threadsafe(_settle, mine, cancel)


def _settle(results: list[_Result], cancel: bool) -> None:
    """On the loop: each call's Future gets its result, unless its awaiter went away."""
    for fut, ok, value in results:
        if fut.done():
            continue
        if cancel:
            fut.cancel()
        elif ok:
            fut.set_result(value)
        else:
            try:
                fut.set_exception(value)
            except TypeError:  # StopIteration cannot travel through a Future
                fut.set_exception(RuntimeError(f"{type(value).__name__} raised in a live call"))
