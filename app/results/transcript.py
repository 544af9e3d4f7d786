"""A job's result from its windows' results: text, segments (sentences when words have times).

Pure functions, run once per job when its last window is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine.words import SENTENCE_END
from app.windows import Window, WindowResult, Word

# A sentence longer than either is cut at its best pause: segments stay subtitle-sized.
MAX_SEGMENT_S = 8.0
MAX_SEGMENT_CHARS = 100


def transcript(windows: Sequence[Window], results: Sequence[WindowResult], language: str | None,
               duration: float, word_timestamps: bool,
               channels: Sequence[int] | None = None) -> dict[str, Any]:
    """A job's result from its windows' results (in upload order): sentence segments when
    word times exist (better subtitles), else one segment per window.

    ``channels`` (``channels=separate``): each window's channel. Segments and their words then
    carry ``speaker`` = ``channel_<k>`` and are merged in time order (by start; a tie keeps
    channel order), and ``speakers`` lists the labels of the channels that have speech."""
    per_window = [window_segments(w, r) for w, r in zip(windows, results, strict=True)]
    segments = [s for segs in per_window for s in segs]
    out: dict[str, Any] = {}
    if channels is not None:
        for segs, c in zip(per_window, channels, strict=True):
            for s in segs:
                s["speaker"] = channel_label(c)
                for wd in s["words"]:
                    wd["speaker"] = s["speaker"]
        segments.sort(key=lambda s: s["start"])  # stable: windows of one channel stay in order
        out["speakers"] = [channel_label(c) for c in sorted(set(channels))]
    words = [wd for s in segments for wd in s.pop("words")]
    for k, s in enumerate(segments):
        s["id"] = k
    return {
        "text": " ".join(s["text"] for s in segments if s["text"]),
        "language": language,
        "language_probability": results[0].language_probability if results else None,
        "duration": duration, "segments": segments,
        "words": words if word_timestamps else None,
        **out,
    }


def channel_label(channel: int) -> str:
    """The speaker name of a channel with ``channels=separate`` (0-based, in stream order)."""
    return f"channel_{channel}"


def window_segments(window: Window, result: WindowResult) -> list[dict[str, Any]]:
    """One window's segments: sentences when word times exist, else the whole window.

    Every segment of a window shares its decode's avg_logprob, no_speech_prob,
    compression_ratio and temperature, as in openai-whisper where they are per 30 s decode.
    """
    common = {"language": result.language,
              "avg_logprob": result.avg_logprob, "no_speech_prob": result.no_speech_prob,
              "compression_ratio": result.compression_ratio, "temperature": result.temperature,
              "seek": round(window.start * 100)}
    if not result.words:
        return [{"start": round(window.start, 3), "end": round(window.end, 3),
                 "text": result.text.strip(), "tokens": result.tokens, "words": [], **common}]
    return [
        {"start": ws[0].start, "end": ws[-1].end, "text": "".join(w.word for w in ws).strip(),
         "tokens": [t for w in ws for t in w.tokens], "words": [_word_dict(w) for w in ws],
         **common}
        for ws in split_sentences(result.words)
    ]


def _word_dict(w: Word) -> dict[str, Any]:
    return {"word": w.word.strip(), "start": w.start, "end": w.end, "probability": w.probability}


def split_sentences(words: Sequence[Word], max_s: float = MAX_SEGMENT_S) -> list[list[Word]]:
    """Group words into sentences; a sentence longer than ``max_s`` splits at its longest pause."""
    groups: list[list[Word]] = []
    cur: list[Word] = []
    for w in words:
        cur.append(w)
        if w.word.strip().endswith(SENTENCE_END):
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    out: list[list[Word]] = []
    for g in groups:
        out.extend(_split_long(g, max_s))
    return out


def _split_long(ws: list[Word], max_s: float) -> list[list[Word]]:
    chars = sum(len(w.word) for w in ws)
    if len(ws) < 2 or (ws[-1].end - ws[0].start <= max_s and chars <= MAX_SEGMENT_CHARS):
        return [ws]
    gaps = [(ws[i].start - ws[i - 1].end, i) for i in range(1, len(ws))]
    # The longest pause, with a bonus for one after a comma-like mark (a natural break).
    best = max(gaps, key=lambda g: g[0] + 0.3 * ws[g[1] - 1].word.rstrip().endswith((",", ";", ":")))[1]
    return _split_long(ws[:best], max_s) + _split_long(ws[best:], max_s)
