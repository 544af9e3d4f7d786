"""``batchscribe dataset`` without the model: inputs, checkpoint, flow control, and the protocol
against a scripted service (httpx.MockTransport: 429s, outages, failures, remote inputs).

The same command on the real model, killed and resumed, is in tests/test_dataset_model.py.
"""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.client import scoring
from app.client.checkpoint import Checkpoint, CheckpointError
from app.client.cli import main, parse_args, run_dataset
from app.client.flow import Flow
from app.client.manifest import ManifestError, load
from tests.wer import wer


def write_manifest(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- inputs -----------------------------------------------------------------------------------
def test_nemo_manifest_folder_and_glob(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    for name in ("a/x.wav", "a/y.flac", "b.mp3", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    m = load(str(write_manifest(tmp_path / "m.jsonl", [
        {"audio_filepath": "a/x.wav", "duration": 1.5, "text": "hello", "lang": "EN", "spk": 3},
        {"audio_filepath": "https://host/a/x.wav?sig=1"},
        {"audio_filepath": str(tmp_path / "b.mp3"), "text": " "},
    ])))
    r0, r1, r2 = m.rows
    assert r0.audio == str(tmp_path / "a" / "x.wav") and r0.duration == 1.5  # relative to manifest
    assert r0.reference == "hello" and r0.language == "en" and r0.fields["spk"] == 3
    assert r1.remote and r1.audio == "https://host/a/x.wav?sig=1" and r1.duration is None
    assert r2.reference is None and not r2.remote
    assert m.subtitle_stems() == {0: "x-0", 1: "x-1", 2: "b"}  # a stem seen twice gets its row
    folder = load(str(tmp_path))
    assert [Path(r.audio).name for r in folder.rows] == ["x.wav", "y.flac", "b.mp3"]
    assert [Path(r.audio).name for r in load(str(tmp_path / "a" / "*.wav")).rows] == ["x.wav"]
    assert load(str(tmp_path)).digest == folder.digest != m.digest
    (tmp_path / "m2.jsonl").write_text('{"audio_filepath": "a.wav"}\n{oops\n')
    with pytest.raises(ManifestError, match=r"m2.jsonl:2: not JSON"):
        load(str(tmp_path / "m2.jsonl"))
    with pytest.raises(ManifestError, match="audio_filepath"):
        load(str(write_manifest(tmp_path / "m3.jsonl", [{"path": "a.wav"}])))
    with pytest.raises(ManifestError, match="no such"):
        load(str(tmp_path / "missing.jsonl"))


def test_scores_are_the_projects_scorer() -> None:
    ref = "HE BEGAN A CONFUSED COMPLAINT AGAINST THE WIZARD"
    hyp = "He began a confused complaint, against wizard."
    s = scoring.score(ref, hyp, "en")
    assert s is not None and s.metric == "wer" and s.normaliser == "whisper_normalizer.english"
    assert s.percent == round(100 * wer([ref], [hyp]), 3) == 12.5
    zh = scoring.score("今天天气很好。", "今天天气不好", "zh")
    assert zh is not None and zh.metric == "cer" and (zh.errors, zh.units) == (1, 6)
    assert scoring.score("<VOCNOISE> [adif]", "anything", "en") is None  # nothing to score
    [t] = scoring.total([s, s])
    assert t.percent == 12.5 and t.utterances == 2 and t.units == 16


# ---- checkpoint -------------------------------------------------------------------------------
HEADER = {"input_digest": "d", "language": "en", "task": "transcribe", "word_timestamps": False}


def test_checkpoint_exactly_once_across_a_crash(tmp_path: Path) -> None:
    out, ck = tmp_path / "out.jsonl", tmp_path / "out.jsonl.checkpoint"
    c = Checkpoint.open(ck, out, HEADER, resume=False, overwrite=False)
    for row in range(3):
        c.submitted(row, 0, "http://s", f"job{row}")
    c.finish([(0, {"r": 0}, {"audio_s": 1.0})])
    c.fail(2, 0, "415 not audio")
    c.close()
    # Killed after writing row 1's line but before recording it, and mid-way through the next
    # checkpoint record: neither survives a resume.
    with out.open("a") as f:
        f.write(json.dumps({"r": 1}) + "\n" + '{"r": 9')
    with ck.open("a") as f:
        f.write('{"type": "done", "row": 1, "out_by')
    c = Checkpoint.open(ck, out, HEADER, resume=True, overwrite=False)
    st = c.state
    assert read_jsonl(out) == [{"r": 0}] and set(st.done) == {0}
    assert st.submitted[1].job == "job1" and st.failed == {2: (0, "415 not audio")}
    assert st.attempt(1) == 0 and st.attempt(2) == 1  # a failed row is retried as a new attempt
    assert c.idempotency_key(1, 0) == f"{c.run_id}-1-0"
    c.finish([(1, {"r": 1}, {"audio_s": 2.0})])
    c.close()
    assert read_jsonl(out) == [{"r": 0}, {"r": 1}]
    assert ck.read_text().endswith("\n")  # the torn record was cut before appending


def test_checkpoint_refuses_a_changed_input_or_an_unasked_overwrite(tmp_path: Path) -> None:
    out, ck = tmp_path / "out.jsonl", tmp_path / "out.jsonl.checkpoint"
    Checkpoint.open(ck, out, HEADER, resume=False, overwrite=False).close()
    with pytest.raises(CheckpointError, match="--resume"):
        Checkpoint.open(ck, out, HEADER, resume=False, overwrite=False)
    with pytest.raises(CheckpointError, match="input_digest"):
        Checkpoint.open(ck, out, {**HEADER, "input_digest": "other"}, resume=True, overwrite=False)
    fresh = Checkpoint.open(ck, out, HEADER, resume=False, overwrite=True)
    fresh.close()


# ---- flow control -----------------------------------------------------------------------------
def test_flow_fills_to_the_target_and_backs_off() -> None:
    f = Flow(initial=4, max_in_flight=64, queue_s=20, min_backlog_s=100)
    assert f.room(0.0) == 4
    f.in_flight = 4
    f.observe(0.0, 3600.0, now=0.0)  # empty backlog: slow start doubles
    assert f.cap == 8
    for _ in range(10):
        f.in_flight = int(f.cap)
        f.observe(10.0, 3600.0, now=0.0)
    assert f.cap == 64  # never above max_in_flight
    for t in range(8):  # 8 files of 60 s in 8 s: 60x
        f.finished(60.0, now=float(t))
    assert f.target(now=8.0) == pytest.approx(60 * 20, rel=0.2)
    assert f.poll_interval(now=8.0) == pytest.approx(10.0 / 60 / 10, rel=0.2)  # backlog 10 s
    f.observe(5000.0, 2000.0, now=8.0)
    assert f.limit_s == 2000 and f.target(now=8.0) == 1000  # at most half the limit
    assert f.cap == 63  # well over the target: shrinks
    f.overloaded(7.0, now=10.0)
    f.in_flight = 10
    assert f.cap == 31.5 and f.room(now=16.9) == 0 and f.room(now=17.1) > 0
    assert [f.unreachable(now=20.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    f.observe(0.0, None, now=21.0)
    assert f.failures == 0


# ---- the protocol, against a scripted service -------------------------------------------------
class FakeService:
    """POST /transcribe and GET /jobs?ids= as the service answers them, plus scripted trouble."""

    def __init__(self, script: dict[int, list[int]] | None = None, fail_rows: Collection[int] = ()):
        self.jobs: dict[str, dict[str, Any]] = {}
        self.keys: dict[str, str] = {}
        self.posts: list[dict[str, Any]] = []
        self.script = script or {}  # row -> statuses to answer its next POSTs with (429, 503, 415)
        self.fail_rows = fail_rows
        self.down = 0  # requests to refuse with a connection error

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.down > 0:
            self.down -= 1
            raise httpx.ConnectError("connection refused", request=request)
        if request.method == "GET":
            ids = request.url.params["ids"].split(",")
            return httpx.Response(200, json={"jobs": [self.jobs[i] for i in ids if i in self.jobs]},
                                  headers={"X-Backlog-Seconds": "0", "X-Backlog-Limit-Seconds": "600"})
        key = request.headers["Idempotency-Key"]
        body = request.content
        multipart = b"filename=" in body
        form = {} if multipart else dict(urllib.parse.parse_qsl(body.decode()))
        row = int(key.rsplit("-", 2)[1])
        self.posts.append({"row": row, "key": key, "form": form, "file": multipart})
        todo = self.script.get(row)
        if todo:
            code = todo.pop(0)
            headers = {"Retry-After": "0"} if code == 429 else {}
            return httpx.Response(code, headers=headers, json={"error": {
                "type": "scripted", "message": f"scripted {code}", "limit_s": 600}})
        if key not in self.keys:
            job_id = f"job{len(self.jobs)}"
            self.keys[key] = job_id
            failed = row in self.fail_rows and key.endswith("-0")
            self.jobs[job_id] = {
                "id": job_id, "status": "failed" if failed else "done", "rtf": 50.0,
                "audio_seconds": 2.0, "error": {"type": "transcription_failed",
                                                "message": "boom"} if failed else None,
                "result": None if failed else {"text": f" text of row {row} ", "language": "en",
                                               "duration": 2.0, "segments": [
                                                   {"start": 0.0, "end": 2.0, "text": "x"}]}}
        return httpx.Response(202, json=self.jobs[self.keys[key]])


def run(argv: list[str], svc: FakeService) -> int:
    args = parse_args(["dataset", *argv, "--server", "http://svc", "--no-progress"])
    return run_dataset(args, httpx.MockTransport(svc.handler))


def test_protocol_retries_what_a_retry_can_fix_and_reports_the_rest(tmp_path: Path) -> None:
    audio = tmp_path / "a.wav"
    audio.write_bytes(b"RIFF")
    rows = [{"audio_filepath": str(audio), "text": f"text of row {i}"} for i in range(6)]
    rows[4] = {"audio_filepath": "s3://bucket/key.flac", "text": "text of row 4"}
    rows[5] = {"audio_filepath": str(tmp_path / "missing.wav")}
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out.jsonl"
    svc = FakeService(script={0: [429, 503], 1: [415]}, fail_rows={2})
    svc.down = 2  # the first two requests meet a service that is not there
    assert run([str(manifest), "-o", str(out), "--segments"], svc) == 1
    got = {r["text"]: r for r in read_jsonl(out)}
    assert sorted(got) == ["text of row 0", "text of row 3", "text of row 4"]
    assert all(r["wer"] == 0.0 and r["pred_text"] == r["text"] and r["rtf"] == 50.0 and
               r["duration"] == 2.0 and r["segments"] == [{"start": 0.0, "end": 2.0, "text": "x"}]
               for r in got.values())
    remote = [p for p in svc.posts if p["row"] == 4]
    assert remote and all(p["form"].get("audio_url") == "s3://bucket/key.flac" and not p["file"]
                          for p in remote)
    assert [p["row"] for p in svc.posts].count(0) == 3  # 429, 503, then accepted
    s = json.loads((tmp_path / "out.summary.json").read_text())
    assert (s["done"], s["failed"], s["pending"]) == (3, 3, 0)
    errors = {f["row"]: f["error"] for f in s["failures"]}
    assert "415" in errors[1] and "boom" in errors[2] and "missing.wav" in errors[5]
    assert s["scores"][0]["percent"] == 0.0 and s["scores"][0]["utterances"] == 3
    # --resume skips finished and failed rows; --retry-failed tries the failed ones again as a
    # new attempt (a new key: the failed job is not named again).
    posted = len(svc.posts)
    assert run([str(manifest), "-o", str(out), "--segments", "--resume"], svc) == 1
    assert len(svc.posts) == posted
    assert run([str(manifest), "-o", str(out), "--segments", "--resume", "--retry-failed"], svc) == 1
    retried = svc.posts[posted:]
    assert sorted(p["row"] for p in retried) == [1, 2]  # row 5's file is still missing
    assert all(p["key"].endswith("-1") for p in retried)
    assert sorted(r["text"] for r in read_jsonl(out)) == [f"text of row {i}" for i in range(5)]


def test_resume_follows_submitted_jobs_and_reposts_unrecorded_ones(tmp_path: Path) -> None:
    audio = tmp_path / "a.wav"
    audio.write_bytes(b"RIFF")
    manifest = write_manifest(tmp_path / "m.jsonl", [{"audio_filepath": str(audio)}] * 4)
    out, ck = tmp_path / "out.jsonl", tmp_path / "out.jsonl.checkpoint"
    svc = FakeService()
    header = {"input": str(manifest), "input_digest": load(str(manifest)).digest, "rows": 4,
              "language": None, "task": "transcribe", "word_timestamps": False}
    c = Checkpoint.open(ck, out, header, resume=False, overwrite=False)
    # Row 0 was submitted and recorded; row 1 was posted but the client died before recording
    # the job (the service has it under its key); rows 2 and 3 were never sent.
    for row in (0, 1):
        svc.handler(httpx.Request("POST", "http://svc/transcribe", headers={
            "Idempotency-Key": c.idempotency_key(row, 0)}, content=b"filename=x"))
    c.submitted(0, 0, "http://svc", "job0")
    c.close()
    assert run([str(manifest), "-o", str(out), "--resume"], svc) == 0
    assert len(read_jsonl(out)) == 4 and len(svc.jobs) == 4  # no row transcribed twice
    assert Counter(p["row"] for p in svc.posts) == {0: 1, 1: 2, 2: 1, 3: 1}
    assert main(["dataset", str(manifest), "-o", str(out), "--server", "http://127.0.0.1:9"]) == 2
