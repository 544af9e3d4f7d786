"""``batchscribe dataset`` end to end: the real CLI process, real services on the real model.

* ../shared/corpus as a NeMo manifest (every other one of its 80 clips of at most 30 s, each
  set still in it: what is checked is the client's bookkeeping, not the model's accuracy, and
  the other 40 cost ~20 CPU-s of every suite run; the three recordings of 53-60 s go through
  this same dataset mode over HTTP in tests/test_ray_model.py): a complete output manifest,
  per-utterance WER equal to the project's scorer, the summary's WER equal to the
  corpus-level WER of the output.
* The client killed (SIGKILL) halfway, then ``--resume``: every row once in the output, and the
  service made one job per row (none transcribed twice).
* The service killed (kill -9) halfway and restarted: the client carries on and completes.
* Two replicas on one PostgreSQL store fed by one client: every row done once, by both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import srt

from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import ROOT, Server
from tests.helpers import wait_until
from tests.test_crash import MISLABELLED, db_jobs, finished_done
from tests.test_postgres import PG_BINS, db, pg  # noqa: F401  (fixtures)
from tests.wer import wer

pytestmark = pytest.mark.model
COLD = {"BATCHSCRIBE_MODEL__WARMUP": "false"}  # ~1 CPU-s a start; no claim here is about it


def nemo_manifest(clips: list[Clip], path: Path) -> Path:
    """The corpus in NeMo's manifest format (extra fields are carried to the output)."""
    with path.open("w") as f:
        for c in clips:
            f.write(json.dumps({"audio_filepath": str(c.path), "duration": c.duration_s,
                                "text": c.reference, "lang": "en", "id": c.id, "set": c.set}) + "\n")
    return path


def dataset_cmd(manifest: Path, out: Path, servers: list[Server], *extra: str) -> list[str]:
    urls = [a for s in servers for a in ("--server", s.url)]
    return [sys.executable, "-m", "app.cli", "dataset", str(manifest), "-o", str(out),
            "--language", "en", "--no-progress", *urls, *extra]


