"""Render a finished transcription as json, text, srt, vtt or tsv (cues from its segments).

Subtitle cues follow :class:`CueOptions`: lines of at most ``max_line_width`` characters, and a
segment too long for ``max_line_count`` lines or ``max_cue_s`` seconds is cut into several cues
at word boundaries. With word timestamps (the result's ``words``) each cue gets its words' own
times; without them a segment's time is shared out by characters, which is what a reader's eye
follows. Defaults leave one cue per segment, as before these options existed.

Speakers (``diarize=true``, ``channels=separate``: segments with ``speaker``, split at speaker
turns, so a cue has one speaker): SRT cues start with ``[SPEAKER_00] `` (SRT has no speaker
markup; the bracketed name is the common convention, whisperx's too); VTT cues are voice spans,
``<v SPEAKER_00>text``, which players show or style and parsers (webvtt-py's ``voice``) read;
TSV gets a fourth column, ``speaker``, after openai-whisper's three. Results without speakers
render exactly as before.
"""

from __future__ import annotations

import datetime as dt
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import srt

Format = Literal["json", "text", "srt", "vtt", "tsv"]
LINE_CHARS = 42  # the common broadcast limit (Netflix, BBC: 37-42)
MEDIA_TYPES: dict[str, str] = {
    "json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
    "tsv": "text/tab-separated-values; charset=utf-8",
}


@dataclass(frozen=True)
class CueOptions:
    """How subtitle cues are cut and wrapped (srt, vtt; tsv uses the cuts, not the wrapping)."""

    max_line_width: int = LINE_CHARS
    max_line_count: int | None = None  # None: as many lines as a segment needs
    max_cue_s: float | None = None  # None: a cue may last as long as its segment


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str  # one line; wrapped by :func:`lines`
    speaker: str | None = None


@dataclass(frozen=True)
class _Token:
    text: str
    start: float
    end: float


def lines(text: str, width: int = LINE_CHARS) -> str:
    """Subtitle lines of at most ``width`` characters, never a blank one (a blank line ends a
    cue in both formats)."""
    return "\n".join(textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)) or "..."


def segment_words(result: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]] | None]]:
    """Each segment with text, and its words when the result has word times.

    The result keeps words in one list; a segment's words are the next ones whose characters
    (spaces aside) add up to the segment's text, as the transcript built them. A mismatch (a
    result from elsewhere) drops the words for that segment rather than misplacing them.
    """
    words = result.get("words") or []
    k = 0
    for s in result.get("segments", []):
        text = str(s.get("text", "")).strip()
        if not text:
            continue
        want = len("".join(text.split()))
        got: list[dict[str, Any]] = []
        n = 0
        while k < len(words) and n < want:
            w = words[k]
            got.append(w)
            n += len("".join(str(w.get("word", "")).split()))
            k += 1
        yield s, (got if got and n == want else None)


def _tokens(seg: dict[str, Any], words: list[dict[str, Any]] | None) -> list[_Token]:
    start, end = float(seg["start"]), float(seg["end"])
    if words:
        return [_Token(str(w["word"]).strip(), float(w["start"]), float(w["end"]))
                for w in words if str(w["word"]).strip()]
    parts = str(seg["text"]).split()
    total = sum(len(p) + 1 for p in parts) or 1
    out, at = [], 0
    for p in parts:
        a = start + (end - start) * at / total
        at += len(p) + 1
        out.append(_Token(p, a, start + (end - start) * at / total))
    return out


def _fits(tokens: Sequence[_Token], opts: CueOptions, prefix: str = "") -> bool:
    if len(tokens) < 2:
        return True  # a cue holds at least one word, however long
    if opts.max_cue_s is not None and tokens[-1].end - tokens[0].start > opts.max_cue_s:
        return False
    if opts.max_line_count is not None:
        text = prefix + " ".join(t.text for t in tokens)
        if len(textwrap.wrap(text, opts.max_line_width, break_on_hyphens=False)) > opts.max_line_count:
            return False
    return True


