"""Crash safety on real ``python -m app`` processes.

* kill -9 under load, restart on the same data dir: every job that got a 202 finishes exactly
  once (none lost, none finished twice, each with its own upload's text); the restart shows
  the kill left no stale lock on the SQLite store.
* SIGTERM: new work is refused, the batch in flight finishes, the rest stays queued (none left
  "running", none failed), an open ``?wait=true`` request still gets an answer, the process exits
  within the grace period, and the queued jobs complete after the restart.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jiwer
import pytest

from loadtest.lib.corpus import Clip
from loadtest.lib.split import MISLABELLED
from tests.conftest import Server
from tests.helpers import wait_until

pytestmark = pytest.mark.model

GRACE_S = 20
# No warm-up (~1 CPU-s of each of this file's real-model starts): no claim here is about it.
COLD = {"BATCHSCRIBE_MODEL__WARMUP": "false"}
ENV = {"BATCHSCRIBE_SHUTDOWN_GRACE_S": str(GRACE_S), "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": "8",
       **COLD}




def speech_clips(clips: list[Clip], n: int) -> list[Clip]:
    """Read speech of 3-30 s, cycled to ``n`` uploads (the same clip may be sent twice)."""
    pool = [c for c in clips if c.set in ("librispeech", "ljspeech", "librivox") and
            3 <= c.duration_s <= 30 and c.id not in MISLABELLED]
    return [pool[i % len(pool)] for i in range(n)]


def submit(c: httpx.Client, clip: Clip, wait: bool = False) -> httpx.Response:
    with clip.path.open("rb") as f:
        return c.post("/transcribe", params={"wait": str(wait).lower()}, data={"language": "en"},
                      files={"file": (clip.path.name, f)})


def db_jobs(data_dir: Path) -> dict[str, dict]:
    """The job rows as a stopped (or killed) server left them on disk."""
    with sqlite3.connect(data_dir / "jobs.db") as db:
        db.row_factory = sqlite3.Row
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM jobs")}


def finished_done(srv: Server) -> float:
    with srv.client() as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith('batchscribe_jobs_finished_total{status="done"}'):
                return float(line.split()[-1])
    return 0.0


def check_all_done(srv: Server, expected: dict[str, Clip], timeout: float = 600) -> list[dict]:
    """Every expected job ends done with its own clip's text; listed exactly once."""
    with srv.client() as c:
        def all_terminal() -> bool:
            jobs = c.get("/jobs", params={"limit": 1000}).json()["jobs"]
            return all(j["status"] in ("done", "failed", "cancelled") for j in jobs)

        assert wait_until(all_terminal, timeout), srv.log()
        jobs = c.get("/jobs", params={"limit": 1000}).json()["jobs"]
    ids = [j["id"] for j in jobs]
    assert len(ids) == len(set(ids))
    by_id = {j["id"]: j for j in jobs}
    missing = set(expected) - set(by_id)
    assert not missing, f"accepted jobs lost: {missing}"
    for job_id, clip in expected.items():
        j = by_id[job_id]
        assert j["status"] == "done", j
        text = j["result"]["text"].lower().replace(",", "").replace(".", "")
        assert jiwer.wer(clip.reference.lower(), text) < 0.5, (clip.id, j["result"]["text"])
    return jobs


