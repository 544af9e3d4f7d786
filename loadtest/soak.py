"""Bounded soak: mixed load for a fixed time, the server's RSS sampled throughout.

    . scripts/env.sh && .venv/bin/python -m loadtest.soak --duration 1200 \
        --out loadtest/results/soak.json

Starts ``python -m app`` on a free port with a temporary data dir (or targets ``--url``; then
RSS comes from the service's ``process_resident_memory_bytes``), and runs ``--clients``
closed-loop clients that each pick, per iteration: an async upload then polling and fetching the
result in a random format (most), a ``?wait=true`` upload, an upload cancelled at once, or a bad
upload (random bytes, empty file) that must get its 4xx. 429s are honoured (Retry-After, capped).

RSS is read every ``--sample-s`` seconds. After ``--warmup-s`` (model load, allocator pools,
first batches), a least-squares line through the samples gives the growth over the run; the
verdict is "flat" when that growth stays under max(64 MiB, 5 % of the post-warm-up mean). Any
5xx or transport error is counted and makes the run fail (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from loadtest.common import free_port, proc_status_kb

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("BATCHSCRIBE_CORPUS", ROOT.parent / "shared" / "corpus"))
FORMATS = ("json", "text", "srt", "vtt")


def corpus(max_s: float) -> list[Path]:
    rows = [json.loads(x) for x in (CORPUS / "manifest.jsonl").read_text().splitlines()]
    return [CORPUS / r["file"] for r in rows if float(r["duration_s"]) <= max_s]


class Soak:
    def __init__(self, url: str, clips: list[Path], deadline: float, seed: int) -> None:
        self.url = url
        self.clips = clips
        self.deadline = deadline
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.status: Counter[str] = Counter()  # "<kind> <status code>"
        self.errors: list[str] = []
        self.jobs_done = 0
        self.audio_files = 0

    def count(self, kind: str, r: httpx.Response) -> None:
        with self.lock:
            self.status[f"{kind} {r.status_code}"] += 1
            if r.status_code >= 500:
                self.errors.append(f"{kind} {r.status_code} {r.text[:200]}")

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while time.monotonic() < self.deadline:
                try:
                    self.one(c, rng)
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.errors.append(f"transport {type(exc).__name__}: {exc}")
                    time.sleep(1)

    def upload(self, c: httpx.Client, name: str, data: bytes, wait: bool = False) -> httpx.Response:
        r = c.post("/transcribe", params={"wait": str(wait).lower()}, files={"file": (name, data)})
        kind = "upload-wait" if wait else "upload"
        self.count(kind, r)
        if r.status_code == 429:  # honour Retry-After, capped so the run stays bounded
            time.sleep(min(float(r.headers.get("retry-after", "1")), 10.0))
        return r

    def one(self, c: httpx.Client, rng: random.Random) -> None:
        roll = rng.random()
        clip = rng.choice(self.clips)
        if roll < 0.08:  # bad input: a clear 4xx (random bytes may, rarely, decode as audio)
            empty = rng.random() < 0.3
            data = b"" if empty else rng.randbytes(rng.randint(1, 50_000))
            r = self.upload(c, "bad.wav", data)
            if empty and r.status_code not in (422, 429):
                with self.lock:
                    self.errors.append(f"empty upload answered {r.status_code}")
            return
        data = clip.read_bytes()
        with self.lock:
            self.audio_files += 1
        if roll < 0.25:
            self.upload(c, clip.name, data, wait=True)
            return
        r = self.upload(c, clip.name, data)
        if r.status_code != 202:
            return
        job_id = r.json()["id"]
        if roll < 0.32:  # cancelled at once: must cost nothing and leave no upload behind
            self.count("cancel", c.delete(f"/jobs/{job_id}"))
            return
        while time.monotonic() < self.deadline + 120:
            j = c.get(f"/jobs/{job_id}")
            self.count("poll", j)
            if j.status_code == 200 and j.json()["status"] in ("done", "failed", "cancelled"):
                break
            time.sleep(0.5)
        self.count("result", c.get(f"/jobs/{job_id}/result", params={"format": rng.choice(FORMATS)}))
        if rng.random() < 0.1:
            self.count("list", c.get("/jobs", params={"limit": 100}))
        with self.lock:
            self.jobs_done += 1


def read_rss(pid: int | None, url: str) -> int | None:
    if pid is not None:
        kb = proc_status_kb(pid, "VmRSS")
        return None if kb is None else kb * 1024
    try:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return int(float(line.split()[1]))
    except httpx.HTTPError:
        return None
    return None


def slope(points: list[tuple[float, int]]) -> float:
    """Least-squares bytes per second."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (r - mr) for t, r in points) / den if den else 0.0