def _split(seg: dict[str, Any], words: list[dict[str, Any]] | None, opts: CueOptions) -> list[Cue]:
    text = " ".join(str(seg["text"]).split())
    speaker = seg.get("speaker") or None
    if opts.max_line_count is None and opts.max_cue_s is None:
        return [Cue(float(seg["start"]), float(seg["end"]), text, speaker)]
    prefix = srt_prefix(speaker)  # counts towards the lines (the longest rendering's prefix)
    cues: list[Cue] = []
    cur: list[_Token] = []
    for tok in _tokens(seg, words):
        if cur and not _fits([*cur, tok], opts, prefix):
            cues.append(Cue(cur[0].start, cur[-1].end, " ".join(t.text for t in cur), speaker))
            cur = []
        cur.append(tok)
    if cur:
        cues.append(Cue(cur[0].start, cur[-1].end, " ".join(t.text for t in cur), speaker))
    return cues


def srt_prefix(speaker: str | None) -> str:
    """How an SRT cue names its speaker: ``[SPEAKER_00] `` before its text."""
    return f"[{speaker}] " if speaker else ""


def cues(result: dict[str, Any], opts: CueOptions | None = None) -> list[Cue]:
    """Segments with text as cues: starts never go backwards, a cue ends no later than the next
    one starts (players show overlapping cues stacked), and nothing runs past the audio."""
    opts = opts or CueOptions()
    end_limit = float(result.get("duration") or 0.0) or None
    raw = [c for s, ws in segment_words(result) for c in _split(s, ws, opts)]
    out: list[Cue] = []
    last = 0.0
    for k, c in enumerate(raw):
        start = max(last, c.start)
        end = max(start, c.end)
        if k + 1 < len(raw):
            end = max(start, min(end, raw[k + 1].start))
        if end_limit is not None:
            start, end = min(start, end_limit), min(end, end_limit)
        out.append(Cue(round(start, 3), round(end, 3), c.text, c.speaker))
        last = start
    return out


def to_srt(result: dict[str, Any], opts: CueOptions | None = None) -> str:
    opts = opts or CueOptions()
    subs = [
        srt.Subtitle(i + 1, dt.timedelta(seconds=c.start), dt.timedelta(seconds=c.end),
                     lines(srt_prefix(c.speaker) + c.text, opts.max_line_width))
        for i, c in enumerate(cues(result, opts))
    ]
    return srt.compose(subs, reindex=False)


def _vtt_time(t: float) -> str:
    ms = round(t * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def to_vtt(result: dict[str, Any], opts: CueOptions | None = None) -> str:
    opts = opts or CueOptions()
    out = ["WEBVTT", ""]
    for c in cues(result, opts):
        # Cue text is markup: escaping & < > also keeps a "-->" in the text from ending the cue.
        body = _escape(lines(c.text, opts.max_line_width))
        if c.speaker:
            # A voice span's annotation ends at ">" and may not hold a line break.
            body = f"<v {_escape(' '.join(c.speaker.split()))}>{body}"
        out += [f"{_vtt_time(c.start)} --> {_vtt_time(c.end)}", body, ""]
    return "\n".join(out)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_tsv(result: dict[str, Any], opts: CueOptions | None = None) -> str:
    """openai-whisper's TSV: a ``start end text`` header, then one cue per line with integer
    milliseconds (no decimal separator for a locale to change) and no tab inside the text.
    A result with speakers gets a fourth column, ``speaker`` (last: readers of the three
    columns by position are unaffected)."""
    all_cues = cues(result, opts)
    named = bool(result.get("speakers")) or any(c.speaker for c in all_cues)
    rows = ["start\tend\ttext" + ("\tspeaker" if named else "")]
    for c in all_cues:
        row = f"{round(c.start * 1000)}\t{round(c.end * 1000)}\t{c.text.replace(chr(9), ' ')}"
        rows.append(row + (f"\t{(c.speaker or '').replace(chr(9), ' ')}" if named else ""))
    return "\n".join(rows) + "\n"


def to_text(result: dict[str, Any]) -> str:
    return str(result.get("text", "")) + "\n"


def render(result: dict[str, Any], fmt: str, opts: CueOptions | None = None) -> str:
    if fmt == "srt":
        return to_srt(result, opts)
    if fmt == "vtt":
        return to_vtt(result, opts)
    if fmt == "tsv":
        return to_tsv(result, opts)
    return to_text(result)
