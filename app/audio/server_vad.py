"""OpenAI's ``chunking_strategy`` mapped onto this service's VAD, for one request.

OpenAI's transcription API takes ``chunking_strategy``: ``"auto"``, or a ``server_vad`` object
``{"type": "server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms"}``. The
``openai`` client sends the object as form fields ``chunking_strategy[type]``,
``chunking_strategy[threshold]``, ...; a JSON string in ``chunking_strategy`` is read too.
Uploads here are always cut at pauses by Silero VAD with faster-whisper's span rules
(app/audio/spans.py), whose three knobs are the same three things:

- ``threshold`` -> the speech probability that starts speech (``SpanTracker.threshold``; speech
  ends below ``threshold - 0.15``, faster-whisper's hysteresis), 0-1, default 0.5;
- ``prefix_padding_ms`` -> the padding kept around each speech span (``speech_pad_ms``; the
  service pads both sides, as faster-whisper does), 0-5000 ms, default the service's
  ``prep.speech_pad_s`` (1.4 s);
- ``silence_duration_ms`` -> how long a pause must last to end a span (``min_silence_ms``),
  0-10000 ms, default 160.

A field left out keeps the service's default, not OpenAI's realtime defaults (300 ms padding,
200 ms silence), which would change every transcript. Spans then become <= 30 s windows as
always, so the knobs decide what audio reaches the model and where windows start and end.
The request's field is read by the OpenAI API (app/api/openai/protocol.py: invalid values are a
400 naming ``chunking_strategy``); here the settings meet the VAD. With the pyannote VAD
(``BATCHSCRIBE_PREP__VAD=pyannote``) a ``server_vad`` object is refused: its rules are
whisperx's, with no such knobs.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from app.audio.spans import SpanTracker
from app.audio.vad import SileroStream, SileroVad, Vad, VadStream, whole
from app.errors import InvalidChunking

MIN_SILENCE_MS = 160  # the service's (SpanTracker's default)


def tracker(settings: Mapping[str, float], pad_s: float, origin: int = 0) -> SpanTracker:
    """faster-whisper's span rules with the request's settings over the service's."""
    return SpanTracker(
        threshold=float(settings.get("threshold", 0.5)),
        min_silence_ms=int(settings.get("silence_duration_ms", MIN_SILENCE_MS)),
        speech_pad_ms=int(settings.get("prefix_padding_ms", round(pad_s * 1000))),
        origin=origin)


class TunedVad:
    """The service's Silero VAD, its spans cut by one request's ``server_vad`` settings."""

    def __init__(self, vad: SileroVad, settings: Mapping[str, float]) -> None:
        self.vad = vad
        self.settings = dict(settings)

    def stream(self) -> VadStream:
        return SileroStream(self.vad, tracker(self.settings, self.vad.pad_s))

    def spans(self, origin: int = 0) -> SpanTracker:
        """The span rules alone (a part of an upload: app/audio/parts.py)."""
        return tracker(self.settings, self.vad.pad_s, origin)

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        return whole(self, audio)


def vad_for(vad: Vad, settings: Mapping[str, float] | None) -> Vad:
    """The VAD a job's upload is cut with: the service's, or tuned by its ``server_vad``."""
    if not settings:
        return vad
    if not isinstance(vad, SileroVad):
        raise InvalidChunking("chunking_strategy server_vad needs the Silero VAD; this service "
                              "runs the pyannote one (prep.vad)")
    return TunedVad(vad, settings)
