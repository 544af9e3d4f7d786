"""Issue 51, item 2: per-key caps hold for the deployment, not per replica.

Two real service processes (``python -m tests.fake_replica``: the app on a fake engine) on one
real PostgreSQL (tests/test_postgres.py starts it), through real HTTP and real sockets:

* key A at its transfer cap on replica 1 (two trickling uploads) is refused on replica 2 (429
  ``max_transfers_per_key``) while key B is served there; at its live-session cap on replica 1
  it is refused a session on replica 2 (``session_limit``);
* replica 1 killed (SIGKILL) while holding those slots gives them back within its lease: A's
  upload and A's session on replica 2 go through once the lease has run out, not before;
* PostgreSQL stopped under a replica: 503 ``store_unavailable`` (retry), never 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.lib.corpus import Clip
from tests.conftest import Server
from tests.helpers import bearer, sha
from tests.test_postgres import PG_BINS, db, pg  # noqa: F401  (fixtures)

websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import connect  # noqa: E402

KEY_A, KEY_B = "replica-key-a", "replica-key-b"
LEASE_S = 5.0  # 3 s: a loaded CI host once stalled a replica past its lease
CAP = 2


def env(url: str, replica: str) -> dict[str, str]:
    return {"BATCHSCRIBE_STORAGE__DATABASE_URL": url,
            "BATCHSCRIBE_STORAGE__REPLICA_ID": replica,
            "BATCHSCRIBE_STORAGE__LEASE_S": str(LEASE_S),
            "BATCHSCRIBE_SECURITY__API_KEY_SHA256": f"{sha(KEY_A)},{sha(KEY_B)}",
            "BATCHSCRIBE_LIMITS__MAX_TRANSFERS_PER_KEY": str(CAP),
            "BATCHSCRIBE_LIVE__MAX_SESSIONS_PER_KEY": "1",
            "BATCHSCRIBE_MODEL__WARMUP": "false",
            "BATCHSCRIBE_SHUTDOWN_GRACE_S": "2"}


def trickling_upload(srv: Server, key: str) -> socket.socket:
    """An upload whose body never completes: one transfer held while the socket is open.

    The gate answers before a body byte, so an answer within a second is a refusal: CI once saw
    replica 1 refuse one of the two (a 429 in its log, the test then waiting 30 s for a cap
    replica 2 could never see); its body is in the failure, and the upload is tried again."""
    refusals = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(f"POST /transcribe HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: "
                  f"Bearer {key}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                  "Content-Length: 1000000\r\n\r\n--b\r\n".encode())
        s.settimeout(1.0)
        try:
            answer = s.recv(4096)
        except TimeoutError:
            s.settimeout(None)
            return s  # held: the gate let it in and waits for the body
        s.close()
        refusals.append(answer.decode(errors="replace"))
        time.sleep(0.5)
    raise AssertionError(f"the trickling upload was refused: {refusals}")


def upload(srv: Server, key: str, clip: Clip) -> httpx.Response:
    with clip.path.open("rb") as f:
        return httpx.post(srv.url + "/transcribe", files={"file": (clip.path.name, f)},
                          data={"language": "en"}, headers=bearer(key), timeout=60)


async def first_event(srv: Server, key: str) -> str:
    """The first event of a live session: ``session.created``, or the refusal's error code."""
    async with connect(srv.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
                       additional_headers=bearer(key)) as ws:
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
    return str(event["type"] if event["type"] != "error" else event["error"]["code"])


