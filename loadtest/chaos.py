"""Chaos bench (issue 51, item 3): every row exactly once while replicas and the database fail.

    . scripts/env.sh && .venv/bin/python -m loadtest.chaos --out loadtest/results/chaos.json

Three replicas (``python -m app``, the real model) on one PostgreSQL and one blob folder, each
behind a proxy that cuts a share of client connections mid-request or mid-answer
(loadtest/lib/chaos_rig.py); the dataset client (``batchscribe dataset``, its own retries and
Idempotency-Keys) feeds all three through the proxies. Meanwhile one replica is SIGKILLed and
restarted every ``--kill-every`` seconds, in turn, and PostgreSQL itself is restarted once
(``pg_ctl restart -m fast``, its connections cut). At the end it counts (counts, not timings):

* every manifest row exactly once in the output (none missing, none twice);
* jobs in the table == rows, all ``done``; none left ``running`` or leased (no job left claimed
  by a dead replica);
* every HTTP answer of every replica's every life, by status, from their access logs: none
  500 (a store that went away answers 503 with Retry-After, which the client retries).

The run passes only if all of these hold, after at least three kills and the one restart of
PostgreSQL (``--rows`` repeats the corpus to last that long); the results file records the
commit and whether the tree was clean. It loads the CPU heavily (three models on the machine's
cores): a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.lib.chaos_rig import CuttingProxy, Postgres, Replica
from loadtest.lib.common import ROOT, child_env, machine_info
from loadtest.lib.corpus import DEFAULT_CORPUS, load_corpus

ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


def manifest(corpus: Path, rows: int, path: Path, seed: int) -> list[str]:
    """``rows`` rows of the corpus in an order drawn with ``seed`` (the corpus again, in a new
    order, when there are more rows than clips: a run long enough for its kills), as a NeMo
    manifest; the rows' ids (``<clip id>#<round>``), their identity in the output."""
    clips = load_corpus(corpus)
    rng = random.Random(seed)
    order: list[tuple[int, Any]] = []
    while len(order) < rows:
        order += [(len(order) // len(clips), c) for c in rng.sample(clips, len(clips))]
    ids = []
    with path.open("w") as f:
        for k, c in order[:rows]:
            ids.append(f"{c.id}#{k}")
            f.write(json.dumps({"audio_filepath": c.path, "duration": c.duration_s,
                                "text": c.reference, "id": ids[-1]}) + "\n")
    return ids


def replica_env(db: str, lease_s: float) -> dict[str, str]:
    """Replicas of one deployment. ``storage.max_attempts`` 100, not 3: a job whose runs keep
    dying with their process fails after that many (a crash loop's stop), and here every kill
    costs an attempt to each job its replica had started, waiting for the engine included; a
    restarted replica takes its own interrupted jobs back first, so one job can ride the same
    replica through kill after kill (a 60-row run, a kill every 20 s on 2 loaded cores, failed
    two jobs at 10 attempts, one of them a 7 s clip). The bench is about exactly once; the
    attempts each job took are in its results."""
    return {"BATCHSCRIBE_STORAGE__DATABASE_URL": db, "BATCHSCRIBE_STORAGE__LEASE_S": str(lease_s),
            "BATCHSCRIBE_STORAGE__MAX_ATTEMPTS": "100", "BATCHSCRIBE_MODEL__NUM_WORKERS": "1",
            "BATCHSCRIBE_SHUTDOWN_GRACE_S": "5"}


def chaos(replicas: list[Replica], pg: Postgres, client: subprocess.Popen[bytes],
          kill_every: float, pg_restart_after: int, deadline: float) -> list[dict[str, Any]]:
    """Kill a ready replica and restart it every ``kill_every`` s, in turn; restart PostgreSQL
    after the ``pg_restart_after``-th kill. Until the client ends (or the deadline)."""
    events: list[dict[str, Any]] = []
    t0, turn, kills = time.monotonic(), 0, 0
    next_kill = t0 + kill_every
    while client.poll() is None and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, next_kill - time.monotonic())))
        if time.monotonic() < next_kill:
            continue
        next_kill += kill_every
        ready = [r for r in replicas if r.ready()]
        if len(ready) < 2:  # never all of them: the bench is about surviving, not an outage
            continue
        # In turn over all replicas (the next one in order that is up): each lives about
        # len(replicas) x kill_every seconds.
        victim = next(r for k in range(len(replicas))
                      if (r := replicas[(turn + k) % len(replicas)]) in ready)
        turn = replicas.index(victim) + 1
        kills += 1
        victim.kill()
        victim.start(wait=False)
        events.append({"at_s": round(time.monotonic() - t0, 1), "killed": victim.name})
        if kills == pg_restart_after:
            pg.restart()
            events.append({"at_s": round(time.monotonic() - t0, 1), "restarted": "postgresql"})
    return events


def check_output(out: Path, rows: list[str]) -> dict[str, Any]:
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []
    seen = Counter(str(x.get("id")) for x in lines)
    return {"rows": len(rows), "output_lines": len(lines),
            "missing": sorted(set(rows) - set(seen)), "twice": sorted(k for k, n in seen.items() if n > 1),
            "unexpected": sorted(set(seen) - set(rows))}


