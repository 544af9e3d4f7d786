"""loadtest/diarization_words.py: whether Whisper's words cover the speech the diarizer misses
(issue 49), on fake references, turns and words."""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.diarization_words import coverage, frames, scored, with_words


def _word(start: float, end: float, speaker: str = "A", p: float = 0.9) -> dict[str, Any]:
    return {"word": "w", "start": start, "end": end, "probability": p, "speaker": speaker}


def test_frames_and_collar() -> None:
    m = frames([(0.5, 1.0, "x")], 200)
    assert m.sum() == 50 and m[50] and not m[49] and not m[100]
    ok = scored([(0.5, 1.0, "x")], 200)
    assert ok[24] and not ok[25] and not ok[74] and not ok[75] and not ok[124] and ok[125]
    assert isinstance(ok, np.ndarray)


def test_missed_speech_covered_by_words_and_vad() -> None:
    ref = [(0.0, 4.0, "A"), (6.0, 10.0, "B")]
    turns = [(0.0, 4.0, "S0")]  # B's speech is missed
    words = [_word(7.0, 8.0, "S0"), _word(4.5, 5.5, "S0")]  # one in B's speech, one in silence
    c = coverage(ref, turns, words, 12.0, vad=[(6.0, 10.0)])
    # B's 4 s, less the collar at 6.0 and 10.0 (0.25 s each side inside it)
    assert c["missed_s"] == 3.5
    assert c["missed_in_words_s"] == 1.0
    assert c["missed_heard_by_vad_s"] == 3.5
    assert c["words_outside_turns_s"] == 2.0
    assert c["words_outside_turns_not_speech_s"] == 1.0


def test_no_words_no_cover() -> None:
    c = coverage([(1.0, 3.0, "A")], [], [], 4.0)
    assert c["missed_s"] == 1.5 and c["missed_in_words_s"] == 0.0
    assert c["words_outside_turns_s"] == 0.0


def test_with_words_caps_and_filters() -> None:
    turns = [(0.0, 1.0, "S0")]
    words = [_word(2.0, 4.0, "S1", 0.9), _word(5.0, 5.2, "S0", 0.2),
             {"word": "x", "start": 6.0, "end": 6.0, "speaker": "S0"}]
    assert with_words(turns, words, None) == [(0.0, 1.0, "S0"), (2.0, 4.0, "S1"),
                                              (5.0, 5.2, "S0")]
    assert with_words(turns, words, 0.5) == [(0.0, 1.0, "S0"), (2.0, 2.5, "S1"),
                                             (5.0, 5.2, "S0")]
    assert with_words(turns, words, 0.5, 0.5) == [(0.0, 1.0, "S0"), (2.0, 2.5, "S1")]