def run_client(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def read_out(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def check_once(out: Path, clips: list[Clip]) -> list[dict[str, Any]]:
    rows = read_out(out)
    ids = Counter(r["id"] for r in rows)
    assert ids == Counter(c.id for c in clips), {k: v for k, v in ids.items() if v != 1}
    for r in rows:
        if r["set"] in READ_SPEECH and r["id"] not in MISLABELLED:
            assert r["wer"] < 50, r  # each row holds its own clip's transcript
    return rows


def short_rows(clips: list[Clip], n: int) -> list[Clip]:
    """The first ``n`` clips of at most 12 s, in manifest order: the kill and replica tests need
    rows done, in flight and not sent when the kill lands, not minutes of audio (the first 40
    rows held three clips of 53-60 s)."""
    return [c for c in clips if c.duration_s <= 12][:n]


def submitted_jobs(out: Path) -> list[str]:
    ck = out.with_name(out.name + ".checkpoint")
    return [json.loads(x)["job"] for x in ck.read_text().splitlines() if '"submitted"' in x]


def test_corpus_manifest_through_the_service(clips: list[Clip], server: Server, tmp_path: Path) -> None:
    clips_all = clips
    clips = [c for c in clips if c.duration_s <= 30][1::2]
    assert {c.set for c in clips} == {c.set for c in clips_all if c.duration_s <= 30}
    out = tmp_path / "corpus.pred.jsonl"
    p = run_client(dataset_cmd(nemo_manifest(clips, tmp_path / "corpus.jsonl"), out, [server]))
    assert p.returncode == 0, p.stderr
    rows = check_once(out, clips)
    by_id = {c.id: c for c in clips}
    for r in rows:
        c = by_id[r["id"]]
        assert r["audio_filepath"] == str(c.path) and r["duration"] == c.duration_s  # kept
        assert r["language"] == "en" and r["rtf"] > 0 and isinstance(r["pred_text"], str)
        if "wer" in r:  # every reference that is not empty once normalised
            assert r["normaliser"] == "whisper_normalizer.english"
            assert r["wer"] == round(100 * wer([r["text"]], [r["pred_text"]]), 3), r
    s = json.loads((tmp_path / "corpus.pred.summary.json").read_text())
    scored = [r for r in rows if "wer" in r]
    [total] = s["scores"]
    assert total["metric"] == "wer" and total["utterances"] == len(scored) >= 38
    assert total["percent"] == round(100 * wer([r["text"] for r in scored],
                                               [r["pred_text"] for r in scored]), 3)
    assert s["done"] == len(clips) and s["failed"] == 0 and s["this_run"]["x_realtime"] > 1
    assert abs(s["audio_hours"] * 3600 - sum(c.duration_s for c in clips)) < 5
    read = [r for r in scored if r["set"] in READ_SPEECH and r["id"] not in MISLABELLED]
    assert wer([r["text"] for r in read], [r["pred_text"] for r in read]) < 0.12
    assert "WER" in p.stderr and "rows done" in p.stderr  # the printed summary


def test_subtitles_segments_and_words(clips: list[Clip], server: Server, tmp_path: Path) -> None:
    picked = [c for c in clips if c.set == "librispeech"][:3]
    out = tmp_path / "subs.jsonl"
    p = run_client(dataset_cmd(nemo_manifest(picked, tmp_path / "m.jsonl"), out, [server],
                               "--segments", "--words", "--subtitles", "srt,vtt"))
    assert p.returncode == 0, p.stderr
    for r in read_out(out):
        cues = list(srt.parse(Path(r["srt_filepath"]).read_text()))
        assert cues and wer([r["text"]], [" ".join(q.content for q in cues)]) < 0.3
        assert Path(r["vtt_filepath"]).read_text().startswith("WEBVTT")
        assert r["segments"] and r["words"] and all(w["end"] >= w["start"] for w in r["words"])


def test_client_killed_halfway_resumes_exactly_once(server: Server, clips: list[Clip],
                                                    tmp_path: Path) -> None:
    """On the shared service: what it made and finished is counted from this test's start (the
    store's rows created since, the done counter's growth)."""
    since, done_before = time.time(), finished_done(server)
    subset = short_rows(clips, 24)
    manifest, out = nemo_manifest(subset, tmp_path / "m.jsonl"), tmp_path / "out.jsonl"
    # Few files in flight, so that the kill finds rows done, rows in flight and rows not sent:
    # killed at the write that reaches 8 rows, at least 8 of the 24 are unsent (at 12, one poll
    # could write the last rows and the client exit first).
    cmd = dataset_cmd(manifest, out, [server], "--max-in-flight", "8")
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert wait_until(lambda: lines(out) >= 8 or first.poll() is not None, 600, step=0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    at_kill = lines(out)
    assert first.returncode == -signal.SIGKILL and at_kill < len(subset), at_kill
    p = run_client([*cmd, "--resume"])
    assert p.returncode == 0, p.stderr
    check_once(out, subset)
    jobs = submitted_jobs(out)
    assert len(set(jobs)) == len(subset)  # a re-post of an unrecorded row named the same job
    made = {k for k, j in db_jobs(server.data_dir).items() if j["created_at"] >= since}
    assert made == set(jobs)  # the service made one job per row, and only these
    assert finished_done(server) - done_before == len(subset)  # and transcribed each once
    print(f"killed with {at_kill}/{len(clips)} rows written; "
          f"{len(jobs) - len(set(jobs))} rows re-posted under their first key")


def test_service_killed_and_restarted_the_client_carries_on(
        make_server: type[Server], clips: list[Clip], tmp_path: Path) -> None:
    data = tmp_path / "svc"
    # Warmed up: cold, the first batch took so long that the client's poller backed off (up to
    # 5 s while no job ends) and its next poll found every row done (CI: finished at the kill).
    srv = make_server(data).start()
    subset = short_rows(clips, 16)  # (24 before: 8 more rows after the restart show no more)
    out = tmp_path / "out.jsonl"
    # Four in flight, killed at the first rows written: at least 11 rows are then unsent, three
    # more submit-transcribe-poll rounds. With 12 in flight and a kill at 6 rows, one poll wrote
    # rows 6-16 at once and the client had exited before the kill (CI, stop 57).
    client = subprocess.Popen(dataset_cmd(nemo_manifest(subset, tmp_path / "m.jsonl"), out, [srv],
                                          "--max-in-flight", "4"),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: lines(out) >= 2 or client.poll() is not None, 600, step=0.05)
        srv.kill()  # kill -9: no drain
        assert client.poll() is None and lines(out) < len(subset)
        time.sleep(2)  # the client meets a dead port for a while
        again = make_server(data, port=srv.port, env=COLD).start()
        _, err = client.communicate(timeout=900)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err
    assert "retrying" in err  # it noticed, and carried on
    check_once(out, subset)
    assert len(db_jobs(data)) == len(subset)  # no row made a second job across the crash
    assert all(j["status"] == "done" for j in db_jobs(data).values())
    assert again.proc is not None and again.proc.poll() is None


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    if not PG_BINS and os.environ.get("CI"):
        pytest.fail("PostgreSQL server binaries not found: scripts/test installs them")
    return str(request.getfixturevalue("db"))


def test_two_replicas_on_postgres_fed_by_one_client(make_server: type[Server], clips: list[Clip],
                                                     tmp_path: Path, pg_url: str) -> None:
    shared = tmp_path / "shared"  # the blob folder both replicas read
    env = {"BATCHSCRIBE_STORAGE__DATABASE_URL": pg_url, "BATCHSCRIBE_MODEL__NUM_WORKERS": "1",
           **COLD}
    a = make_server(shared, env={**env, "BATCHSCRIBE_STORAGE__REPLICA_ID": "replica-a"}).start()
    b = make_server(shared, env={**env, "BATCHSCRIBE_STORAGE__REPLICA_ID": "replica-b"}).start()
    subset = short_rows(clips, 16)
    out = tmp_path / "out.jsonl"
    p = run_client(dataset_cmd(nemo_manifest(subset, tmp_path / "m.jsonl"), out, [a, b]))
    assert p.returncode == 0, p.stderr + a.log() + b.log()
    check_once(out, subset)
    eng = sa.create_engine(pg_url)
    try:
        with eng.connect() as c:
            table = [dict(r._mapping) for r in c.execute(sa.text("SELECT * FROM jobs"))]
    finally:
        eng.dispose()
    # Once in a full run the table held 41 jobs for these 16 rows (the output had each row
    # once); what each job was, and what the client said, name the cause if it comes back.
    seen = [(r["idempotency_key"], r["status"], r["attempts"], r["replica"]) for r in table]
    why = f"{sorted(seen)}\n{p.stderr[-4000:]}"
    print(f"jobs in the table: {len(table)} for {len(clips)} rows; attempts "
          f"{sorted(Counter(r['attempts'] for r in table).items())}; keys "
          f"{len({r['idempotency_key'] for r in table})} distinct, "
          f"{sum(1 for r in table if not r['idempotency_key'])} none")
    assert len(table) == len(subset) and all(r["status"] == "done" for r in table), why
    assert all(r["attempts"] == 1 and r["idempotency_key"] for r in table), why
    assert {r["replica"] for r in table} == {"replica-a", "replica-b"}, why  # both took work
    ck = out.with_name(out.name + ".checkpoint")
    servers = Counter(json.loads(x)["server"] for x in ck.read_text().splitlines() if '"submitted"' in x)
    assert set(servers) == {a.url, b.url}, servers  # the client fed both
    assert finished_done(a) + finished_done(b) == len(subset)
