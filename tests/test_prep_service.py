"""Prep processes behind the real service (HTTP, store, batcher; an engine stand-in that
records every window it is given): issue 50 item 5, "nothing lost on the way".

Long uploads split into parts, short clips beside them, and one prep process SIGKILLed while
they run: every job ends done, the engine saw every window once (none twice, none missing:
its windows are exactly the jobs' ``windows_total``), each transcript's segments are in upload
order whatever order the parts came in, and every shared-memory slot is back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.audio import decode
from app.engine import EngineInfo
from app.main import create_app
from app.windows import DecodeOptions, Window, WindowResult, as_float
from tests.conftest import Clip
from tests.fakes import BOUND
from tests.test_crash import wait_until
from tests.test_metrics import fake_settings, serve
from tests.test_prep import write_wav


class Recorder:
    """Answers at once; records (start, end, checksum) of every window; calls ``hook`` with
    the number seen so far after each batch."""

    def __init__(self) -> None:
        self.info = EngineInfo("recorder", "cpu", "int8", 1)
        self.seen: list[tuple[float, float, float]] = []
        self.hook = lambda n: None
        self._lock = threading.Lock()

    def transcribe_batch(self, windows: Sequence[Window],
                         options: DecodeOptions) -> list[WindowResult]:
        with self._lock:
            self.seen += [(round(w.start, 3), round(w.end, 3), float(np.abs(as_float(w.audio)).sum()))
                          for w in windows]
            n = len(self.seen)
        self.hook(n)
        return [WindowResult(text=f"at {w.start:.1f}", language="en", language_probability=None,
                             avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=1.0)
                for w in windows]

    def close(self) -> None:
        pass


def long_uploads(clips: list[Clip], tmp: Path, n: int, minutes: float) -> list[Path]:
    decoded = [decode(c.path, 3600.0) for c in clips]
    gap = np.zeros(int(0.8 * 16000), np.float32)
    out = []
    for k in range(n):
        parts: list[np.ndarray] = []
        i = 11 * k
        while sum(p.size for p in parts) < minutes * 60 * 16000:
            parts += [decoded[i % len(decoded)], gap]
            i += 1
        out.append(write_wav(tmp / f"long{k}.wav", np.concatenate(parts)))
    return out


def post(c: httpx.Client, path: Path) -> str:
    with path.open("rb") as f:
        r = c.post("/transcribe", data={"language": "en"}, files={"file": (path.name, f)})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_a_killed_prep_process_costs_no_job_and_no_window(
        tmp_path: Path, clips: list[Clip], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="app.audio.procs.feed")
    uploads = long_uploads(clips, tmp_path, 3, 5.0)
    shorts = [c.path for c in clips if 3 < c.duration_s < 10][:6]
    engine = Recorder()
    settings = fake_settings(tmp_path / "svc", prep={"workers": 2, "part_s": 60})
    app = create_app(settings, engine_factory=lambda s: engine)
    with serve(app) as url:
        prep = app.state.door._runner.prep
        pool = prep.procs
        assert pool is not None  # the default: processes
        killed: list[int] = []

        def kill(n: int) -> None:
            if n >= 8 and not killed:
                killed.append(pool.procs[0].process.pid)
                os.kill(killed[0], signal.SIGKILL)

        engine.hook = kill
        with httpx.Client(base_url=url, timeout=60) as c:
            ids = [post(c, p) for p in uploads] + [post(c, p) for p in shorts]
            jobs: dict[str, dict[str, Any]] = {}

            def ended() -> bool:
                for i in ids:
                    jobs[i] = c.get(f"/jobs/{i}").json()
                return all(j["status"] in ("done", "failed", "cancelled") for j in jobs.values())

            assert wait_until(ended, 10 * BOUND, 0.2)
        assert killed and pool.deaths == 1
        assert [j["status"] for j in jobs.values()] == ["done"] * len(ids), jobs
        assert len(set(engine.seen)) == len(engine.seen)  # no window twice
        assert sum(j["progress"]["windows_total"] for j in jobs.values()) == len(engine.seen)
        for i in ids[:3]:
            starts = [s["start"] for s in jobs[i]["result"]["segments"]]
            assert starts == sorted(starts) and len(starts) > 8
        assert any(r.getMessage() == "upload split" for r in caplog.records)  # in parts
        assert wait_until(lambda: pool.arena.free == pool.arena.count, BOUND, 0.05)
