"""Prep in processes of its own (issue 50): spawned once, each with its decoder and VAD session,
fed whole streams (or parts of one long upload), windows back through shared memory slots."""

from app.audio.procs.feed import ProcFeed
from app.audio.procs.pool import ProcPool
from app.audio.procs.slots import engine_audio

__all__ = ["ProcFeed", "ProcPool", "engine_audio"]
