"""Speaker names on a transcript: words get the speaker they overlap most, segments split where
the speaker changes.

Input is the service's transcript dict (``app/results/transcript.py`` ``transcript()``): ``segments`` with
``start``/``end``/``text`` and, with word timestamps, ``words`` (``word``/``start``/``end``).
- A word takes the speaker whose turns overlap it longest; a word in no turn (a pause the
  segmentation model heard as silence) takes the nearest turn's speaker, as whisperx's
  ``assign_word_speakers(fill_nearest=True)`` does, so every word has a speaker.
- Words are a segment's own ``words``, or (the service's shape) the top-level ``words`` that
  lie inside the segment's times.
- A segment with words is split into runs of consecutive words of one speaker; each piece's
  text is the slice of the segment's text from its first word to the next piece's (words are
  found in the text in order, so scripts without spaces keep their text unchanged), its times
  are its words'. Pieces keep the segment's decode statistics; a split segment's ``tokens`` are
  dropped (they are not per word in the dict). Segments are renumbered.
- A segment without words cannot be split at a time inside its text: it takes the speaker of
  the longest overlap (or the nearest turn), whole.
- Speakers are renamed ``SPEAKER_00``, ``SPEAKER_01``, ... in order of first appearance in the
  transcript, whatever the turns call them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.speakers.turns import Turn, label


class _Turns:
    def __init__(self, turns: Sequence[Turn]) -> None:
        self.turns = sorted(turns)
        self.starts = np.array([t.start for t in self.turns], dtype=np.float64)
        self.ends = np.array([t.end for t in self.turns], dtype=np.float64)

    def speaker(self, start: float, end: float) -> str | None:
        """The speaker overlapping [start, end] longest, else the nearest one."""
        if not self.turns:
            return None
        overlap = np.minimum(self.ends, end) - np.maximum(self.starts, start)
        by: dict[str, float] = {}
        for t, o in zip(self.turns, overlap, strict=True):
            if o > 0:
                by[t.speaker] = by.get(t.speaker, 0.0) + float(o)
        if by:
            return max(sorted(by), key=by.__getitem__)  # a tie goes to the first name
        mid = (start + end) / 2
        gap = np.maximum(self.starts - mid, 0) + np.maximum(mid - self.ends, 0)
        return self.turns[int(np.argmin(gap))].speaker


def assign_speakers(transcript: dict[str, Any], turns: Sequence[Turn]) -> dict[str, Any]:
    """A copy of ``transcript`` with ``speaker`` on every segment and word, segments split at
    speaker changes, and ``speakers`` (names in order of first appearance). Words are read from
    each segment's ``words`` if segments have them, else from the top-level ``words`` (the
    service's shape, where each segment's words lie inside its times); the shape is kept."""
    out = copy.deepcopy(transcript)
    index = _Turns(turns)
    segs: list[dict[str, Any]] = out.get("segments") or []
    nested = any("words" in s for s in segs)
    groups = ([s.pop("words", None) or [] for s in segs] if nested
              else _distribute(out.get("words") or [], segs))
    segments: list[dict[str, Any]] = []
    for seg, words in zip(segs, groups, strict=True):
        for w in words:
            w["speaker"] = index.speaker(float(w["start"]), float(w["end"]))
        if not words:
            seg["speaker"] = index.speaker(float(seg["start"]), float(seg["end"]))
            pieces = [(seg, words)]
        else:
            pieces = _split(seg, words)
        for piece, ws in pieces:
            if nested:
                piece["words"] = ws
            segments.append(piece)
    for k, seg in enumerate(segments):
        seg["id"] = k
    out["segments"] = segments
    if out.get("words"):
        out["words"] = [w for ws in groups for w in ws]
    names: list[str] = []
    for s in segments:
        if s.get("speaker") and s["speaker"] not in names:
            names.append(s["speaker"])
    # Renumbered by first appearance in the transcript: the clustering numbers speakers by
    # their first 1.5 s crop, which can lie in speech the transcript has no words for (on
    # pyannote-sample the first words were SPEAKER_01's). Turn names are labels only.
    rename = {n: label(k) for k, n in enumerate(names)}
    for s in segments:
        if s.get("speaker"):
            s["speaker"] = rename[s["speaker"]]
    for ws in groups:
        for w in ws:
            if w.get("speaker"):
                w["speaker"] = rename.get(w["speaker"], w["speaker"])
    out["speakers"] = [rename[n] for n in names]
    return out


def _distribute(words: list[dict[str, Any]], segs: list[dict[str, Any]]
                ) -> list[list[dict[str, Any]]]:
    """Top-level words to the segment whose times hold them (else the nearest), in order."""
    groups: list[list[dict[str, Any]]] = [[] for _ in segs]
    if not segs:
        return groups
    mids = np.array([(float(s["start"]) + float(s["end"])) / 2 for s in segs])
    for w in words:
        inside = [k for k, s in enumerate(segs)
                  if float(s["start"]) - 1e-3 <= float(w["start"])
                  and float(w["end"]) <= float(s["end"]) + 1e-3]
        mid = (float(w["start"]) + float(w["end"])) / 2
        k = inside[0] if inside else int(np.argmin(np.abs(mids - mid)))
        groups[k].append(w)
    return groups


def _split(seg: dict[str, Any], words: list[dict[str, Any]]
           ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    runs: list[list[dict[str, Any]]] = []
    for w in words:
        if runs and runs[-1][-1]["speaker"] == w["speaker"]:
            runs[-1].append(w)
        else:
            runs.append([w])
    if len(runs) == 1:
        seg["speaker"] = runs[0][0]["speaker"]
        return [(seg, words)]
    text = seg.get("text", "")
    cuts = _word_offsets(text, words)
    pieces = []
    first = 0
    for r, run in enumerate(runs):
        last = first + len(run)
        if cuts is not None:
            a = 0 if r == 0 else cuts[first]
            b = len(text) if r == len(runs) - 1 else cuts[last]
            piece_text = text[a:b].strip()
        else:
            piece_text = " ".join(w["word"] for w in run)
        piece = {**seg, "start": run[0]["start"], "end": run[-1]["end"], "text": piece_text,
                 "speaker": run[0]["speaker"], "tokens": []}
        pieces.append((piece, run))
        first = last
    return pieces


def _word_offsets(text: str, words: list[dict[str, Any]]) -> list[int] | None:
    """Where each word starts in ``text``, searching in order; None if one is not found."""
    out, pos = [], 0
    for w in words:
        token = str(w["word"]).strip()
        at = text.find(token, pos) if token else pos
        if at < 0:
            return None
        out.append(at)
        pos = at + len(token)
    return out
