"""Speakers in the outputs, without models: SRT/VTT/TSV and diarized_json rendering, the
transcript of ``channels=separate``, and each channel of a stereo upload cut on its own."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import srt
import webvtt

from app.audio import AudioStream, decode, prepare
from app.audio.vad import SileroVad
from app.results.formats import CueOptions, render
from app.results.openai import diarized_json, speaker_letter
from app.results.transcript import transcript
from app.windows import SAMPLE_RATE, Window, WindowResult, Word
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip


def named(*segments: tuple[float, float, str, str | None]) -> dict[str, Any]:
    return {"text": " ".join(t for _, _, t, _ in segments), "duration": 20.0, "language": "en",
            "speakers": sorted({s for *_, s in segments if s}),
            "segments": [{"id": k, "start": a, "end": b, "text": t,
                          **({"speaker": s} if s else {})}
                         for k, (a, b, t, s) in enumerate(segments)]}


DIALOGUE = named((0.5, 2.0, "Hello there.", "SPEAKER_00"),
                 (2.5, 4.0, "Hi <you> & me.", "SPEAKER_01"),
                 (4.5, 6.0, "Bye.", "SPEAKER_00"))


def test_srt_cues_are_prefixed_with_their_speaker() -> None:
    subs = list(srt.parse(render(DIALOGUE, "srt")))
    assert [s.content for s in subs] == ["[SPEAKER_00] Hello there.", "[SPEAKER_01] Hi <you> & me.",
                                         "[SPEAKER_00] Bye."]


def test_vtt_cues_are_voice_spans_and_escaped() -> None:
    text = render(DIALOGUE, "vtt")
    assert "<v SPEAKER_01>Hi &lt;you&gt; &amp; me." in text
    cues = webvtt.from_string(text).captions
    assert [c.voice for c in cues] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_00"]
    # webvtt-py strips the tags and leaves the entities as they are.
    assert [html.unescape(c.text) for c in cues] == ["Hello there.", "Hi <you> & me.", "Bye."]
    # A label that is markup itself cannot break out of the annotation.
    odd = named((0.0, 1.0, "x", "a>b & <c>"))
    assert "<v a&gt;b &amp; &lt;c&gt;>x" in render(odd, "vtt")


def test_tsv_gets_a_speaker_column_only_when_there_are_speakers() -> None:
    rows = [r.split("\t") for r in render(DIALOGUE, "tsv").splitlines()]
    assert rows[0] == ["start", "end", "text", "speaker"]
    assert rows[2] == ["2500", "4000", "Hi <you> & me.", "SPEAKER_01"]
    plain = named((0.5, 2.0, "Hello there.", None))
    assert render(plain, "tsv").splitlines()[0] == "start\tend\ttext"
    assert render(plain, "srt") == render({**plain, "speakers": None}, "srt")
    assert "[" not in render(plain, "srt") and "<v" not in render(plain, "vtt")


def test_cut_cues_keep_the_speaker_and_count_the_prefix_in_their_lines() -> None:
    long = named((0.0, 8.0, "one two three four five six seven eight nine ten", "SPEAKER_00"))
    opts = CueOptions(max_line_width=20, max_line_count=1)
    subs = list(srt.parse(render(long, "srt", opts)))
    assert len(subs) > 1
    for s in subs:
        assert s.content.startswith("[SPEAKER_00] ") and "\n" not in s.content


def test_diarized_json_names_speakers_as_openai_does() -> None:
    from openai.types.audio import TranscriptionDiarized

    out = diarized_json({**DIALOGUE, "speakers": ["SPEAKER_00", "SPEAKER_01"]})
    parsed = TranscriptionDiarized.model_validate(out)
    assert [(s.id, s.speaker, s.text) for s in parsed.segments] == [
        ("seg_0", "A", "Hello there."), ("seg_1", "B", "Hi <you> & me."), ("seg_2", "A", "Bye.")]
    assert parsed.task == "transcribe" and parsed.usage is not None
    assert parsed.usage.type == "duration" and parsed.usage.seconds == 20.0
    assert [speaker_letter(k) for k in (0, 25, 26, 27)] == ["A", "Z", "AA", "AB"]


# ---- channels=separate ---------------------------------------------------------------------
def result_of(text: str, start: float, end: float) -> WindowResult:
    words = [Word(f" {w}", start + k * 0.5, start + k * 0.5 + 0.4, 0.9)
             for k, w in enumerate(text.split())]
    return WindowResult(text=" " + text, language="en", language_probability=None,
                        avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=1.0, words=words)


def test_channels_are_labelled_and_merged_in_time_order() -> None:
    windows = [Window(np.zeros(16_000, np.float32), s, e) for s, e in
               ((0.0, 3.0), (10.0, 12.0), (1.0, 4.0))]
    results = [result_of("left one.", 0.0, 3.0), result_of("left two.", 10.0, 12.0),
               result_of("right one.", 1.0, 4.0)]
    out = transcript(windows, results, "en", 12.0, True, channels=[0, 0, 1])
    assert [(s["speaker"], s["text"]) for s in out["segments"]] == [
        ("channel_0", "left one."), ("channel_1", "right one."), ("channel_0", "left two.")]
    assert [s["id"] for s in out["segments"]] == [0, 1, 2]
    assert out["text"] == "left one. right one. left two."
    assert out["speakers"] == ["channel_0", "channel_1"]
    # Words follow their segments (what the subtitle renderer pairs them by), each named.
    assert [(w["word"], w["speaker"]) for w in out["words"]][:4] == [
        ("left", "channel_0"), ("one.", "channel_0"), ("right", "channel_1"),
        ("one.", "channel_1")]
    plain = transcript(windows, results, "en", 12.0, True)
    assert "speakers" not in plain and all("speaker" not in s for s in plain["segments"])


def stereo(clips: list[Clip], path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Two different read-speech clips, one per channel, written as a 16-bit stereo WAV."""
    a, b = (decode(c.path, 3600) for c in two_clips(clips))
    n = max(len(a), len(b))
    left, right = np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))
    write_stereo(path, left, right)
    return left, right


