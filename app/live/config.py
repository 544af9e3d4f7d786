"""A live session's effective configuration (what ``session.updated`` echoes) and its limits.

``session.update`` changes only the fields it carries (OpenAI's rule): a field given as ``null``
is set to null (``turn_detection: null`` is manual mode), a field left out keeps its value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from app.live.audio import Format
from app.live.protocol import (
    AudioInput,
    NoiseReduction,
    PcmFormat,
    ServerVad,
    Transcription,
    TranscriptionSession,
)
from app.live.turns import VadRules


class LiveLimits(BaseModel):
    """Per-session bounds and pacing (phase B: a ``live`` block of the service's settings)."""

    max_event_bytes: int = Field(15 * 1024 * 1024, ge=1024,
                                 description="Largest client message (OpenAI's append bound).")
    max_buffer_s: float = Field(120.0, gt=0, description="Manual mode: uncommitted audio kept.")
    max_turn_s: float = Field(29.5, gt=1, le=30.0,
                              description="Server VAD: a longer turn is cut (one Whisper window).")
    idle_timeout_s: float = Field(60.0, gt=0, description="No client message for this long: closed.")
    max_session_s: float = Field(3600.0, gt=0, description="Longest session.")
    interim_interval_ms: int = Field(
        1000, ge=0, description="Re-decode an open turn after this much more audio (0: never).")
    max_pending_finals: int = Field(
        4, ge=1, description="Turns decoding at once per session; appends wait beyond (a client "
        "faster than real time is slowed to the engine's pace, not buffered).")
    model: str = Field("whisper-base", description="The model name sessions report.")
    session_ttl_s: int = Field(3600, ge=1, description="expires_at of the session object.")


@dataclass
class SessionConfig:
    format: Format = field(default_factory=PcmFormat)
    transcription: Transcription | None = None
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    noise_reduction: NoiseReduction | None = None
    include: list[str] | None = None

    def apply(self, s: TranscriptionSession) -> tuple[bool, bool]:
        """Apply an update; (format changed, turn detection changed)."""
        fmt_changed = td_changed = False
        if "include" in s.model_fields_set:
            self.include = list(s.include) if s.include is not None else None
        inp: AudioInput | None = s.audio.input if s.audio is not None else None
        if inp is None:
            return fmt_changed, td_changed
        given = inp.model_fields_set
        if "format" in given and inp.format is not None and inp.format != self.format:
            self.format, fmt_changed = inp.format, True
        if "transcription" in given:
            self.transcription = inp.transcription
        if "turn_detection" in given and inp.turn_detection != self.turn_detection:
            self.turn_detection, td_changed = inp.turn_detection, True
        if "noise_reduction" in given:
            self.noise_reduction = inp.noise_reduction
        return fmt_changed, td_changed

    def rules(self, limits: LiveLimits) -> VadRules | None:
        td = self.turn_detection
        if td is None:
            return None
        return VadRules(td.threshold, td.prefix_padding_ms, td.silence_duration_ms,
                        limits.max_turn_s)

    def as_session(self, session_id: str, limits: LiveLimits, created: float) -> dict[str, Any]:
        """The session object of ``session.created`` / ``session.updated``."""
        tr = self.transcription or Transcription()
        tr_out = tr.model_dump(exclude_none=True)
        tr_out.setdefault("model", limits.model)
        tr_out.setdefault("language", None)
        tr_out.setdefault("prompt", None)
        return {
            "type": "transcription", "object": "realtime.transcription_session",
            "id": session_id, "expires_at": int(created + limits.session_ttl_s),
            "audio": {"input": {
                "format": self.format.model_dump(exclude_none=True),
                "transcription": tr_out,
                "noise_reduction": (self.noise_reduction.model_dump(exclude_none=True)
                                    if self.noise_reduction else None),
                "turn_detection": (self.turn_detection.model_dump(exclude_none=True)
                                   if self.turn_detection else None),
            }},
            "include": self.include,
        }


def wall_clock() -> float:
    return time.time()
