"""Segment times from the speaker turns: what a diarized transcript's segments say about who
spoke when should be what the turns say.

Why (measured on the 4 shared recordings, ``loadtest/diarization.py``; 0.25 s collar, overlap
scored): the turns scored DER 12.0 %, the segments users got 28.5 %, and nearly all of the
difference was missed speech. Segment times came from the words' cross-attention times, which
cover much less than the speech: 17.9 s of the 30 s of ami-en2002a (29.2 s of it speech),
18.8 of pyannote-sample's 30 s (22.5 speech); word times are good to ~0.5 s, a segment starts
at its first word's (late) start and ends at its last word's (early) end, and a word-less
gap between two segments of one speaker is a miss. Turns restricted to the segments' spans
still scored 24.2 %: overlap (one segment, one speaker) was the smaller part (flattening the
turns to one speaker at a time costs 4 points), speech outside the segments the larger. Where
words spill over a pause the speaker models heard as silence, segments also spanned silence
(false alarm).

So a segment's span becomes its speaker's turn time around it: every turn of speaker X (turns
of one speaker merged) is shared among the segments of X whose word span overlaps it, split at
the middle of the gap between consecutive ones; a segment's new span is the hull of its share.
A segment whose words overlap no turn of its speaker keeps its word times. Segments of
different speakers may now overlap in time, where both speak (the turns say so); the words
keep their own times, and the segments their text order.

Speech of X that no segment of X covers then (Whisper gave no words there: a sentence cut by
the start of the recording, a backchannel, the quieter of two voices at once) becomes a
segment of its own with empty ``text`` (:func:`wordless_segments`), at least ``MIN_WORDLESS_S``
long: shorter pieces are the crumbs a turn leaves beside a fitted segment. The segments are
then the whole speaker timeline, with the words where there are words. Measured on 15 s
excerpts of the shared recordings (``loadtest/diarization.py``): segments 20.0 % against the
turns' 14.1 % without them; 2.4 s of pyannote-sample's 15-30 s, one speaker's whole turn at
the cut, had no words at all. Subtitles, text and OpenAI's shapes skip segments without text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.speakers.turns import Turn

MIN_WORDLESS_S = 0.5  # a word-less segment at least this long (a short backchannel's length)


def merged(turns: Sequence[Turn], speaker: str) -> list[tuple[float, float]]:
    """One speaker's turns as disjoint spans, in time order."""
    out: list[list[float]] = []
    for s, e, _ in sorted(t for t in turns if t.speaker == speaker):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(a, b) for a, b in out]


def _touches(seg: dict[str, Any], a: float, b: float) -> bool:
    s, e = float(seg["start"]), float(seg["end"])
    return (e > a and s < b) if e > s else a <= s <= b


def fit_segments(segments: list[dict[str, Any]], turns: Sequence[Turn]) -> None:
    """Set each speaker-named segment's ``start``/``end`` from its speaker's turns (in place;
    ``segments[i]["speaker"]`` must be a name the turns use)."""
    speakers = {s.get("speaker") for s in segments} - {None}
    for x in speakers:
        own = sorted((s for s in segments if s.get("speaker") == x),
                     key=lambda s: (float(s["start"]), float(s["end"])))
        hull: dict[int, list[float]] = {}
        for a, b in merged(turns, str(x)):
            near = [s for s in own if _touches(s, a, b)]
            for p, seg in enumerate(near):
                lo = a if p == 0 else (float(near[p - 1]["end"]) + float(seg["start"])) / 2
                hi = (b if p == len(near) - 1
                      else (float(seg["end"]) + float(near[p + 1]["start"])) / 2)
                lo, hi = max(lo, a), min(hi, b)
                if hi <= lo:
                    continue
                h = hull.setdefault(id(seg), [lo, hi])
                h[0], h[1] = min(h[0], lo), max(h[1], hi)
        for seg in own:
            if id(seg) in hull:
                seg["start"], seg["end"] = (round(v, 3) for v in hull[id(seg)])


def wordless_segments(segments: list[dict[str, Any]], turns: Sequence[Turn]) -> None:
    """Insert (in time order) a segment with empty text for every piece of a speaker's turns
    of at least ``MIN_WORDLESS_S`` that none of that speaker's segments covers (in place)."""
    added: list[dict[str, Any]] = []
    for x in sorted({t.speaker for t in turns}):
        covered = sorted((float(s["start"]), float(s["end"])) for s in segments
                         if s.get("speaker") == x)
        for a, b in merged(turns, x):
            for lo, hi in _minus(a, b, covered):
                if hi - lo >= MIN_WORDLESS_S:
                    added.append({"start": round(lo, 3), "end": round(hi, 3), "text": "",
                                  "tokens": [], "speaker": x})
    for seg in sorted(added, key=lambda s: s["start"]):
        at = next((k for k, s in enumerate(segments) if float(s["start"]) > seg["start"]),
                  len(segments))
        segments.insert(at, seg)


def _minus(a: float, b: float, spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[a, b] without the (sorted) ``spans``."""
    out, cur = [], a
    for s, e in spans:
        if e <= cur or s >= b:
            continue
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
    if cur < b:
        out.append((cur, b))
    return out
