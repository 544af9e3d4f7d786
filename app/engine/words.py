"""Word timestamps from Whisper's cross-attention (sentence segments: app/results/transcript.py).

``word_timings`` is faster-whisper's ``find_alignment`` + ``add_word_timestamps`` for one window
decoded without timestamp tokens (whisperx style): CTranslate2's ``align`` gives, per text
token, the encoder frame its attention heads look at; a word starts where its first token's
frame jumps. The same two heuristics as faster-whisper keep words at sentence boundaries and
after the window's leading silence from swallowing the pause. ``align`` runs CTranslate2's
``align`` for a decoded batch (the engine calls it on its own thread); the rest are pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from app.engine.decoding import batch_rows
from app.engine.tokens import per_token, token_bytes
from app.windows import (
    HOP_LENGTH,
    N_FRAMES,
    SAMPLE_RATE,
    TOKENS_PER_SECOND,
    Window,
    WindowResult,
    Word,
    as_float,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = (".", "?", "!", "。", "？", "！", "…")


def align(model: Any, encoder_output: Any, windows: Sequence[Window],
          results: Sequence[WindowResult], tokenizers: dict[str, Any]) -> list[list[Word]]:
    """Word times from cross-attention (faster-whisper's method), one ``align`` per language.

    Reuses the batch's encoder output, so word timestamps cost one extra decoder pass over
    the already-known tokens, not a second model. A batch holds one language except when
    several jobs' first windows were detected differently: those run as separate groups.
    """
    out: list[list[Word]] = [[] for _ in windows]
    groups: dict[str, list[int]] = {}
    for k, r in enumerate(results):
        if any(t < tokenizers[r.language].eot for t in r.tokens):
            groups.setdefault(r.language, []).append(k)
    for lang, idx in groups.items():
        tok = tokenizers[lang]
        feats = batch_rows(encoder_output, idx)
        texts = [[t for t in results[k].tokens if t < tok.eot] for k in idx]
        frames = [min(N_FRAMES, len(windows[k].audio) // HOP_LENGTH) for k in idx]
        aligned = model.align(feats, tok.sot_sequence, texts, frames, median_filter_width=7)
        for k, text, a in zip(idx, texts, aligned, strict=True):
            out[k] = word_timings(tok, text, a, windows[k])
    return out


def word_timings(tok: Any, text_tokens: list[int], alignment: Any, window: Window) -> list[Word]:
    """Words of one window, in upload time, ordered, inside the window."""
    from faster_whisper.transcribe import merge_punctuations

    words, word_tokens = tok.split_to_word_tokens([*text_tokens, tok.eot])
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    text_idx = np.array([p[0] for p in alignment.alignments])
    time_idx = np.array([p[1] for p in alignment.alignments])
    if len(text_idx) == 0:
        return []
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    if len(jump_times) <= int(bounds[-1]):  # alignment shorter than the text: no trustworthy times
        return []
    probs = alignment.text_token_probs
    timing = [
        {"word": w, "tokens": t, "start": float(jump_times[i]), "end": float(jump_times[j]),
         "probability": float(np.mean(probs[i:j])) if j > i else 0.0}
        for w, t, i, j in zip(words, word_tokens, bounds[:-1], bounds[1:], strict=False)
    ]
    median, longest = _duration_caps(timing)
    if timing and longest > 0:
        # faster-whisper's hack: attention smears a sentence-end mark over the following pause.
        for i in range(1, len(timing)):
            if timing[i]["end"] - timing[i]["start"] > longest:
                if timing[i]["word"] in SENTENCE_END:
                    timing[i]["end"] = timing[i]["start"] + longest
                elif timing[i - 1]["word"] in SENTENCE_END:
                    timing[i]["start"] = timing[i]["end"] - longest
    merge_punctuations(timing, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    timing = [t for t in timing if t["word"]]
    per_token(timing, text_tokens, probs)  # include[]=logprobs (app/engine/tokens.py)
    if timing and longest > 0:
        _trim_first_word(timing, median, longest)
    sound = sound_starts(as_float(window.audio))
    for k, t in enumerate(timing):
        # Without timestamp tokens the alignment path starts at frame 0, so the first word
        # absorbs the window's leading silence (the VAD pads 1.4 s), and a word after a pause
        # often absorbs the pause: such a word starts where sound does, if that is inside it.
        # 0.2 s of quiet: longer than a soft consonant, so words are not cut into.
        onset = first_sound(sound, t["start"], t["end"] - 0.02)
        if onset is not None and (k == 0 or onset - t["start"] >= 0.2
                                  or t["end"] - t["start"] > longest):
            t["start"] = onset
    span = window.end - window.start
    out: list[Word] = []
    last = 0.0
    for t in timing:
        start = min(max(t["start"], last), span)
        end = min(max(t["end"], start), span)
        out.append(Word(t["word"], round(window.start + start, 3), round(window.start + end, 3),
                        round(t["probability"], 4), list(t["tokens"]), t["token_probs"],
                        token_bytes(tok.tokenizer, t["tokens"])))
        last = start
    return out


HOP_S = 0.01  # energy frames of 10 ms


def sound_starts(audio: np.ndarray) -> np.ndarray | None:
    """Per 10 ms frame: does 30 ms clearly above the window's noise floor start here?"""
    hop = round(SAMPLE_RATE * HOP_S)
    n = len(audio) // hop
    if n < 4:
        return None
    frames = audio[: n * hop].astype(np.float64).reshape(n, hop)
    db = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12)
    floor, peak = np.percentile(db, 10), np.percentile(db, 95)
    if peak - floor < 10:  # no clear speech/silence contrast: leave the alignment alone
        return None
    loud = db > floor + 0.3 * (peak - floor)
    result: np.ndarray = np.convolve(loud, np.ones(3, dtype=int), mode="valid") == 3
    return result


def first_sound(sound: np.ndarray | None, start: float, end: float) -> float | None:
    """The first sound in [start, end) (window seconds), None if none or already at start."""
    if sound is None:
        return None
    i, j = round(start / HOP_S), min(len(sound), round(end / HOP_S))
    hits = np.flatnonzero(sound[i:j]) if j > i else np.array([], dtype=int)
    return (i + int(hits[0])) * HOP_S if len(hits) and hits[0] > 0 else None


def _duration_caps(timing: list[dict[str, Any]]) -> tuple[float, float]:
    durations = np.array([t["end"] - t["start"] for t in timing])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    return median, median * 2


def _trim_first_word(timing: list[dict[str, Any]], median: float, longest: float) -> None:
    """The first word after the window's leading silence tends to start at 0: cap its length."""
    first = timing[0]
    if first["end"] > median * 4 and (
        first["end"] - first["start"] > longest
        or (len(timing) > 1 and timing[1]["end"] - first["start"] > longest * 2)
    ):
        if len(timing) > 1 and timing[1]["end"] - timing[1]["start"] > longest:
            boundary = max(timing[1]["end"] / 2, timing[1]["end"] - longest)
            first["end"] = timing[1]["start"] = boundary
        first["start"] = max(0.0, first["end"] - longest)
