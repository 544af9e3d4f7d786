"""The shared job store on a REAL PostgreSQL server (Debian's ``postgresql``, started here).

* Store level: versioned migrations (two replicas migrating at once), ``FOR UPDATE SKIP LOCKED``
  claims from concurrent stores never overlap, lease expiry requeues a dead replica's job.
* Two ``python -m app`` processes on one database and one blob folder: jobs submitted to either
  are all done exactly once (and a NUL in a file name is dropped, not a 500); kill -9 one
  mid-job and the other finishes its jobs once their lease has expired (not before).
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import tempfile
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa

from loadtest.lib.corpus import Clip
from tests.conftest import Server, free_port, need
from tests.helpers import wait_until
from tests.test_crash import finished_done, speech_clips, submit
from tests.wer import wer

PG_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
LEASE_S = 4.0


@dataclass
class PgCluster:
    """A throwaway cluster: its own data directory, port and socket folder; trust auth."""

    root: Path
    port: int
    bindir: Path

    def url(self, db: str, driver: str = "postgresql+psycopg") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root: run them as the Debian package's user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    need(PG_BINS, "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin): "
         "apt-get install postgresql (scripts/test does)")
    bindir = Path(PG_BINS[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="batchscribe-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, sock, port = root / "data", root / "sock", free_port()
    run = lambda *a: subprocess.run(_as_postgres([str(x) for x in a]), check=True,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    run("mkdir", "-p", sock)
    run(bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
    # fsync off: a test cluster that dies with the test needs no durability, only speed.
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    run(bindir / "pg_ctl", "-D", data, "-l", root / "server.log", "-o", opts, "-w", "-t", "60",
        "start")
    try:
        yield PgCluster(root, port, bindir)
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                                     "stop"]), capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def db(pg: PgCluster, request: pytest.FixtureRequest) -> str:
    return pg.create_db(f"t_{request.node.name[:40].lower()}_{time.monotonic_ns() % 10**6}")


def rows(url: str) -> dict[str, dict[str, Any]]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            return {r.id: dict(r._mapping) for r in c.execute(sa.text("SELECT * FROM jobs"))}
    finally:
        eng.dispose()


# ---- store level ------------------------------------------------------------------------------
async def test_concurrent_migrations_and_skip_locked_claims(db: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from app.jobs.migrations import head
    from app.jobs.store import JobStore, metadata

    a, b = JobStore(db), JobStore(db)
    try:
        await asyncio.gather(a.init(), b.init())  # two replicas starting together
        assert a.engine is not None
        async with a.engine.connect() as conn:
            version = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar()
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c),
                                                                  metadata))
        assert version == head() and diff == []

        for k in range(60):
            await a.insert(id=f"j{k:02d}", owner=None, status="queued", created_at=1000.0 + k,
                           upload_path=f"j{k:02d}", options={}, audio_seconds=1.0,
                           windows_done=0, attempts=0)

        async def drain(store: JobStore, name: str) -> list[str]:
            got: list[str] = []
            while batch := await store.claim(name, 3, 30.0):
                got += [j.id for j in batch]
            return got

        # Four claimers on two stores (connection pools) race for the same rows.
        claims = await asyncio.gather(drain(a, "r1"), drain(b, "r2"), drain(a, "r3"), drain(b, "r4"))
        every = [j for c in claims for j in c]
        assert sorted(every) == [f"j{k:02d}" for k in range(60)]  # each row claimed exactly once
        assert sum(1 for c in claims if c) >= 2, [len(c) for c in claims]

        # A dead replica's lease: nobody requeues it before it expires, anybody after.
        names = ["r1", "r2", "r3", "r4"]
        owner, victim = next((n, c[0]) for n, c in zip(names, claims, strict=True) if c and n != "r2")
        await a.update(victim, lease_expires_at=time.time() + 60)
        assert await b.requeue_stale("r2") == len(claims[1])  # only r2's own (a restart)
        assert (await a.get(victim)).status == "running"  # type: ignore[union-attr]
        await a.update(victim, lease_expires_at=time.time() - 1)
        assert await b.requeue_stale(None) == 1
        j = await a.get(victim)
        assert j is not None and j.status == "queued" and j.lease_owner is None
        # The owner's next heartbeat learns that it lost that job, and keeps the others.
        held = await a.heartbeat(owner, {}, 30.0)
        assert held == set(claims[names.index(owner)]) - {victim}
    finally:
        await a.close()
        await b.close()


async def test_round_robin_claims_on_postgres(db: str) -> None:
    from app.jobs.store import JobStore
    from tests.test_claims import round_robin_order

    store = JobStore(db)
    try:
        await store.init()
        await round_robin_order(store)
    finally:
        await store.close()


async def test_leases_use_the_database_clock(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose clock runs an hour ahead still writes leases that expire on the
    database's clock: the other replicas do not take its jobs early, nor it theirs late."""
    import app.jobs.store as store_module
    from app.jobs.store import JobStore

    store = JobStore(db)
    try:
        await store.init()
        await store.insert(id="j", owner=None, status="queued", created_at=time.time(),
                           upload_path="j", options={}, audio_seconds=1.0, windows_done=0,
                           attempts=0)

        class Skewed:
            @staticmethod
            def time() -> float:
                return time.time() + 3600

        monkeypatch.setattr(store_module, "time", Skewed)
        [job] = await store.claim("fast-clock", 1, 30.0)
        now = time.time()
        assert job.lease_expires_at is not None and abs(job.lease_expires_at - (now + 30)) < 5
        assert job.started_at is not None and abs(job.started_at - now) < 5
        await store.heartbeat("fast-clock", {}, 1.0)
        assert await store.requeue_stale(None) == 0  # 1 s left on the database's clock
        await asyncio.sleep(1.5)
        assert await store.requeue_stale(None) == 1
    finally:
        await store.close()