def check_table(db: str) -> dict[str, Any]:
    import sqlalchemy as sa

    eng = sa.create_engine(db)
    try:
        with eng.connect() as c:
            rows = [dict(r._mapping) for r in c.execute(sa.text(
                "SELECT status, attempts, lease_owner, idempotency_key FROM jobs"))]
            holds = c.execute(sa.text("SELECT count(*) FROM holds")).scalar_one()
    finally:
        eng.dispose()
    return {"jobs": len(rows), "by_status": dict(Counter(r["status"] for r in rows)),
            "attempts": dict(sorted(Counter(r["attempts"] for r in rows).items())),
            "leased": sum(1 for r in rows if r["lease_owner"] is not None),
            "without_key": sum(1 for r in rows if not r["idempotency_key"]),
            "distinct_keys": len({r["idempotency_key"] for r in rows}), "holds_left": holds}


def answers(replicas: list[Replica]) -> dict[str, Any]:
    """Every access-log line of every life: counts by status (and the 5xx lines themselves)."""
    by_status: Counter[str] = Counter()
    fives: list[str] = []
    errors: Counter[str] = Counter()
    for r in replicas:
        for log in r.lives:
            for line in log.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("level") in ("ERROR", "CRITICAL"):
                    errors[str(rec.get("msg"))[:120]] += 1
                m = ACCESS.search(str(rec.get("msg")))
                if m and rec.get("logger") == "uvicorn.access":
                    by_status[m["status"]] += 1
                    if m["status"].startswith("5"):
                        fives.append(f"{r.name}: {m['method']} {m['path']} {m['status']}")
    return {"by_status": dict(sorted(by_status.items())), "status_500": by_status["500"],
            "errors_logged": dict(errors.most_common(20)), "5xx": fives[:50]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200, help="rows (the corpus repeats past its size)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--pg-restart-after", type=int, default=1, help="restart PostgreSQL after "
                   "this many kills (once)")
    p.add_argument("--cut", type=float, default=0.3, help="share of client connections cut "
                   "(at a random byte of their stream, if they carry that many)")
    p.add_argument("--lease", type=float, default=5.0, help="storage.lease_s of the replicas")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--seed", type=int, default=51)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    machine = machine_info()  # the commit and tree as the run starts
    tmp = Path(tempfile.mkdtemp(prefix="batchscribe-chaos-"))
    pg = Postgres(Path(tempfile.mkdtemp(prefix="batchscribe-chaos-pg-"))).start()
    replicas: list[Replica] = []
    proxies: list[CuttingProxy] = []
    try:
        db = pg.create_db("chaos")
        env = replica_env(db, args.lease)
        replicas = [Replica(f"replica-{k + 1}", tmp / "shared", env) for k in range(args.replicas)]
        for r in replicas:
            r.start()
        proxies = [CuttingProxy(r.port, args.cut, args.seed + k) for k, r in enumerate(replicas)]
        rows = manifest(args.corpus, args.rows, tmp / "manifest.jsonl", args.seed)
        out = tmp / "out.jsonl"
        cmd = [sys.executable, "-m", "app.cli", "dataset", str(tmp / "manifest.jsonl"), "-o",
               str(out), "--language", "en", "--no-progress",
               *(a for x in proxies for a in ("--server", x.url))]
        started = time.monotonic()
        with (tmp / "client.log").open("wb") as log:
            client = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log,
                                      stderr=subprocess.STDOUT)
            events = chaos(replicas, pg, client, args.kill_every, args.pg_restart_after,
                           started + args.timeout)
            try:
                client.wait(max(1.0, started + args.timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                client.kill()
        wall = time.monotonic() - started
        for r in replicas:  # let restarted ones finish starting, then drain all
            r.stop()
        result: dict[str, Any] = {
            "bench": "chaos", "command": "python -m loadtest.chaos " + " ".join(argv or sys.argv[1:]),
            "machine": machine, "settings": vars(args) | {"corpus": str(args.corpus),
                                                                 "out": str(args.out)},
            "client_exit": client.returncode, "wall_s": round(wall, 1), "events": events,
            "kills": sum(r.kills for r in replicas), "postgres_restarts": pg.restarts,
            "connections": {"through_proxies": sum(x.connections for x in proxies),
                            "cut_mid_request": sum(x.cut_requests for x in proxies),
                            "cut_mid_answer": sum(x.cut_responses for x in proxies),
                            "refused_replica_down": sum(x.refused for x in proxies)},
            "output": check_output(out, rows), "table": check_table(db),
            "answers": answers(replicas),
            "client_tail": (tmp / "client.log").read_text(errors="replace")[-3000:],
        }
        o, t, a = result["output"], result["table"], result["answers"]
        result["passed"] = bool(
            client.returncode == 0 and not o["missing"] and not o["twice"] and not o["unexpected"]
            and t["jobs"] == len(rows) and t["by_status"] == {"done": len(rows)}
            and t["leased"] == 0 and a["status_500"] == 0 and result["kills"] >= 3
            and pg.restarts == 1)
        text = json.dumps(result, indent=2)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        print(json.dumps({k: result[k] for k in ("passed", "client_exit", "wall_s", "kills",
                                                 "postgres_restarts", "connections", "output",
                                                 "table", "answers")}, indent=2))
        return 0 if result["passed"] else 1
    finally:
        for x in proxies:
            x.stop()
        for r in replicas:
            r.kill()
        pg.stop()
        print(f"(work folder: {tmp})", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
