"""An upload's windows in upload order while its parts are cut side by side.

A split upload (app/audio/parts.py) delivers each part's windows in order, but the parts
together in any order: part 3's first window may come before part 0's last. A window's place in
the upload (its index in the job's results, which a stream of finished text reads in order) is
known once every part before its own has ended. Results that arrive before that wait here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")


class UploadOrder(Generic[R]):
    """Windows by (part, index within the part); ``place(index, result)`` is called once a
    window's upload index and its result are both known."""

    def __init__(self, place: Callable[[int, R], None]) -> None:
        self._place = place
        self._counts: dict[int, int] = {}
        self._ended: set[int] = set()
        self._waiting: dict[tuple[int, int], R] = {}

    def add(self, part: int) -> int:
        """A new window of ``part``: its index within the part."""
        n = self._counts.get(part, 0)
        self._counts[part] = n + 1
        return n

    def end(self, part: int) -> None:
        """``part`` has no more windows: later parts' places may now be known."""
        self._ended.add(part)
        for (p, k), r in sorted(self._waiting.items()):
            at = self.index(p, k)
            if at is not None:
                del self._waiting[(p, k)]
                self._place(at, r)

    def result(self, part: int, k: int, r: R) -> None:
        at = self.index(part, k)
        if at is None:
            self._waiting[(part, k)] = r
        else:
            self._place(at, r)

    def index(self, part: int, k: int) -> int | None:
        """The window's index in the upload, once every earlier part has ended."""
        before = 0
        for p in range(part):
            if p not in self._ended:
                return None
            before += self._counts.get(p, 0)
        return before + k

    @property
    def total(self) -> int:
        return sum(self._counts.values())
