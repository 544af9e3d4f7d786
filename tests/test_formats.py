"""Subtitle and verbose rendering, sentence segments, and the CLI's event parser (no model)."""

from __future__ import annotations

import itertools

import numpy as np
import srt
import webvtt

from app.client.transcribe import sse_events
from app.engine.words import first_sound, sound_starts
from app.results.formats import render
from app.results.openai import verbose_json
from app.results.transcript import split_sentences, window_segments
from app.windows import SAMPLE_RATE, Window, WindowResult, Word


def vtt_cues(text: str) -> list[tuple[float, float, str]]:
    return [(_secs(c.start), _secs(c.end), c.text) for c in webvtt.from_string(text).captions]


def _secs(stamp: str) -> float:
    h, m, s = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def result(segments: list[tuple[float, float, str]], duration: float) -> dict:
    return {"text": " ".join(t for _, _, t in segments), "duration": duration, "language": "en",
            "segments": [{"id": k, "start": a, "end": b, "text": t}
                         for k, (a, b, t) in enumerate(segments)]}


# Overlapping, backwards and past-the-end segments: what real windows can look like.
MESSY = result([(0.0, 4.2, "One two."), (3.9, 8.0, "Three <four> & five --> six."),
                (7.5, 7.0, "Seven."), (9.0, 12.5, ""), (10.0, 13.0, "Past the end.")], 11.0)


def check_cues(cues: list[tuple[float, float, str]], duration: float) -> None:
    assert cues
    for (a, b, _), (c, _, _) in itertools.pairwise(cues):
        assert a <= c and b <= c  # starts monotonic, no overlap
    for a, b, _ in cues:
        assert 0 <= a <= b <= duration


def test_srt_parses_monotonic_inside_duration() -> None:
    subs = list(srt.parse(render(MESSY, "srt")))
    cues = [(s.start.total_seconds(), s.end.total_seconds(), s.content) for s in subs]
    check_cues(cues, 11.0)
    assert [s.index for s in subs] == list(range(1, len(subs) + 1))
    assert "Three <four> & five --> six." in " ".join(c.replace("\n", " ") for *_, c in cues)


def test_vtt_parses_escaped_monotonic_inside_duration() -> None:
    text = render(MESSY, "vtt")
    assert text.startswith("WEBVTT")
    cues = vtt_cues(text)
    check_cues(cues, 11.0)
    assert len(cues) == 4  # the empty segment is not a cue; the "-->" did not split one
    assert "&lt;four&gt; &amp; five --&gt; six." in text


def test_long_cue_text_is_wrapped_without_blank_lines() -> None:
    long = result([(0.0, 30.0, "word " * 60)], 30.0)
    (sub,) = srt.parse(render(long, "srt"))
    lines = sub.content.split("\n")
    assert len(lines) > 1 and all(0 < len(line) <= 42 for line in lines)


def words(spec: list[tuple[str, float, float]]) -> list[Word]:
    return [Word(w, a, b, 0.9, [k]) for k, (w, a, b) in enumerate(spec)]


def test_sentences_split_at_marks_and_long_ones_at_pauses() -> None:
    ws = words([(" Hello", 0.0, 0.4), (" there.", 0.4, 0.9), (" How", 1.5, 1.7),
                (" are", 1.7, 1.9), (" you?", 1.9, 2.3)])
    assert [[w.word for w in g] for g in split_sentences(ws)] == [
        [" Hello", " there."], [" How", " are", " you?"]]
    run_on = words([(f" w{i}{',' if i == 9 else ''}", i * 0.5, i * 0.5 + 0.4) for i in range(20)])
    run_on[10].start += 0.3  # a pause after the comma
    groups = split_sentences(run_on, max_s=6.0)
    assert len(groups) >= 2 and groups[0][-1].word == " w9,"
    assert [w for g in groups for w in g] == run_on  # nothing lost or reordered


def test_window_segments_carry_decode_fields_and_stay_in_window() -> None:
    w = Window(np.zeros(SAMPLE_RATE * 10, dtype=np.float32), 20.0, 30.0)
    ws = words([(" One.", 20.5, 21.0), (" Two", 22.0, 22.4), (" three.", 22.4, 23.0)])
    r = WindowResult("One. Two three.", "en", None, -0.2, 0.01, 1.1, [1, 2, 3],
                     temperature=0.2, words=ws)
    segs = window_segments(w, r)
    assert [s["text"] for s in segs] == ["One.", "Two three."]
    assert all(w.start <= s["start"] <= s["end"] <= w.end for s in segs)
    assert all(s["temperature"] == 0.2 and s["avg_logprob"] == -0.2 for s in segs)
    assert segs[1]["tokens"] == [1, 2] and segs[1]["seek"] == 2000
    plain = window_segments(w, WindowResult(" All.", "en", None, -0.1, 0.0, 1.0, [7]))
    assert plain[0]["start"] == 20.0 and plain[0]["end"] == 30.0 and plain[0]["words"] == []


def test_sound_onset_finds_speech_after_silence() -> None:
    rng = np.random.default_rng(0)
    audio = rng.normal(0, 1e-4, SAMPLE_RATE * 3).astype(np.float32)
    audio[int(1.2 * SAMPLE_RATE):] += np.sin(np.arange(int(1.8 * SAMPLE_RATE)) / 5).astype(
        np.float32) * 0.3
    sound = sound_starts(audio)
    onset = first_sound(sound, 0.0, 2.0)
    assert onset is not None and abs(onset - 1.2) <= 0.03
    assert first_sound(sound, 1.5, 2.0) is None  # already in sound: nothing to move
    assert sound_starts(np.zeros(SAMPLE_RATE, dtype=np.float32)) is None  # no contrast


def test_verbose_json_shape() -> None:
    res = result([(0.0, 2.0, "Hi.")], 2.5)
    res["segments"][0].update(tokens=[1], avg_logprob=-0.1, compression_ratio=1.0,
                              no_speech_prob=0.0, temperature=0.0, seek=0)
    res["words"] = [{"word": "Hi.", "start": 0.1, "end": 0.5, "probability": 0.9}]
    out = verbose_json(res, "transcribe", words=True)
    assert out["language"] == "english" and out["task"] == "transcribe"
    # The word's probability, as /transcribe has it (issue 36: OpenAI's words have none).
    assert out["words"] == [{"word": "Hi.", "start": 0.1, "end": 0.5, "probability": 0.9}]
    assert set(out["segments"][0]) >= {"id", "start", "end", "text", "tokens", "avg_logprob",
                                       "compression_ratio", "no_speech_prob", "temperature"}
    assert "words" not in verbose_json(res, "transcribe", words=False)


def test_cli_parses_server_sent_events() -> None:
    lines = ["retry: 2000", "", "id: 1", "event: progress", 'data: {"windows_done": 1}', "",
             ": keep-alive", "", "event: done", 'data: {"status":', 'data: "done"}', ""]
    assert list(sse_events(iter(lines))) == [("progress", {"windows_done": 1}),
                                             ("done", {"status": "done"})]