# ---- two service processes --------------------------------------------------------------------
def server_env(url: str, replica: str) -> dict[str, str]:
    return {"BATCHSCRIBE_STORAGE__DATABASE_URL": url,
            "BATCHSCRIBE_STORAGE__REPLICA_ID": replica,
            "BATCHSCRIBE_STORAGE__LEASE_S": str(LEASE_S),
            "BATCHSCRIBE_MODEL__NUM_WORKERS": "1",  # two processes share 2 cores
            "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": "2",  # long jobs progress batch by batch
            "BATCHSCRIBE_SHUTDOWN_GRACE_S": "5",
            "BATCHSCRIBE_MODEL__WARMUP": "false"}  # ~1 CPU-s a start; no claim here is about it


def jobs_done(srv: Server, ids: set[str], timeout: float) -> bool:
    def check() -> bool:
        with srv.client(timeout=30) as c:
            listed = {j["id"]: j for j in c.get("/jobs", params={"limit": 1000}).json()["jobs"]}
        return all(listed.get(i, {}).get("status") in ("done", "failed", "cancelled") for i in ids)
    return wait_until(check, timeout, step=1.0)


@pytest.mark.model
def test_two_replicas_share_one_queue(make_server: type[Server], tmp_path: Path, db: str,
                                      clips: list[Clip]) -> None:
    shared = tmp_path / "shared"  # the blob folder (a shared volume in production)
    a = make_server(shared, env=server_env(db, "replica-a")).start()
    b = make_server(shared, env=server_env(db, "replica-b")).start()
    work = speech_clips(clips, 16)
    accepted: dict[str, Clip] = {}
    with a.client() as ca, b.client() as cb:
        for k, clip in enumerate(work):
            r = submit(ca if k % 2 else cb, clip)
            assert r.status_code == 202, r.text
            accepted[r.json()["id"]] = clip
    assert jobs_done(a, set(accepted), 600), a.log() + b.log()

    table = rows(db)
    assert set(table) == set(accepted)
    for job_id, clip in accepted.items():
        row = table[job_id]
        assert row["status"] == "done" and row["attempts"] == 1, row
        assert wer([clip.reference], [row["result"]["text"]]) < 0.3, (clip.id, row["result"])
        assert not Path(row["upload_path"]).is_absolute()  # a blob key, not one host's path
    by = {r["replica"] for r in table.values()}
    assert by == {"replica-a", "replica-b"}, by  # both replicas took work from the one queue
    # Exactly once: the two processes together finished each job once.
    assert finished_done(a) + finished_done(b) == len(accepted)
    # Any replica answers for any job, and the blob folder is empty once all are done.
    some = next(iter(accepted))
    with a.client() as ca, b.client() as cb:
        assert ca.get(f"/jobs/{some}").json() == cb.get(f"/jobs/{some}").json()
    assert not [f for f in (shared / "uploads").iterdir() if f.name in accepted]
    # A NUL in a file name was a 500 here (PostgreSQL text cannot hold one); now it is dropped
    # from the display name and the job runs. (It had a test and a replica of its own: ~9 CPU-s
    # for one job.)
    nul_name_is_dropped(a, db, work[0])


