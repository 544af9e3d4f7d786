"""A live session's effective configuration (what ``session.updated`` echoes) and its limits.

``session.update`` changes only the fields it carries (OpenAI's rule): a field given as ``null``
is set to null (``turn_detection: null`` is manual mode), a field left out keeps its value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.config import LiveSettings
from app.live.audio import Format
from app.live.decoding import LiveOptions
from app.live.protocol import (
    AudioInput,
    NoiseReduction,
    PcmFormat,
    SemanticVad,
    ServerVad,
    Transcription,
    TranscriptionSession,
)
from app.live.turns import VadRules

# A session's bounds and pacing are the service's ``live`` settings block (app/config).
LiveLimits = LiveSettings
# semantic_vad's eagerness -> (ms of silence that end a turn that sounds finished, ms that end
# any turn): the second is OpenAI's documented timeout (8 / 4 / 2 s; auto is medium); the first
# is server_vad's 500 ms default for medium, and the pause the early read starts at for high.
EAGERNESS = {"low": (1000, 8000), "medium": (500, 4000), "auto": (500, 4000), "high": (200, 2000)}


@dataclass
class SessionConfig:
    format: Format = field(default_factory=PcmFormat)
    transcription: Transcription | None = None
    turn_detection: ServerVad | SemanticVad | None = field(default_factory=ServerVad)
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

    def options(self) -> LiveOptions:
        """What every decode of the session is asked with."""
        tr = self.transcription
        if tr is None:
            return LiveOptions()
        language = tr.language or (tr.languages[0] if tr.languages and len(tr.languages) == 1
                                   else None)
        return LiveOptions(language=language, prompt=tr.prompt,
                           hotwords=" ".join(tr.keywords) if tr.keywords else None)

    def rules(self, limits: LiveLimits) -> VadRules | None:
        td = self.turn_detection
        if td is None:
            return None
        if isinstance(td, SemanticVad):  # the read at a pause is what judges it: always early
            done, most = EAGERNESS[td.eagerness]
            early = limits.early_final_ms if 0 < limits.early_final_ms <= done else done
            return VadRules(max_turn_s=limits.max_turn_s, silence_duration_ms=most,
                            early_final_ms=early, done_silence_ms=done)
        early = limits.early_final_ms if limits.early_final_ms < td.silence_duration_ms else 0
        return VadRules(td.threshold, td.prefix_padding_ms, td.silence_duration_ms,
                        limits.max_turn_s, early)

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


def opened_with(session: TranscriptionSession, limits: LiveLimits) -> dict[str, Any]:
    """What a socket opened with a client secret minted for ``session`` starts as: the
    ``session`` of the secret's answer (no id or expiry yet: the socket's own)."""
    config = SessionConfig()
    config.apply(session)
    out = config.as_session("", limits, wall_clock())
    del out["id"], out["expires_at"]
    return out


def wall_clock() -> float:
    return time.time()
