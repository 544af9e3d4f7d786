"""Audio in: open uploads behind allow-lists and decode them (media), find their speech (vad),
cut it into windows (cut), a chunk at a time (stream). Everything here blocks and runs in the
prep pool, never on the event loop."""

from app.audio.cut import cut_windows
from app.audio.decoder import decode
from app.audio.media import Probe, probe
from app.audio.stream import AudioStream, prepare

__all__ = ["AudioStream", "Probe", "cut_windows", "decode", "prepare", "probe"]
