"""One long meeting-like upload alone, with and without ``diarize=true``, this tree against a
base in one run; then the bench's speaker phase (closed-loop clients replaying the diarization
corpus, plain then diarized) on each tree in turn.

    python -m loadtest.diarize_alone --base 897b68c --out loadtest/results/diarize-alone.json

The upload is the twelve recordings of ``tests/data/diarization`` (AMI meetings, a call, a
radio phone-in: 2-4 speakers each) one after another, repeated to ``--minutes``: a long
recording with many voices, as a meeting's, where speaker work dominates the job. Both
services run at once (``python -m app`` of each tree, speaker models loaded at start-up) and
the posts alternate between them, so the host's drift falls on both alike. Per post: wall time
from the POST to the answer, the job's speaker time (``batchscribe_diarization_seconds``), the
service's CPU seconds and its prep processes', and a digest of the transcript and speaker
turns (the same digest on both trees: the change did not change the result).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtest.feed import base_tree
from loadtest.lib import speakers_bench
from loadtest.lib.common import ROOT, machine_info, write_wav16
from loadtest.lib.corpus import load_corpus
from loadtest.lib.probes import children_cpu, cpu_seconds
from loadtest.lib.service import Server
from loadtest.lib.stats import latency_summary

DEVSET = ROOT / "tests" / "data" / "diarization"


def meeting(minutes: float, out: Path) -> Path:
    from app.audio import decode

    if out.is_file():
        return out
    parts = [decode(DEVSET / json.loads(line)["file"], 3600.0)
             for line in (DEVSET / "manifest.jsonl").read_text().splitlines() if line.strip()]
    x = np.concatenate(parts)
    n = int(minutes * 60 * 16_000)
    x = np.tile(x, n // len(x) + 1)[:n]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_wav16(out, x)
    return out


def diarization_s(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("batchscribe_diarization_seconds_sum "):
            return float(line.split()[1])
    return 0.0


async def post(srv: Server, path: Path, diarize: bool) -> dict[str, Any]:
    assert srv.proc is not None
    pid = srv.proc.pid
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(srv.url, timeout=timeout) as http:
        async with http.get("/metrics") as r:
            d0 = diarization_s(await r.text())
        c0, k0 = cpu_seconds(pid), children_cpu(pid)
        t0 = time.monotonic()
        with path.open("rb") as f:
            form = aiohttp.FormData()
            form.add_field("file", f, filename=path.name)
            form.add_field("diarize", "true" if diarize else "false")
            async with http.post("/transcribe", params={"wait": "true"}, data=form) as r:
                status, job = r.status, await r.json()
        wall = time.monotonic() - t0
        async with http.get("/metrics") as r:
            d1 = diarization_s(await r.text())
    result = job.get("result") or {}
    turns = [(s.get("start"), s.get("end"), s.get("speaker"), s.get("text"))
             for s in result.get("segments", [])]
    return {"status": status, "job_status": job.get("status"), "wall_s": round(wall, 2),
            "diarization_s": round(d1 - d0, 2),
            "cpu_s": {"service": round(cpu_seconds(pid) - c0, 2),
                      "prep": round(children_cpu(pid) - k0, 2)},
            "speakers": len(result.get("speakers") or []),
            "digest": hashlib.sha256(json.dumps(turns).encode()).hexdigest()[:16]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8, help="speaker phase (0: skip it)")
    ap.add_argument("--duration", type=float, default=120.0, help="speaker phase, each way")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-diarize-alone"))
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "diarize-alone.json")
    args = ap.parse_args(argv)
    trees = {"base": base_tree(args.base, args.work), "this": ROOT}
    upload = meeting(args.minutes, args.work / f"meeting-{args.minutes:g}min.wav")
    report: dict[str, Any] = {
        "command": "python -m loadtest.diarize_alone " + " ".join(argv or []),
        "machine": machine_info(), "base_commit": args.base, "minutes": args.minutes,
        "repeats": args.repeats, "trees": {}}
    servers = {name: Server(args.work / f"svc-{name}", cwd=tree,
                            env={"PYTHONPATH": str(tree), "BATCHSCRIBE_SPEAKERS__LOAD": "startup"})
               for name, tree in trees.items()}
    try:
        for srv in servers.values():
            srv.start()
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            n: {"plain": [], "diarize": []} for n in trees}
        for name in trees:  # warm: first requests allocate (not counted)
            asyncio.run(post(servers[name], upload, True))
        for _ in range(args.repeats):
            for mode in ("plain", "diarize"):
                for name in trees:
                    r = asyncio.run(post(servers[name], upload, mode == "diarize"))
                    runs[name][mode].append(r)
                    print(name, mode, r, flush=True)
        for name in trees:
            t = report["trees"][name] = {"runs": runs[name]}
            for mode in ("plain", "diarize"):
                t[mode] = latency_summary([r["wall_s"] for r in runs[name][mode]])
        report["same_result"] = {m: len({r["digest"] for n in trees for r in runs[n][m]}) == 1
                                 for m in ("plain", "diarize")}
        if args.clients:
            clips = speakers_bench.workload(load_corpus())
            for name, srv in servers.items():
                assert srv.proc is not None
                report["trees"][name]["speaker_phase"] = asyncio.run(speakers_bench.run(
                    srv.url, clips, None, args.clients, args.warmup, args.duration, srv.proc.pid,
                    2))
                print(name, "speaker phase", report["trees"][name]["speaker_phase"]["ratio"],
                      flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
