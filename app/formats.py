"""Render a finished transcription as json, text, srt or vtt."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import srt

Format = Literal["json", "text", "srt", "vtt"]
MEDIA_TYPES: dict[str, str] = {
    "json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


def _cues(result: dict[str, Any]) -> list[tuple[float, float, str]]:
    """Segments with text, clamped so cues never run past the audio and never go backwards."""
    end_limit = float(result.get("duration") or 0.0) or None
    cues = []
    last = 0.0
    for s in result.get("segments", []):
        text = str(s.get("text", "")).strip()
        if not text:
            continue
        start = max(last, float(s["start"]))
        end = max(start, float(s["end"]))
        if end_limit is not None:
            start, end = min(start, end_limit), min(end, end_limit)
        cues.append((start, end, text))
        last = start
    return cues


def to_srt(result: dict[str, Any]) -> str:
    subs = [
        srt.Subtitle(i + 1, dt.timedelta(seconds=a), dt.timedelta(seconds=b), text)
        for i, (a, b, text) in enumerate(_cues(result))
    ]
    return srt.compose(subs, reindex=False)


def _vtt_time(t: float) -> str:
    ms = int(round(t * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def to_vtt(result: dict[str, Any]) -> str:
    lines = ["WEBVTT", ""]
    for a, b, text in _cues(result):
        # "-->" inside cue text would end the cue early; WebVTT has no escape for it.
        lines += [f"{_vtt_time(a)} --> {_vtt_time(b)}", text.replace("-->", "->"), ""]
    return "\n".join(lines)


def to_text(result: dict[str, Any]) -> str:
    return str(result.get("text", "")) + "\n"


def render(result: dict[str, Any], fmt: str) -> str:
    if fmt == "srt":
        return to_srt(result)
    if fmt == "vtt":
        return to_vtt(result)
    return to_text(result)