def test_a_keys_caps_hold_across_two_replicas_and_a_dead_ones_slots_come_back(
        make_server: type[Server], tmp_path: Path, db: str, clips: list[Clip]) -> None:  # noqa: F811
    if not PG_BINS:
        pytest.skip("no PostgreSQL")
    clip = min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)
    shared = tmp_path / "shared"
    one = make_server(shared, env=env(db, "replica-1"), module="tests.fake_replica").start()
    two = make_server(shared, env=env(db, "replica-2"), module="tests.fake_replica").start()
    held = [trickling_upload(one, KEY_A) for _ in range(CAP)]
    try:
        def refused_on_two() -> bool:
            r = upload(two, KEY_A, clip)
            assert r.status_code in (202, 429), r.text
            return r.status_code == 429 and r.json()["error"]["limit"] == "max_transfers_per_key"

        deadline = time.monotonic() + 30  # the trickles' headers reach replica 1's gate
        while not refused_on_two():
            assert time.monotonic() < deadline, "A was never at its cap on replica 2"
            time.sleep(0.2)
        assert upload(two, KEY_B, clip).status_code == 202  # B is another key

        async def live() -> None:
            ws = await connect(one.url.replace("http://", "ws://")
                               + "/v1/realtime?intent=transcription",
                               additional_headers=bearer(KEY_A))
            try:
                assert json.loads(await ws.recv())["type"] == "session.created"
                assert await first_event(two, KEY_A) == "session_limit"  # its one is on 1
                assert await first_event(two, KEY_B) == "session.created"
                one.kill()  # SIGKILL with the session, and both uploads, open: only leases left
                killed = time.monotonic()
                assert await first_event(two, KEY_A) == "session_limit"  # the lease still runs
                assert upload(two, KEY_A, clip).status_code == 429
                while (got := await first_event(two, KEY_A)) != "session.created":
                    assert got == "session_limit"
                    assert time.monotonic() - killed < LEASE_S + 3, "the dead replica's slot stayed"
                    await asyncio.sleep(0.2)
                back = time.monotonic() - killed
                assert back >= LEASE_S * 0.5, back  # not before the lease could have run out
                r = upload(two, KEY_A, clip)
                assert r.status_code == 202, r.text  # its transfers came back too
                print(f"replica killed: its slots back after {back:.1f} s (lease {LEASE_S} s)")
            finally:
                with contextlib.suppress(Exception):  # its replica is gone
                    await ws.close()

        asyncio.run(live())
    finally:
        for s in held:
            s.close()


async def test_concurrent_takes_on_two_stores_never_pass_the_cap(db: str) -> None:  # noqa: F811
    """Store level: 20 takes at once from two replicas' stores, cap 3: exactly 3 slots; the
    heartbeat extends the live ones and deletes its replica's rows of given-back ones."""
    import sqlalchemy as sa

    from app.jobs.holds import SharedHolds
    from app.jobs.schema import holds
    from app.jobs.store import JobStore

    a, b = JobStore(db), JobStore(db)
    try:
        await a.init()
        await b.init()
        ha, hb = SharedHolds(a, "r-a", 30.0), SharedHolds(b, "r-b", 30.0)
        got = await asyncio.gather(*(h.take("transfer", "k", 3) for h in [ha, hb] * 10))
        taken = [g for g in got if g is not None]
        assert len(taken) == 3 and await ha.count("transfer", "k") == 3
        assert await ha.take("transfer", "other-key", 3) is not None  # keys are apart
        mine = [g for g in taken if g in a.holds_alive]
        a.holds_alive.clear()  # as if r-a had lost track of its holds (a failed DELETE)
        await a.heartbeat("r-a", {}, 30.0)
        rows = await a.run(lambda c: {r.id for r in c.execute(sa.select(holds.c.id))})
        assert not set(mine) & rows and await hb.count("transfer", "k") == 3 - len(mine)
    finally:
        await a.close()
        await b.close()


def test_a_database_that_goes_away_is_a_503_not_a_500(
        make_server: type[Server], tmp_path: Path, pg: Any, db: str,  # noqa: F811
        clips: list[Clip]) -> None:
    """PostgreSQL stopped under a replica: requests that need the store answer 503 with
    Retry-After (``store_unavailable``, which clients retry), never 500; back once it is."""
    from tests.test_postgres import _as_postgres

    clip = min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)
    srv = make_server(tmp_path / "shared", env=env(db, "replica-1"),
                      module="tests.fake_replica").start()
    ctl = [str(pg.bindir / "pg_ctl"), "-D", str(pg.root / "data"), "-w", "-t", "60"]
    opts = (f"-p {pg.port} -k {pg.root / 'sock'} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200")
    subprocess.run(_as_postgres([*ctl, "-m", "fast", "stop"]), check=True, capture_output=True)
    try:
        answers = [httpx.get(srv.url + "/jobs", headers=bearer(KEY_A), timeout=60),
                   upload(srv, KEY_A, clip),
                   httpx.post(srv.url + "/transcribe", json={"audio_url": "http://example.com/a"},
                              headers={**bearer(KEY_A), "Idempotency-Key": "k1"}, timeout=60)]
    finally:
        subprocess.run(_as_postgres([*ctl, "-l", str(pg.root / "server.log"), "-o", opts,
                                     "start"]), check=True, capture_output=True)
    for r in answers:
        assert r.status_code == 503, (r.request.url, r.status_code, r.text)
        assert r.json()["error"]["type"] == "store_unavailable" and r.headers["Retry-After"]
    deadline = time.monotonic() + 30
    while (r := upload(srv, KEY_A, clip)).status_code == 503:  # pooled connections renewed
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert r.status_code == 202, r.text
