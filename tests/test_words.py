"""Word timestamps: batched cross-attention alignment, checked on the corpus against a VAD."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from app.audio import decode, prepare
from app.audio.vad import SileroVad
from app.batching.batcher import Batcher
from app.config import BatcherSettings
from app.engine.placement import EngineRunner
from app.engine.whisper import WhisperEngine
from app.engine.words import align
from app.metrics import Metrics
from app.windows import N_SAMPLES, DecodeOptions, Prompt
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import Server
from tests.fakes import FakeEngine, tagged_window
from tests.helpers import openai_client
from tests.wer import normalise

TOLERANCE_S = 0.5


async def test_batches_never_mix_word_and_plain_windows() -> None:
    """word_timestamps and temperature are part of the batch key: one prompt/pass per batch."""
    fake = FakeEngine()
    b = Batcher(EngineRunner(fake).run, BatcherSettings(max_batch_size=8, max_wait_ms=20, job_memory_mb=0), 1,
                Metrics())
    b.start()
    try:
        kinds = [DecodeOptions(), DecodeOptions(word_timestamps=True),
                 DecodeOptions(temperature=0.5)]
        futs = [f for k, o in enumerate(kinds)
                for f in b.submit(f"job{k}", [tagged_window(10 * k + i) for i in range(3)], o)]
        await asyncio.wait_for(asyncio.gather(*futs), 30)
    finally:
        await b.stop(5)
    for opts, tags in fake.batches:
        assert {t // 10 for t in tags} == {kinds.index(opts)}


@pytest.mark.model
def test_alignment_is_the_same_in_a_batch_and_alone(engine: WhisperEngine,
                                                    clips: list[Clip]) -> None:
    vad = SileroVad()
    picked = [c for c in clips if c.set in READ_SPEECH][:3]
    windows = [w for c in picked for w in prepare(c.path, vad, 3600)[1]]
    for w in windows:
        w.prompt = Prompt(language="en")
    opts = DecodeOptions(word_timestamps=True)
    batch = engine.transcribe_batch(windows, opts)
    alone = [engine.transcribe_batch([w], opts)[0] for w in windows]
    for b, a, w in zip(batch, alone, windows, strict=True):
        assert b.words and [x.word for x in b.words] == [x.word for x in a.words or []]
        assert np.allclose([x.start for x in b.words], [x.start for x in a.words or []], atol=0.06)
        assert all(w.start <= x.start <= x.end <= w.end for x in b.words)
    # A batch whose windows were detected in different languages aligns per language group.
    from whisperx.audio import log_mel_spectrogram

    feats = np.stack([log_mel_spectrogram(w.audio, n_mels=80, padding=N_SAMPLES - len(w.audio))
                      .numpy() for w in windows]).astype(np.float32)
    mixed = [batch[0], replace(batch[1], language="fr"), *batch[2:]]
    toks = {lang: engine._decoder.prompts.tokenizer(lang, "transcribe") for lang in ("en", "fr")}
    regrouped = align(engine.model.model, engine.model.encode(feats), windows, mixed, toks)
    assert [[x.word for x in ws] for ws in regrouped] == [[x.word for x in r.words or []]
                                                          for r in batch]


def speech_regions(clip: Clip) -> list[tuple[float, float]]:
    """An independent reference: Silero VAD regions without padding, in seconds."""
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    samples = decode(clip.path, 3600)
    opts = VadOptions(threshold=0.5, speech_pad_ms=0, min_silence_duration_ms=500)
    return [(t["start"] / 16000, t["end"] / 16000) for t in get_speech_timestamps(samples, opts)]


def owner_segment(word: Any, segments: list[Any]) -> int:
    hits = [k for k, s in enumerate(segments) if s.start <= word.start and word.end <= s.end]
    assert hits, f"word {word} is in no segment"
    return hits[0]


def word_clips(clips: list[Clip]) -> list[Clip]:
    """Every reader and recording of the read sets, not every clip of each: all of librispeech
    (six speakers, one resampled to 8 kHz) and of librivox's short mp3 clips, every third of
    ljspeech's 22 (one reader in one studio: 8 clips, 1.5 s to 10 s among them), and one of the
    two librivox sonnets (one reader, one recording: 53 s, several windows, the segments and
    words across window joins). 192 s of audio instead of 329 s: the properties checked are per
    word and per clip, and the clips left out repeat a reader and a recording kept."""
    def of(s: str) -> list[Clip]:
        return [c for c in clips if c.set == s]

    return [*of("librispeech"), *of("ljspeech")[::3], *of("librivox"), *of("librivox_long")[:1]]


@pytest.fixture(scope="module")
def corpus_words(server: Server, clips: list[Clip]) -> list[tuple[Clip, Any]]:
    read = word_clips(clips)
    assert {c.set for c in read} == {*READ_SPEECH, "librivox_long"}
    oa = openai_client(server.url)

    def run(c: Clip) -> Any:
        with c.path.open("rb") as f:
            return oa.audio.transcriptions.create(
                model="whisper-1", file=f, response_format="verbose_json", language="en",
                timestamp_granularities=["word", "segment"])

    with ThreadPoolExecutor(4) as ex:
        return list(zip(read, ex.map(run, read), strict=True))


@pytest.mark.model
def test_words_are_ordered_inside_their_segments(corpus_words: list[tuple[Clip, Any]]) -> None:
    for clip, r in corpus_words:
        words, segs = r.words, r.segments
        assert words, clip.id
        starts = [w.start for w in words]
        assert starts == sorted(starts), clip.id
        assert all(0 <= w.start <= w.end <= r.duration for w in words), clip.id  # none past the end
        owners = [owner_segment(w, segs) for w in words]
        assert owners == sorted(owners), clip.id
        for k, s in enumerate(segs):
            mine = [w for w, o in zip(words, owners, strict=True) if o == k]
            assert normalise(" ".join(w.word for w in mine)) == normalise(s.text), clip.id
            # The segment's boundaries are its words' boundaries, within the tolerance.
            assert abs(mine[0].start - s.start) <= TOLERANCE_S
            assert abs(mine[-1].end - s.end) <= TOLERANCE_S


@pytest.mark.model
def test_word_starts_match_where_speech_starts(corpus_words: list[tuple[Clip, Any]]) -> None:
    """Against the VAD: each stretch of speech begins with a word starting within 0.5 s of it,
    and every word starts inside speech (give or take 0.5 s), never in a long silence."""
    misses = []
    for clip, r in corpus_words:
        regions = speech_regions(clip)
        for a, b in regions:
            first = next((w for w in r.words if w.start >= a - TOLERANCE_S), None)
            if first is None or first.start > b or abs(first.start - a) > TOLERANCE_S:
                misses.append((clip.id, "region", round(a, 2), first and round(first.start, 2)))
        for w in r.words:
            if not any(a - TOLERANCE_S <= w.start <= b + TOLERANCE_S for a, b in regions):
                misses.append((clip.id, "word", w.word, w.start))
    assert not misses, misses
