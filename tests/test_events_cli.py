"""Progress over Server-Sent Events, and the ``batchscribe`` CLI, end to end on the real model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import srt

from app.audio import decode
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import ROOT, Server
from tests.wer import wer

pytestmark = pytest.mark.model


def read_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """A minimal, independent SSE reader: (event, data, id) per blank-line-terminated block."""
    block: dict[str, list[str]] = {}
    for line in lines:
        if line == "":
            if "data" in block:
                yield (block.get("event", ["message"])[0], json.loads("\n".join(block["data"])),
                       block.get("id", [None])[0])
            block = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            block.setdefault(key, []).append(value)


def events(client: httpx.Client, job_id: str) -> list[tuple[str, dict[str, Any], str | None]]:
    with client.stream("GET", f"/jobs/{job_id}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return list(read_events(r.iter_lines()))  # returns only when the server closes it


@pytest.fixture(scope="module")
def long_file(clips: list[Clip], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """~3 minutes of read speech in one wav (several windows), and its reference."""
    picked = sorted((c for c in clips if c.set in READ_SPEECH), key=lambda c: -c.duration_s)[:14]
    gap = np.zeros(16000, dtype=np.float32)
    samples = np.concatenate([x for c in picked for x in (decode(c.path, 600), gap)])
    path = tmp_path_factory.mktemp("long") / "long.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path, " ".join(c.reference for c in picked)


def submit(client: httpx.Client, path: Path, **data: str) -> str:
    with path.open("rb") as f:
        r = client.post("/transcribe", files={"file": (path.name, f)}, data=data)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_events_stream_progress_until_done(server: Server, long_file: tuple[Path, str]) -> None:
    with server.client() as client:
        job_id = submit(client, long_file[0])  # no language: window 1 is detected alone first
        got = events(client, job_id)
        names = [e for e, _, _ in got]
        assert names[-1] == "done" and set(names[:-1]) == {"progress"}
        progress = [d for e, d, _ in got if e == "progress"]
        done = [d["windows_done"] for d in progress]
        total = progress[-1]["windows_total"]
        assert total and total >= 5 and done == sorted(done) and done[-1] == total
        assert any(0 < n < total for n in done), "no intermediate progress"
        assert progress[-1]["status"] == "done"
        ids = [int(i) for _, _, i in got if i is not None]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        final = got[-1][1]
        assert final["id"] == job_id and "result" not in final
        # A finished job's stream: its state at once, then the end.
        again = events(client, job_id)
        assert [e for e, _, _ in again] == ["progress", "done"]
        assert client.get("/jobs/nope/events").status_code == 404


def test_events_end_with_cancellation(server: Server, long_file: tuple[Path, str]) -> None:
    with server.client() as client:
        job_id = submit(client, long_file[0], language="en")
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.extend(events(client, job_id)))
        reader.start()
        assert client.delete(f"/jobs/{job_id}").status_code == 200
        reader.join(120)
        assert not reader.is_alive() and got[-1][0] == "cancelled"


def run_cli(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``batchscribe`` console script (pyproject), else ``python -m app.cli``."""
    script = Path(sys.executable).with_name("batchscribe")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "app.cli"]
    env_key = ["--api-key", key] if key else []
    return subprocess.run([*cmd, "transcribe", *args, *env_key],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_cli_writes_subtitles_with_progress(server: Server, long_file: tuple[Path, str],
                                            clips: list[Clip], tmp_path: Path) -> None:
    short = next(c for c in clips if c.set == "librispeech")
    out = tmp_path / "subs"
    p = run_cli(str(long_file[0]), str(short.path), "--server", server.url, "--format", "srt",
                "-o", str(out), "--progress")
    assert p.returncode == 0, p.stderr
    assert "100%" in p.stderr and "long.wav" in p.stderr  # the progress bar was drawn
    for path, reference, duration in ((long_file[0], long_file[1], None),
                                      (short.path, short.reference, short.duration_s)):
        subs = list(srt.parse((out / f"{path.stem}.srt").read_text()))
        starts = [s.start for s in subs]
        assert subs and starts == sorted(starts)
        if duration is not None:
            assert subs[-1].end.total_seconds() <= duration
        assert wer([reference], [" ".join(s.content for s in subs)]) <= 0.2


def test_cli_text_to_stdout_and_failure_status(server: Server, clips: list[Clip],
                                               tmp_path: Path) -> None:
    clip = next(c for c in clips if c.set == "ljspeech")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not audio at all" * 64)
    p = run_cli(str(clip.path), str(junk), "--server", server.url, "--no-progress")
    assert p.returncode == 1
    assert "junk.wav" in p.stderr and "415" in p.stderr
    assert wer([clip.reference], [p.stdout]) <= 0.3  # the good file still came out


def test_events_and_cli_respect_api_keys(make_server: type[Server], tmp_path: Path,
                                         clips: list[Clip]) -> None:
    keys = ("key-alice", "key-bob")
    digests = ",".join(hashlib.sha256(k.encode()).hexdigest() for k in keys)
    srv = make_server(tmp_path / "keys",
                      env={"BATCHSCRIBE_SECURITY__API_KEY_SHA256": digests,
                           "BATCHSCRIBE_MODEL__WARMUP": "false"}).start()
    clip = next(c for c in clips if c.set == "librispeech")
    alice = srv.client(headers={"Authorization": f"Bearer {keys[0]}"})
    bob = srv.client(headers={"Authorization": f"Bearer {keys[1]}"})
    with alice, bob:
        job_id = submit(alice, clip.path)
        assert bob.get(f"/jobs/{job_id}/events").status_code == 404  # not bob's: not found
        assert srv.client().get(f"/jobs/{job_id}/events").status_code == 401
        assert [e for e, _, _ in events(alice, job_id)][-1] == "done"
    p = run_cli(str(clip.path), "--server", srv.url, key=keys[1])
    assert p.returncode == 0 and wer([clip.reference], [p.stdout]) <= 0.3, p.stderr
    p = run_cli(str(clip.path), "--server", srv.url)
    assert p.returncode == 1 and "401" in p.stderr
