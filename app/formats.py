"""Render a finished transcription as json, text, srt or vtt (cues from its segments)."""

from __future__ import annotations

import datetime as dt
import textwrap
from typing import Any, Literal

import srt

Format = Literal["json", "text", "srt", "vtt"]
LINE_CHARS = 42
MEDIA_TYPES: dict[str, str] = {
    "json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


def _cues(result: dict[str, Any]) -> list[tuple[float, float, str]]:
    """Segments with text as cues: starts never go backwards, a cue ends no later than the next
    one starts (players show overlapping cues stacked), and nothing runs past the audio."""
    end_limit = float(result.get("duration") or 0.0) or None
    raw = []
    for s in result.get("segments", []):
        text = str(s.get("text", "")).strip()
        if text:
            raw.append((float(s["start"]), float(s["end"]), text))
    cues: list[tuple[float, float, str]] = []
    last = 0.0
    for k, (a, b, text) in enumerate(raw):
        start = max(last, a)
        end = max(start, b)
        if k + 1 < len(raw):
            end = max(start, min(end, raw[k + 1][0]))
        if end_limit is not None:
            start, end = min(start, end_limit), min(end, end_limit)
        cues.append((round(start, 3), round(end, 3), text))
        last = start
    return cues


def _lines(text: str) -> str:
    """Subtitle lines of at most ~42 characters (the common broadcast limit), never a blank one
    (a blank line ends a cue in both formats)."""
    return "\n".join(textwrap.wrap(" ".join(text.split()), LINE_CHARS, break_on_hyphens=False)) or "..."


def to_srt(result: dict[str, Any]) -> str:
    subs = [
        srt.Subtitle(i + 1, dt.timedelta(seconds=a), dt.timedelta(seconds=b), _lines(text))
        for i, (a, b, text) in enumerate(_cues(result))
    ]
    return srt.compose(subs, reindex=False)


def _vtt_time(t: float) -> str:
    ms = round(t * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def to_vtt(result: dict[str, Any]) -> str:
    lines = ["WEBVTT", ""]
    for a, b, text in _cues(result):
        # Cue text is markup: escaping & < > also keeps a "-->" in the text from ending the cue.
        body = _lines(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        lines += [f"{_vtt_time(a)} --> {_vtt_time(b)}", body, ""]
    return "\n".join(lines)


def to_text(result: dict[str, Any]) -> str:
    return str(result.get("text", "")) + "\n"


def render(result: dict[str, Any], fmt: str) -> str:
    if fmt == "srt":
        return to_srt(result)
    if fmt == "vtt":
        return to_vtt(result)
    return to_text(result)
