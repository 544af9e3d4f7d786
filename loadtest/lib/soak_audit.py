"""The soak's end: every job it saw accepted is awaited and audited (loadtest/soak.py).

"No lost job" means: each accepted job (a 200/202 that named it, or a /v1 answer's
``X-Batchscribe-Job-Id``) is still in GET /jobs (``?ids=``, under its own key), none is left
queued or running after the drain, none was cancelled except by the soak, none failed without a
clear error (a type other than ``internal_error`` and a message), and each ended as its input
expects (:class:`loadtest.lib.soak_hostile.Expect`: status, error type, counted length, webhook
delivered). Jobs nobody tracked (an answer lost in transit) must not be left running either:
each key's newest 1000 are checked too.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from loadtest.lib.hook_receiver import HookReceiver
from loadtest.lib.soak_hostile import TERMINAL, Recorder

Rows = dict[str, dict[str, Any]]  # job id -> the job as GET /jobs gives it


def fetch(rec: Recorder, ids: list[str]) -> tuple[Rows, list[str]]:
    """The jobs ``ids`` name (GET /jobs?ids=, 100 at a time, under each job's key); and the
    ids the service does not know."""
    rows: Rows = {}
    for key in rec.keys:
        mine = [i for i in ids if rec.jobs[i][0] == key]
        with rec.client(key, 120) as c:
            for k in range(0, len(mine), 100):
                r = rec.count(key, "audit", c.get("/jobs", params={"ids": ",".join(mine[k:k + 100])}))
                rows.update((j["id"], j) for j in r.json()["jobs"])
    return rows, [i for i in ids if i not in rows]


def settle(rec: Recorder, drain_s: float, done: Callable[[dict[str, Any]], bool]) -> tuple[Rows, list[str]]:
    """Re-read the tracked jobs until ``done(job)`` holds for all (or ``drain_s`` passes)."""
    rows, missing = fetch(rec, list(rec.jobs))
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline:
        again = [i for i, j in rows.items() if not done(j)]
        if not again:
            break
        time.sleep(2)
        fresh, gone = fetch(rec, again)
        rows.update(fresh)
        missing += gone
        for i in gone:
            rows.pop(i, None)
    return rows, missing


def audit(rec: Recorder, hooks: HookReceiver | None, drain_s: float) -> dict[str, Any]:
    """No lost job: every accepted job is in GET /jobs and terminal, cancelled only by us,
    failed only with a clear error, and as its input expects (webhooks delivered)."""
    rows, missing = settle(rec, drain_s, lambda j: j["status"] in TERMINAL)
    rows, gone = settle(rec, 120, lambda j: j["status"] != "done" or j.get("webhook") is None
                        or j["webhook"]["status"] not in ("waiting", "pending"))
    lost = [f"{i} ({rec.jobs[i][1]}): missing from GET /jobs" for i in dict.fromkeys(missing + gone)]
    wrong: list[str] = []
    hooked: Counter[str] = Counter()
    delivered = hooks.delivered_ids() if hooks else set()
    for i, j in rows.items():
        key, kind, want = rec.jobs[i]
        st, err = j["status"], j.get("error") or {}
        if st not in TERMINAL:
            lost.append(f"{i} ({kind}): still {st}")
        elif st == "cancelled" and i not in rec.cancelled:
            lost.append(f"{i} ({kind}): cancelled, not by us")
        elif st == "failed" and (not err.get("message") or err.get("type") in (None, "internal_error")):
            wrong.append(f"{i} ({kind}): failed without a clear error: {err}")
        elif st not in want.statuses or (want.error_type and err.get("type") != want.error_type):
            wrong.append(f"{i} ({kind}): {st} {err}, expected {sorted(want.statuses)} "
                         f"{want.error_type or ''}")
        elif st == "done" and j["audio_seconds"] < want.min_audio_s:
            wrong.append(f"{i} ({kind}): counted at {j['audio_seconds']} s, not {want.min_audio_s}+")
        if want.hook and st == "done":
            hook = (j.get("webhook") or {}).get("status")
            hooked[f"{want.hook} {hook}"] += 1
            if hook != "delivered" or i not in delivered:
                wrong.append(f"{i}: webhook ({want.hook}) {j.get('webhook')}")
    for key in rec.keys:  # jobs nobody tracked (e.g. an answer lost in transit) must end too
        with rec.client(key, 120) as c:
            for j in rec.count(key, "audit", c.get("/jobs", params={"limit": 1000})).json()["jobs"]:
                if j["status"] not in TERMINAL and j["id"] not in rec.jobs:
                    lost.append(f"{j['id']} (key {key}, untracked): still {j['status']}")
    return {"accepted": len(rec.jobs), "final": dict(sorted(Counter(
                f"{rec.jobs[i][0]} {rec.jobs[i][1]} {j['status']}" for i, j in rows.items()).items())),
            "lost_count": len(lost), "lost": lost[:50], "unexpected_count": len(wrong),
            "unexpected": wrong[:50], "webhooks": dict(sorted(hooked.items()))}


def latencies(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=20, method="inclusive") if len(xs) > 1 else [xs[0]] * 19
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 3), "p95_s": round(q[18], 3),
            "max_s": round(max(xs), 3)}
