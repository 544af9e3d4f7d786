"""One pipeline builder (issue 48 item 1): the service (app/main.py) and the dataset path
(app/dataset/local.py) both build theirs with app/jobs/pipeline.py, so they decode alike.

Before, the dataset path built the batcher's stages without the decoder's ``redo=False``:
Whisper's fallbacks ran inside its decoder batches (the service runs them as calls of their
own, app/batching/urgency.py). The transcripts came out the same (tests/test_stages.py shows
the fallback apart gives the same text), so only the engine calls tell the drift: here the
real engine is wrapped to record every call's stage and decode options, both paths transcribe
the same clips, and their calls and transcripts must be equal.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import Settings
from app.dataset.local import Job, LocalPipeline
from app.engine import Engine
from app.engine.loading import load_whisper
from app.engine.placement import make_pool
from app.jobs.pipeline import make_batcher, make_prep, make_stages
from app.main import create_app
from app.metrics import Metrics
from app.windows import DecodeOptions, Encoded, JobOptions, Window, WindowResult
from loadtest.lib.corpus import Clip
from tests.fakes import FakeEngine, FakeStagedEngine
from tests.helpers import serve

LOOPING = ("mfa-mfa_uhuh", "mfa-mfa_whatscalled", "mfa-mfa_breathy")  # fallbacks on this host
Call = tuple[str, DecodeOptions, bool | None]  # stage, options, the decoder's redo flag


class Recorder:
    """An engine, each of its calls recorded (from any engine thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _note(self, stage: str, options: DecodeOptions, redo: bool | None = None) -> None:
        with self._lock:
            self.calls.append((stage, options, redo))

    def transcribe_batch(self, windows: Sequence[Window], options: DecodeOptions
                         ) -> list[WindowResult]:
        self._note("run", options)
        return self.engine.transcribe_batch(windows, options)

    def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        self._note("encode", options)
        return self.engine.encode(windows, options)  # type: ignore[attr-defined,no-any-return]

    def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
               options: DecodeOptions, redo: bool = True) -> list[WindowResult]:
        self._note("decode", options, redo)
        return self.engine.decode(windows, encoded, options, redo)  # type: ignore[attr-defined,no-any-return]

    def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
             options: DecodeOptions) -> list[WindowResult]:
        self._note("redo", options)
        return self.engine.redo(windows, encoded, options)  # type: ignore[attr-defined,no-any-return]


def test_the_builder_wires_the_batcher_to_its_pool() -> None:
    """Stages where the engine allows (the decoder's fallbacks apart), none where it does not;
    an engine leaving the rotation retires its slots, and coming back restores them."""
    settings = Settings()
    staged = make_stages(settings, make_pool([FakeStagedEngine()], settings))
    assert staged is not None and staged.redo is not None
    assert make_stages(settings, make_pool([FakeEngine()], settings)) is None
    assert make_stages(Settings(batcher={"split_stages": False}),  # type: ignore[arg-type]
                       make_pool([FakeStagedEngine()], settings)) is None
    pool = make_pool([FakeEngine(workers=2)], settings)
    batcher = make_batcher(settings, pool, Metrics())
    assert pool.on_remove == batcher.retire_slots and pool.on_restore == batcher.restore_slots
    assert make_prep(Settings(prep={"workers": 1}), engines=3).workers == 3  # type: ignore[arg-type]


def picked(clips: list[Clip]) -> list[Clip]:
    """The shortest clip of every corpus set, and the clips whose decode takes the fallback."""
    shortest: dict[str, Clip] = {}
    for c in clips:
        if c.set not in shortest or c.duration_s < shortest[c.set].duration_s:
            shortest[c.set] = c
    return [c for c in clips if shortest.get(c.set) is c or c.id in LOOPING]


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """A transcript without its timings of the run (processing time, speed)."""
    return {"text": result["text"], "language": result["language"],
            "segments": [(s["start"], s["end"], s["text"]) for s in result["segments"]]}


@pytest.mark.model
def test_the_service_and_the_dataset_path_decode_alike(clips: list[Clip], tmp_path: Path) -> None:
    chosen = picked(clips)
    assert len(chosen) >= 12 and all(any(c.id == k for c in chosen) for k in LOOPING)
    settings = Settings(storage={"data_dir": tmp_path}, model={"warmup": False})  # type: ignore[arg-type]
    made: list[Recorder] = []

    def factory(s: Settings) -> Engine:
        made.append(Recorder(load_whisper(s)))
        return made[-1]  # type: ignore[return-value]

    with serve(create_app(settings, engine_factory=factory)) as url, \
            httpx.Client(base_url=url, timeout=600) as client:
        def post(clip: Clip) -> dict[str, Any]:
            with clip.path.open("rb") as f:
                r = client.post("/transcribe", files={"file": (clip.path.name, f)},
                                data={"language": "en"}, params={"wait": "true"})
            assert r.status_code == 200 and r.json()["status"] == "done", r.text
            return r.json()["result"]  # type: ignore[no-any-return]

        with ThreadPoolExecutor(4) as threads:
            served = dict(zip((c.id for c in chosen), threads.map(post, chosen), strict=True))
    local = LocalPipeline(settings, factory)
    try:
        rows = local.transcribe([Job(c.id, c.path, JobOptions(language="en")) for c in chosen])
    finally:
        local.close()
    service, dataset = made
    for c, row in zip(chosen, rows, strict=True):
        assert row.error is None and row.result is not None, (c.id, row.error)
        assert comparable(row.result) == comparable(served[c.id]), c.id
    assert set(service.calls) == set(dataset.calls)  # stages and decode options
    assert any(stage == "redo" for stage, _, _ in dataset.calls)  # the looping clips' fallbacks
    assert {redo for stage, _, redo in dataset.calls if stage == "decode"} == {False}