def two_clips(clips: list[Clip]) -> list[Clip]:
    read = sorted((c for c in clips if c.set == "librispeech" and 8 < c.duration_s < 20),
                  key=lambda c: c.id)
    assert len(read) >= 2, "the corpus needs two librispeech clips of 8-20 s"
    return read[:2]


def write_stereo(path: Path, left: np.ndarray, right: np.ndarray) -> None:
    import wave

    pcm = (np.clip(np.stack([left, right], 1), -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())


@pytest.mark.parametrize("chunk_s", [5.0, 60.0])
def test_each_channel_is_cut_as_if_it_were_its_own_upload(
        clips: list[Clip], tmp_path: Path, chunk_s: float) -> None:
    """Windows of channel k of a stereo upload = the windows of channel k alone as a mono
    file, at any chunk size (the VAD and cutter of each channel carry across chunks)."""
    left, right = stereo(clips, tmp_path / "stereo.wav")
    vad = SileroVad()
    alone = []
    for k, signal in enumerate((left, right)):
        write_wav16(tmp_path / f"ch{k}.wav", signal, SAMPLE_RATE)
        alone.append(prepare(tmp_path / f"ch{k}.wav", vad, 3600)[1])
    stream = AudioStream(tmp_path / "stereo.wav", vad, 3600, chunk_s, separate=True)
    got: list[list[Window]] = [[], []]
    audio = []
    try:
        while not stream.done:
            chunk = stream.read_chunk()
            audio.append(chunk.audio)
            for w, c in zip(chunk.windows, chunk.channels, strict=True):
                got[c].append(w)
    finally:
        stream.close()
    assert stream.channels == 2
    for k in (0, 1):
        assert [(w.start, w.end) for w in got[k]] == [(w.start, w.end) for w in alone[k]]
        assert all(np.array_equal(a.audio, b.audio) for a, b in zip(got[k], alone[k], strict=True))
    pcm = np.concatenate(audio, axis=1)
    assert pcm.shape == (2, len(left))
    assert np.abs(pcm[0] - left).max() < 1e-4 and np.abs(pcm[1] - right).max() < 1e-4


def test_the_mono_mix_chunks_add_up_to_the_decoded_upload(clips: list[Clip]) -> None:
    clip = max(clips, key=lambda c: c.duration_s)
    stream = AudioStream(clip.path, SileroVad(), 3600, 5.0)
    parts, starts = [], []
    try:
        while not stream.done:
            chunk = stream.read_chunk()
            parts.append(chunk.audio)
            starts.append(chunk.start_s)
            assert set(chunk.channels) <= {0} and len(chunk.channels) == len(chunk.windows)
    finally:
        stream.close()
    whole = decode(clip.path, 3600)
    assert np.array_equal(np.concatenate(parts), whole)
    assert starts == [sum(len(p) for p in parts[:k]) / SAMPLE_RATE for k in range(len(parts))]
    assert stream.channels == 1 and len(parts) > 1
