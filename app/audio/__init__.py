"""Audio in: probe and decode uploads, find their speech, cut it into windows (app.audio.media,
app.audio.vad). Everything here blocks and runs in the prep pool, never on the event loop."""

from app.audio.media import Probe, cut_windows, decode, prepare, probe

__all__ = ["Probe", "cut_windows", "decode", "prepare", "probe"]