def summarise(samples: list[tuple[float, int]], warmup_s: float, duration_s: float) -> dict[str, Any]:
    mib = 2**20
    after = [(t, r) for t, r in samples if t >= warmup_s]
    if len(after) < 2:
        return {"verdict": "too short", "samples_after_warmup": len(after)}
    rate = slope(after)
    growth = rate * (after[-1][0] - after[0][0])
    mean = sum(r for _, r in after) / len(after)
    allowed = max(64 * mib, 0.05 * mean)
    return {
        "rss_at_warmup_mib": round(after[0][1] / mib, 1), "rss_end_mib": round(after[-1][1] / mib, 1),
        "rss_peak_mib": round(max(r for _, r in samples) / mib, 1),
        "rss_min_after_warmup_mib": round(min(r for _, r in after) / mib, 1),
        "rss_max_after_warmup_mib": round(max(r for _, r in after) / mib, 1),
        "slope_mib_per_min": round(rate * 60 / mib, 3), "fitted_growth_mib": round(growth / mib, 1),
        "allowed_growth_mib": round(allowed / mib, 1),
        "verdict": "flat" if growth < allowed else "growing",
        "duration_s": duration_s, "warmup_s": warmup_s, "samples_after_warmup": len(after),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=1200, help="seconds of load (default 20 min)")
    p.add_argument("--warmup-s", type=float, default=None, help="default: 20%% of the duration")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-clip-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--url", default=None, help="soak a running service instead of starting one")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "soak.json")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    warmup = args.warmup_s if args.warmup_s is not None else 0.2 * args.duration

    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    url = args.url
    if url is None:
        port = free_port()
        env = {**os.environ, "BATCHSCRIBE_PORT": str(port),
               "BATCHSCRIBE_STORAGE__DATA_DIR": tmp.name}
        log = open(Path(tmp.name) / "server.log", "wb")  # noqa: SIM115 (lives as long as the server)
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                print((Path(tmp.name) / "server.log").read_text()[-3000:], file=sys.stderr)
                return 2
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    pid = proc.pid if proc else None

    clips = corpus(args.max_clip_s)
    t0 = time.monotonic()
    soak = Soak(url, clips, t0 + args.duration, args.seed)
    threads = [threading.Thread(target=soak.client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    samples: list[tuple[float, int]] = []
    while time.monotonic() < t0 + args.duration:
        rss = read_rss(pid, url)
        if rss is not None:
            samples.append((round(time.monotonic() - t0, 1), rss))
        time.sleep(args.sample_s)
    for t in threads:
        t.join(180)
    rss = read_rss(pid, url)
    if rss is not None:
        samples.append((round(time.monotonic() - t0, 1), rss))
    healthy = httpx.get(url + "/healthz", timeout=10).status_code == 200
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)

    summary = summarise(samples, warmup, args.duration)
    result: dict[str, Any] = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "warmup_s": warmup, "clips": len(clips)},
        "summary": summary,
        "requests": dict(sorted(soak.status.items())), "jobs_completed": soak.jobs_done,
        "uploads_of_audio": soak.audio_files, "errors": soak.errors[:50],
        "error_count": len(soak.errors), "healthy_at_end": healthy,
        "rss_samples": [{"t_s": t, "rss_mib": round(r / 2**20, 1)} for t, r in samples],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("summary", "requests", "error_count")}, indent=2))
    tmp.cleanup()
    return 0 if not soak.errors and healthy and summary["verdict"] == "flat" else 1


if __name__ == "__main__":
    raise SystemExit(main())
