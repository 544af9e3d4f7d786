"""The diarizer as the service holds it: loaded once, lazily by default, started and stopped
in the lifespan.

Loading costs ~8-12 s (mostly importing pyannote.audio) and ~1 GB of RSS (torch, pyannote and
the two models), which a service nobody asks for speakers should not pay: with
``speakers.load=lazy`` (the default) the first diarize job loads it, off the event loop, and
every job that arrives meanwhile waits for that one load. ``startup`` loads it before the
service is ready (a missing model stops the start-up, like a missing Whisper model); ``off``
never loads it, and the API answers ``diarize=true`` with 400.

A failed load (the models not provisioned, a broken file) is remembered: later requests get
503 ``diarization_unavailable`` with the command to run at once, instead of each job paying
for another attempt. Restarting the service after provisioning tries again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

from app.config import SpeakerSettings
from app.errors import DiarizationOff, DiarizationUnavailable
from app.speakers.diarizer import Diarizer, DiarizerSettings
from models.registry import SPEAKERS_MODEL, provision_hint

log = logging.getLogger(__name__)
LOAD_FAILED = (f"the speaker models could not be loaded; the operator must {provision_hint(SPEAKERS_MODEL)}"
               " and restart the service (its log has the cause)")


class SpeakerService:
    def __init__(self, settings: SpeakerSettings, cache_dir: Path) -> None:
        self.settings = settings
        self.cache_dir = cache_dir
        self._diarizer: Diarizer | None = None
        self._loading: asyncio.Task[Diarizer] | None = None
        self._error: str | None = None  # why the load failed, once it has
        self._stopped = False
        self.load_s: float | None = None

    @property
    def loaded(self) -> bool:
        return self._diarizer is not None

    def check(self) -> None:
        """Raise the error a request for speakers gets now (API side, before any upload)."""
        if self.settings.load == "off":
            raise DiarizationOff("speaker diarization is switched off on this service "
                                 "(BATCHSCRIBE_SPEAKERS__LOAD=off)", field="diarize")
        if self._error is not None:
            raise DiarizationUnavailable(self._error, field="diarize")

    async def start(self) -> None:
        """In the lifespan: load now when configured to (``startup``)."""
        if self.settings.load == "startup":
            await self.diarizer()

    async def diarizer(self) -> Diarizer:
        """The running diarizer, loading it first if needed (one load, however many callers;
        a caller that is cancelled does not cancel the load for the others)."""
        self.check()
        if self._diarizer is not None:
            return self._diarizer
        if self._stopped:
            raise DiarizationUnavailable("the service is stopping")
        if self._loading is None:
            self._loading = asyncio.create_task(self._load(), name="speakers-load")
        return await asyncio.shield(self._loading)

    async def _load(self) -> Diarizer:
        t0 = time.monotonic()
        settings = DiarizerSettings(segment_batch=self.settings.segment_batch,
                                    embed_batch=self.settings.embed_batch)
        log.info("loading the speaker models")
        try:
            d = await asyncio.to_thread(_load_frozen, self.cache_dir, settings)
        except Exception as exc:
            # A fixed text: the exception's (folders, files, library messages) stays in the log
            # (issue 51 read paths in the 503's body).
            self._error = LOAD_FAILED
            self._loading = None
            log.error("cannot load the speaker models: %s", exc)
            raise DiarizationUnavailable(self._error, field="diarize") from exc
        if self._stopped:  # stop() ran while this loaded: never start its batchers
            raise DiarizationUnavailable("the service is stopping")
        d.start()
        self._diarizer = d
        self.load_s = round(time.monotonic() - t0, 2)
        log.info("speaker models loaded", extra={"seconds": self.load_s})
        return d

    async def stop(self) -> None:
        """At shutdown, after the job runner has drained (no job feeds a stream any more)."""
        self._stopped = True
        if self._diarizer is not None:
            await self._diarizer.stop()
            self._diarizer = None


def _load_frozen(cache_dir: Path, settings: DiarizerSettings) -> Diarizer:
    """Blocking load, then the new long-lived objects (torch, pyannote, the models) frozen out
    of the garbage collector, as the lifespan does after the Whisper model loads: a full
    collection walking them all held the GIL ~0.36 s, every thread stopped."""
    d = Diarizer.load(cache_dir, settings)
    gc.collect()
    gc.freeze()
    return d
