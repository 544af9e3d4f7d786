"""Subtitle options (line width, lines per cue, longest cue) and TSV: pure functions, no model.
End to end (GET /jobs/{id}/result, /v1, /asr with these options) in tests/test_asr.py."""

from __future__ import annotations

import itertools

import srt
import webvtt

from app.results.formats import CueOptions, cues, render, segment_words

SENTENCE = "The quick brown fox jumps over the lazy dog near the riverbank today."
WORDS = SENTENCE.split()


def timed_result(with_words: bool = True) -> dict:
    """Two segments; the first one's words half a second apart, as alignment gives them."""
    first = [{"word": w, "start": 1.0 + 0.5 * k, "end": 1.0 + 0.5 * k + 0.4, "probability": 0.9}
             for k, w in enumerate(WORDS)]
    seg1 = {"id": 0, "start": first[0]["start"], "end": first[-1]["end"], "text": SENTENCE,
            "tokens": [1, 2], "avg_logprob": -0.2, "compression_ratio": 1.2,
            "no_speech_prob": 0.01, "temperature": 0.0, "seek": 100}
    last = {"word": "Done.", "start": 9.0, "end": 9.5, "probability": 0.8}
    seg2 = {"id": 1, "start": 9.0, "end": 9.5, "text": "Done.", "tokens": [3],
            "avg_logprob": -0.1, "compression_ratio": 1.0, "no_speech_prob": 0.0,
            "temperature": 0.0, "seek": 900}
    return {"text": f"{SENTENCE} Done.", "language": "en", "duration": 10.0,
            "language_probability": 0.97, "segments": [seg1, seg2],
            "words": [*first, last] if with_words else None}


def check(cs: list) -> None:
    for a, b in itertools.pairwise(cs):
        assert a.start <= b.start and a.end <= b.start
    assert all(0 <= c.start <= c.end <= 10.0 for c in cs)


def test_defaults_keep_one_cue_per_segment() -> None:
    cs = cues(timed_result())
    assert [c.text for c in cs] == [SENTENCE, "Done."]
    assert (cs[0].start, cs[0].end) == (1.0, 7.4)


def test_line_count_splits_at_words_with_their_own_times() -> None:
    opts = CueOptions(max_line_width=20, max_line_count=1)
    cs = cues(timed_result(), opts)
    check(cs)
    assert all(len(c.text) <= 20 for c in cs)
    assert " ".join(c.text for c in cs) == f"{SENTENCE} Done."  # nothing lost or reordered
    by_word = {w["word"]: w for w in timed_result()["words"]}
    for c in cs:  # each cue starts at its first word's start and ends at its last word's end
        assert c.start == by_word[c.text.split()[0]]["start"]
        assert c.end == by_word[c.text.split()[-1]]["end"]
    subs = list(srt.parse(render(timed_result(), "srt", opts)))
    assert all("\n" not in s.content for s in subs) and len(subs) == len(cs)


def test_longest_cue_without_word_times_shares_time_by_characters() -> None:
    opts = CueOptions(max_cue_s=2.0)
    cs = cues(timed_result(with_words=False), opts)
    check(cs)
    assert len(cs) >= 4 and all(c.end - c.start <= 2.0 + 1e-6 for c in cs)
    assert cs[0].start == 1.0 and cs[-2].end == 7.4  # the segment's span, shared out
    assert " ".join(c.text for c in cs) == f"{SENTENCE} Done."


def test_line_width_wraps_and_vtt_parses() -> None:
    text = render(timed_result(), "vtt", CueOptions(max_line_width=16))
    parsed = webvtt.from_string(text).captions
    assert len(parsed) == 2
    assert all(len(line) <= 16 for c in parsed for line in c.text.split("\n"))


def test_a_word_longer_than_the_line_still_gets_a_cue() -> None:
    res = timed_result(with_words=False)
    res["segments"] = [{"id": 0, "start": 0.0, "end": 3.0, "text": "Pneumonoultramicroscopic."}]
    cs = cues(res, CueOptions(max_line_width=10, max_line_count=1))
    assert [c.text for c in cs] == ["Pneumonoultramicroscopic."]


def test_tsv_is_whispers_shape() -> None:
    res = timed_result()
    res["segments"][1]["text"] = "Tab\there."
    res["words"] = None
    lines = render(res, "tsv").splitlines()
    assert lines[0] == "start\tend\ttext"
    assert lines[1] == f"1000\t7400\t{SENTENCE}"
    assert lines[2] == "9000\t9500\tTab here."  # a tab in the text would add a column


def test_words_are_matched_to_their_segments() -> None:
    res = timed_result()
    pairs = list(segment_words(res))
    assert [len(ws or []) for _, ws in pairs] == [len(WORDS), 1]
    res["words"] = res["words"][:-1]  # a result whose words do not add up: no words, no guess
    assert list(segment_words(res))[1][1] is None
