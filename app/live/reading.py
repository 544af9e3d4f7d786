"""How a live session's turns are read: the decodes a session asks of the engine, and what it
counts of them. The session (app/live/session.py) decides when to read and what to tell the
client; this module decides how a turn's audio becomes text.

* A **final** reads the turn whole. Where the turn before it ended at most ``context_gap_ms``
  earlier and both fit ``context_max_s``, it reads both, continuing the earlier transcript
  (Whisper's decoder prefix), and keeps what follows; if that read loops or is unsure (the
  engine marks it ``doubtful`` and runs no fallback on it), it reads the turn alone.
* A turn longer than one window (manual commits) is read in windows, joined.
* An **interim** reads the turn so far; the batcher may shed it when it is behind, and the turn
  then asks less often (:meth:`Reader.interim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import numpy as np

from app.audio.cut import pieces
from app.live.audio import ChunkBuffer
from app.live.config import LiveLimits
from app.live.decoding import Decode, Kind, LiveOptions
from app.live.turns import Previous, Turn
from app.windows import SAMPLE_RATE, Refresh, Shed

log = logging.getLogger(__name__)


class Reader:
    """One session's decodes through ``decode``; ``counts`` (the session's) gets ``final``,
    ``interim`` and ``interim_shed``."""

    def __init__(self, decode: Decode, limits: LiveLimits, counts: dict[str, int],
                 session_id: str) -> None:
        self._decode, self.limits, self.counts, self._id = decode, limits, counts, session_id

    def final(self, buf: ChunkBuffer, previous: Previous | None, start: int, end: int,
              opts: LiveOptions) -> Coroutine[Any, Any, str]:
        """The final decode of ``buf`` from ``start`` to ``end``: after ``previous`` where it
        touches (see the module doc), else alone. A pause of 500 ms ends a turn, so a sentence
        said with pauses arrives in pieces; read alone, a piece loses its words' context ("I
        hardly know her" cut before "her", which then read "Thanks for watching."). Both slices
        are taken now: the session trims the buffer after this."""
        audio = buf.slice(start, end)
        p, rate = previous, SAMPLE_RATE
        if (p is not None and p.text and p.start >= buf.base and p.end <= start
                and start - p.end <= self.limits.context_gap_ms * rate // 1000
                and end - p.start <= self.limits.context_max_s * rate):
            return self._continued(buf.slice(p.start, end), audio, replace(opts, prefix=p.text))
        return self.decoded(audio, opts, "final")

    async def settle(self, audio: np.ndarray, opts: LiveOptions, early: asyncio.Task[str] | None,
                     fresh: Coroutine[Any, Any, str] | None, before: asyncio.Task[None] | None
                     ) -> tuple[str | None, Exception | None]:
        """A closed turn's text (or why it has none): ``early``, the decode started at the pause
        (the audio since is silence), or else ``fresh``, the decode of a turn of one window
        (:meth:`final`); without either, or if the early one failed, the turn read in windows.
        Returns once the turn before (``before``) has settled: completed events in turn order."""
        error: Exception | None = None
        text: str | None = None
        if early is not None:
            with contextlib.suppress(Exception):
                text = await early
        try:
            if text is None and fresh is not None:
                text = await fresh
            elif text is None:
                text = await self.windows(audio, opts)
        except Exception as exc:
            error = exc
        if before is not None:
            await asyncio.wait({before})
        return text, error

    async def windows(self, audio: np.ndarray, opts: LiveOptions) -> str:
        """A turn longer than one window, read in windows and joined."""
        got = await asyncio.gather(*(self.decoded(audio[a:b], opts, "final")
                                     for a, b in pieces(0, audio.size)))
        return " ".join(s for s in (g.strip() for g in got) if s) if len(got) > 1 \
            else (got[0] if got else "")

    async def interim(self, t: Turn, audio: np.ndarray | asyncio.Task[str],
                      opts: LiveOptions) -> str | None:
        """An interim decode of ``audio``, or the text of an early final decode that speech
        resumed after (it decoded the turn so far: an interim's input); None if shed or
        failed."""
        try:
            text = await (audio if isinstance(audio, asyncio.Task) else self.decoded(
                audio, opts, "interim", (t.answered, t.refreshed)))
        except Shed:
            # Behind: this turn asks less (every 1, 2, 4, 8 intervals) until an interim is
            # answered. On 2 cores, 8 streams' interims each second left finals waiting (p95
            # 12 s at N = 8). The back-off is the turn's: carried over from a session's last
            # turn, it put a new turn's first interim 4-8 s in (16 streams, 91694fb).
            self.counts["interim_shed"] += 1
            t.backoff = min(t.backoff * 2, 8)
            return None
        except Exception as exc:  # only the final's text matters; say it in the log
            log.warning("live session %s: interim decode failed: %s", self._id, exc)
            return None
        t.backoff = max(1, t.backoff // 2)
        t.answered, t.refreshed = t.answered + 1, time.monotonic()
        return text

    async def decoded(self, audio: np.ndarray, opts: LiveOptions, kind: Kind,
                      refresh: Refresh = (0, 0.0)) -> str:
        self.counts[kind] += 1
        return (await self._decode(audio, opts, kind, refresh)).text

    async def _continued(self, both: np.ndarray, audio: np.ndarray, opts: LiveOptions) -> str:
        """``both`` (the turn before and this one) read on from the text of the one before; if
        that loops or is unsure (the engine runs no fallback on it), this turn's audio alone."""
        self.counts["final"] += 1
        got = await self._decode(both, opts, "final")
        if not got.doubtful:
            return got.text
        return await self.decoded(audio, replace(opts, prefix=None), "final")