def test_kill_9_under_load_loses_nothing(make_server: type[Server], tmp_path: Path,
                                         clips: list[Clip]) -> None:
    data = tmp_path / "svc"
    srv = make_server(data, env=ENV).start()
    # Enough that jobs are queued and running when the kill lands (it lands once 3 are done;
    # 32 uploads were all accepted by then too, and transcribing the other 16 after the
    # restart showed nothing these do not).
    work = speech_clips(clips, 16)
    accepted: dict[str, Clip] = {}
    lock = threading.Lock()
    killed = threading.Event()

    def client_loop(mine: list[Clip]) -> None:
        with srv.client(timeout=60) as c:
            for clip in mine:
                if killed.is_set():
                    return
                try:
                    r = submit(c, clip)
                except httpx.HTTPError:
                    return  # the server died under us: this upload never got its 202
                if r.status_code == 202:
                    with lock:
                        accepted[r.json()["id"]] = clip

    # Four clients keep uploading while jobs run; kill once some are done and more arrive.
    threads = [threading.Thread(target=client_loop, args=(work[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    with srv.client() as c:
        assert wait_until(lambda: sum(j["status"] == "done" for j in c.get(
            "/jobs", params={"limit": 1000}).json()["jobs"]) >= 3, 300), srv.log()
    srv.kill()
    killed.set()
    for t in threads:
        t.join(60)

    before = db_jobs(data)
    done_before = {k for k, j in before.items() if j["status"] == "done"}
    assert set(accepted) <= set(before), "a 202 was sent for a job that is not on disk"
    unfinished = [k for k, j in before.items() if j["status"] != "done"]
    assert unfinished, "the kill came too late to interrupt anything"

    srv2 = make_server(data, env=ENV).start()  # the killed one left no stale lock on jobs.db
    jobs = check_all_done(srv2, accepted)
    # Exactly once: after the restart, only jobs that were not yet done were finished again.
    assert finished_done(srv2) == len([j for j in jobs if j["id"] not in done_before])
    for k in done_before:
        assert next(j for j in jobs if j["id"] == k)["finished_at"] == before[k]["finished_at"]
    # Spool: nothing left for an ended job (a crash-orphaned upload without a row may remain
    # until the periodic sweep; it never belongs to a job).
    spool = data / "uploads"
    assert not {f.name for f in spool.iterdir()} & {j["id"] for j in jobs}


def test_sigterm_drains_gracefully(make_server: type[Server], tmp_path: Path,
                                   clips: list[Clip]) -> None:
    data = tmp_path / "svc"
    # Small batches of short clips: the batch in flight at SIGTERM ends well within the grace
    # even on a loaded 2-core host, so "it finished" is a property of the drain, not of luck.
    # Few jobs active at once (8) and three times as many posted: whatever the engine had in
    # hand is drained (two stages decode what was encoded), and the store still holds jobs
    # nobody claimed, which must stay queued. (It posted 80: the 56 more were transcribed after
    # the restart, ~40 CPU-s of a CPU-bound suite, and showed nothing the 16 queued do not.)
    env = {**ENV, "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": "4",
           "BATCHSCRIBE_STORAGE__MAX_ACTIVE_JOBS": "8"}
    srv = make_server(data, env=env).start()
    work = [c for c in speech_clips(clips, 80) if c.duration_s <= 16][:24]
    with srv.client() as c, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda clip: submit(c, clip), work))
    assert all(r.status_code == 202 for r in responses), [r.text for r in responses]
    accepted = {r.json()["id"]: clip for r, clip in zip(responses, work, strict=True)}

    with srv.client() as c:
        assert wait_until(lambda: any(j["status"] == "done" for j in c.get(
            "/jobs", params={"limit": 1000}).json()["jobs"]), 300), srv.log()

    # A client waiting synchronously when the signal comes must still get an answer.
    sync: dict[str, object] = {}

    def sync_client() -> None:
        try:
            with srv.client(timeout=120) as c:
                sync["response"] = submit(c, work[0], wait=True)
        except httpx.HTTPError as exc:
            sync["error"] = exc

    t = threading.Thread(target=sync_client)
    t.start()
    time.sleep(1.0)  # let the upload land (not a timing claim: either outcome is checked)
    t_term = time.time()
    assert srv.proc is not None
    srv.proc.send_signal(15)
    # Refused while draining: a closed socket or 503. The signal is handled asynchronously, so
    # a probe sent before the process acted on it may still read 200 (seen once in a full run
    # on the loaded 2-core host); poll until the drain shows, bounded.
    refused = False
    deadline = time.monotonic() + 10
    while not refused and time.monotonic() < deadline:
        try:
            refused = httpx.get(srv.url + "/readyz", timeout=5).status_code == 503
        except httpx.HTTPError:
            refused = True
        if not refused:
            time.sleep(0.05)
    assert refused, "/readyz still answered 200 10 s after SIGTERM"
    code = srv.proc.wait(GRACE_S + 15)  # bounded: guards the "exits within the grace" promise
    elapsed = time.time() - t_term
    t.join(30)
    log = srv.log()
    # uvicorn re-raises the signal after a clean shutdown, hence -15 rather than 0.
    assert code in (0, -15), log
    assert '"stopped"' in log, log  # the lifespan shutdown ran to its end
    print(f"SIGTERM to exit: {elapsed:.1f} s (grace {GRACE_S} s)")

    rows = db_jobs(data)
    statuses = [j["status"] for j in rows.values()]
    assert "running" not in statuses and "failed" not in statuses, statuses
    finished_after = [j for j in rows.values() if j["status"] == "done" and
                      j["finished_at"] >= t_term]
    assert finished_after, "the batch in flight at SIGTERM did not finish"
    assert "queued" in statuses, "nothing was left queued: the test never interrupted work"

    assert "error" not in sync, sync
    r = sync["response"]
    assert isinstance(r, httpx.Response) and r.status_code in (200, 202, 503), r
    if r.status_code == 202:  # accepted, then the drain answered it: its job waits for restart
        accepted[r.json()["id"]] = work[0]
        assert rows[r.json()["id"]]["status"] == "queued"

    print(f"open ?wait=true request at SIGTERM answered {r.status_code}")

    srv2 = make_server(data, env=env).start()
    check_all_done(srv2, accepted)
    assert not list((data / "uploads").iterdir())


def test_a_second_process_on_the_same_sqlite_store_refuses_to_start(
        make_server: type[Server], tmp_path: Path) -> None:
    """Two processes on one SQLite file would both claim the same jobs: the second one exits
    with the reason (before loading the model). That a kill -9 leaves no stale lock behind is
    shown by the restart on the same data dir in test_kill_9_under_load_loses_nothing (a third
    start here, after a kill, showed it again: ~8 CPU-s)."""
    data = tmp_path / "data"
    first = make_server(data, env=COLD).start()
    second = make_server(data, env=COLD)
    with pytest.raises(RuntimeError, match="another batchscribe process is using"):
        second.start(timeout=120)
    assert second.proc is not None and second.proc.returncode not in (0, None)
    with first.client() as c:
        assert c.get("/healthz").status_code == 200