def nul_name_is_dropped(srv: Server, db: str, clip: Clip) -> None:
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a\x00b.wav"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + clip.path.read_bytes()
            + b"\r\n--b--\r\n")
    with srv.client() as c:
        r = c.post("/transcribe", params={"wait": "true"}, content=body,
                   headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "ab.wav" and r.json()["status"] == "done"
    assert rows(db)[r.json()["id"]]["filename"] == "ab.wav"


def long_upload(clips: list[Clip], dest: Path, seconds: float) -> str:
    """One WAV of read speech clips back to back, ~``seconds`` long; returns its reference."""
    from app.audio import decode

    pool = [c for c in speech_clips(clips, 200) if c.set == "ljspeech"]
    parts, refs, total = [], [], 0.0
    for c in pool:
        parts.append(decode(c.path, 3600.0))
        refs.append(c.reference)
        total += c.duration_s
        if total >= seconds:
            break
    pcm = (np.clip(np.concatenate(parts), -1, 1) * 32767).astype("<i2")
    with wave.open(str(dest), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return " ".join(refs)


@pytest.mark.model
def test_kill_9_replica_other_finishes_after_lease(make_server: type[Server], tmp_path: Path,
                                                   db: str, clips: list[Clip]) -> None:
    shared = tmp_path / "shared"
    a = make_server(shared, env=server_env(db, "replica-a")).start()
    b = make_server(shared, env=server_env(db, "replica-b")).start()
    long_wav = tmp_path / "long.wav"
    reference = long_upload(clips, long_wav, 150)
    with a.client() as ca:  # a submit wakes its own replica: A almost always claims it
        with long_wav.open("rb") as f:
            r = ca.post("/transcribe", data={"language": "en"}, files={"file": ("long.wav", f)})
        assert r.status_code == 202, r.text
        long_id = r.json()["id"]
    short = {}
    with b.client() as cb:
        for clip in speech_clips(clips, 4):
            r = submit(cb, clip)
            assert r.status_code == 202, r.text
            short[r.json()["id"]] = clip

    def mid_job() -> bool:
        row = rows(db)[long_id]
        return (row["lease_owner"] is not None and row["windows_total"] is not None
                and 0 < row["windows_done"] < row["windows_total"])

    assert wait_until(mid_job, 300, step=0.2), rows(db)[long_id]
    # The one running the long job dies (A, unless B's poll won the claim by a few ms).
    owner = rows(db)[long_id]["lease_owner"]
    victim, survivor = (a, b) if owner == "replica-a" else (b, a)
    other = "replica-b" if owner == "replica-a" else "replica-a"
    victim.kill()  # SIGKILL: no drain, no release; the lease is all that is left
    killed_at = time.time()
    held_until = rows(db)[long_id]["lease_expires_at"]
    assert held_until > killed_at  # the victim's last heartbeat had extended it

    # The job stays the victim's until its lease expires; then the survivor requeues it.
    assert wait_until(lambda: rows(db)[long_id]["lease_owner"] != owner, 60, step=0.1)
    seen_at = time.time()
    assert seen_at >= held_until, (seen_at - held_until, "requeued before the lease expired")
    print(f"kill -9 {owner} -> lease expired after {held_until - killed_at:.1f} s, "
          f"job taken over after {seen_at - killed_at:.1f} s (lease {LEASE_S} s)")

    assert jobs_done(survivor, {long_id, *short}, 600), survivor.log()
    table = rows(db)
    row = table[long_id]
    assert row["status"] == "done" and row["replica"] == other and row["attempts"] == 2, row
    assert wer([reference], [row["result"]["text"]]) < 0.3, row["result"]["text"]
    for job_id, clip in short.items():
        assert table[job_id]["status"] == "done", table[job_id]
        assert wer([clip.reference], [table[job_id]["result"]["text"]]) < 0.3
    with survivor.client() as c:
        got = c.get(f"/jobs/{long_id}/result")
        assert got.status_code == 200 and got.json()["text"] == row["result"]["text"]
    assert not (shared / "uploads" / long_id).exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(victim.url + "/healthz", timeout=2)  # really gone
