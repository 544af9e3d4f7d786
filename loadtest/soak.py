"""Bounded soak: mixed load plus the hostile inputs of issue 18, RSS sampled, every job audited.

    . scripts/env.sh && .venv/bin/python -m loadtest.soak --duration 1200 \
        --out loadtest/results/soak.json

Starts ``python -m app`` on a free port with a temporary data dir, two API keys, webhooks on
(a secret, ``OUTBOUND__ALLOWED_HOSTS=["127.0.0.2"]``, a 5 s attempt deadline) and small limits
(:func:`server_env`), or targets ``--url`` (run it with the same settings; then RSS comes from
``process_resident_memory_bytes``). Traffic, for ``--duration`` seconds:

* key B, ``--clients`` closed-loop clients: an async upload, polled, its result fetched in a
  random format (most; a quarter carry a ``callback_url`` to the soak's receiver), a
  ``?wait=true`` upload, an upload cancelled at once, or a bad upload (random bytes, empty file);
* key B, one hostile client (loadtest/lib/soak_hostile.py), an input every ``--hostile-gap-s``:
  playlists naming key A's spool files or absolute paths (415, no job), WAVs declaring
  10 MHz / 64 channels / 0 Hz (4xx), a Matroska file whose header says 5 s for 90 s (must
  finish, counted at 90 s), the SSRF callback URLs (400), the ``openai`` SDK with an
  undecodable upload (one 4xx, one request, at most one job) and a normal one, one POST twice
  with an Idempotency-Key (one job), oversized bodies, too many form parts, one event stream
  past the per-key cap (429);
* key A, ``--flood`` threads posting 1 s clips, honouring 429 Retry-After;
* a webhook receiver (loadtest/lib/hook_receiver.py) answering 200, or 200 and an endless body
  (trickled, or as fast as it goes): each attempt must end by the service's deadline.

RSS is read every ``--sample-s`` seconds; after ``--warmup-s`` it is "flat" when its floor (each
two minutes' lowest) grew less than max(64 MiB, 5 % of the mean) and its last quarter set no new
high by as much (:func:`summarise`). At the end
every accepted job is awaited (``--drain-s``) and audited: none missing from GET /jobs, none
left queued or running, cancelled only by us, failed only with a clear error, and each as its
input expects; webhooks delivered. Exit 1 on any 5xx, transport error, failed check, lost job,
429 on key B, or growing RSS. The results name the commit and whether the tree was clean.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.lib.common import child_env, free_port, machine_info, proc_status_kb
from loadtest.lib.corpus import DEFAULT_CORPUS, Clip, load_corpus
from loadtest.lib.hook_receiver import HookReceiver
from loadtest.lib.hostile_inputs import header_only_wav, load, lying_flac, lying_mkv, wav
from loadtest.lib.rss_verdict import summarise
from loadtest.lib.soak_audit import audit, latencies
from loadtest.lib.soak_hostile import CANCELLABLE, OTHER, TERMINAL, Expect, Hostile, Media, Recorder

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("json", "text", "srt", "vtt")
HOOK_MODES = ("ok", "trickle", "stream")
MAX_UPLOAD = 16 * 2**20  # oversized bodies stay cheap; the long WAV (150 s, 4.8 MB) fits
MAX_AUDIO_S = 290.0  # under lying_flac()'s 300 s: that job fails when decoding passes it
JOBS_PER_KEY = 16  # A's flood is capped here; B never holds more than ~10
STREAMS_PER_KEY = 4
TRANSFERS_PER_KEY = 16  # the default; B sends at most clients + 2 at once, A's flood 3
HOOK_TIMEOUT_S = 5.0


def server_env(digests: list[str], hook_secret: str) -> dict[str, str]:
    return {
        "BATCHSCRIBE_SECURITY__API_KEY_SHA256": ",".join(digests),
        "BATCHSCRIBE_WEBHOOKS__SECRET": hook_secret,
        "BATCHSCRIBE_WEBHOOKS__TIMEOUT_S": str(HOOK_TIMEOUT_S),
        "BATCHSCRIBE_OUTBOUND__ALLOWED_HOSTS": '["127.0.0.2"]',
        "BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "BATCHSCRIBE_LIMITS__MAX_AUDIO_S": str(MAX_AUDIO_S),
        "BATCHSCRIBE_LIMITS__MAX_QUEUED_JOBS_PER_KEY": str(JOBS_PER_KEY),
        "BATCHSCRIBE_LIMITS__MAX_EVENT_STREAMS_PER_KEY": str(STREAMS_PER_KEY),
        # Issue 51: the soak runs with the per-key caps on what is in flight, written out so the
        # results record them: transfers (uploads, downloads), outbound slots (webhooks).
        "BATCHSCRIBE_LIMITS__MAX_TRANSFERS_PER_KEY": str(TRANSFERS_PER_KEY),
        "BATCHSCRIBE_OUTBOUND__MAX_PER_KEY": "16",
        "BATCHSCRIBE_OUTBOUND__MAX_PER_HOST_PER_KEY": "4",
    }


def key_secrets(secret: str, keys: dict[str, str]) -> dict[str, str]:
    """Each key's id -> the secret the service signs its deliveries with: deliveries are signed
    per key since issue 38 (a receiver checking the one server secret counted 224 bad
    signatures in a 20-minute run: the soak's expectation was stale, not the service)."""
    from app.jobs.webhooks import key_secret

    ids = [hashlib.sha256(k.encode()).hexdigest()[:16] for k in keys.values()]
    return {i: key_secret(secret, i) for i in ids}


def make_media(corpus: list[Clip]) -> Media:
    # Read speech, where every second has words (ljspeech in the English corpus); any other
    # corpus (the multilingual one has no such set) gives all its clips.
    read = [c for c in corpus if c.set == "ljspeech"] or sorted(corpus, key=lambda c: c.id)
    short = min((c for c in read if c.duration_s > 3), key=lambda c: c.duration_s)
    speech = np.concatenate([load(Path(c.path), 16000).reshape(-1) for c in read])
    while len(speech) < 150 * 16000:
        speech = np.concatenate([speech, speech])
    first = load(Path(short.path), 16000).reshape(-1)
    return Media(clip=(Path(short.path).name, Path(short.path).read_bytes()),
                 tiny=wav(first[:16000], 16000), mkv=lying_mkv(speech[:90 * 16000], 5.0),
                 mkv_real_s=90.0, liar_flac=lying_flac(300.0), header_only=header_only_wav(1.0),
                 long_wav=wav(speech[:150 * 16000], 16000))


class Load:
    """Key B's mixed load and key A's flood."""

    def __init__(self, rec: Recorder, clips: list[Path], media: Media, hooks: str | None,
                 deadline: float) -> None:
        self.rec, self.clips, self.media, self.hooks = rec, clips, media, hooks
        self.deadline = deadline
        self.hook_n = itertools.count(1)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with self.rec.client(OTHER) as c:
            while time.monotonic() < self.deadline:
                try:
                    self.one(c, rng)
                except httpx.HTTPError as exc:
                    self.rec.error(f"transport {type(exc).__name__}: {exc}")
                    time.sleep(1)

    def upload(self, c: httpx.Client, kind: str, name: str, data: bytes, wait: bool = False,
               form: dict[str, str] | None = None) -> httpx.Response:
        r = self.rec.count(OTHER, kind, c.post("/transcribe", params={"wait": str(wait).lower()},
                                               files={"file": (name, data)}, data=form))
        if r.status_code == 429:  # honour Retry-After, capped so the run stays bounded
            time.sleep(min(float(r.headers.get("retry-after", "1")), 10.0))
        return r

    def one(self, c: httpx.Client, rng: random.Random) -> None:
        roll = rng.random()
        clip = rng.choice(self.clips)
        if roll < 0.08:  # bad input: a clear 4xx (random bytes may, rarely, decode as audio)
            empty = rng.random() < 0.3
            data = b"" if empty else rng.randbytes(rng.randint(1, 50_000))
            r = self.upload(c, "bad", "bad.wav", data)
            self.rec.track(OTHER, "bad", r, Expect(frozenset({"done", "failed"})))
            self.rec.check(not empty or r.status_code == 422, f"empty upload: {r.status_code}")
            return
        data = clip.read_bytes()
        t0 = time.monotonic()
        if roll < 0.25:
            r = self.upload(c, "upload-wait", clip.name, data, wait=True)
            self.rec.track(OTHER, "upload-wait", r)
            if r.status_code == 200:
                self.rec.timed("upload-wait", time.monotonic() - t0)
            return
        mode = rng.choice(HOOK_MODES) if self.hooks and roll >= 0.32 and rng.random() < 0.25 else None
        form = None
        if mode:
            form = {"callback_url": f"{self.hooks}/{mode}/{next(self.hook_n)}"}
        kind = "cancel-at-once" if roll < 0.32 else ("upload-hook" if mode else "upload")
        r = self.upload(c, kind, clip.name, data, form=form)
        job_id = self.rec.track(OTHER, kind, r, CANCELLABLE if roll < 0.32 else Expect(hook=mode))
        if job_id is None:
            return
        if roll < 0.32:  # cancelled at once: must cost nothing and leave no upload behind
            self.rec.cancelled_by_us(job_id)
            self.rec.count(OTHER, "cancel", c.delete(f"/jobs/{job_id}"))
            return
        while time.monotonic() < self.deadline + 120:
            j = self.rec.count(OTHER, "poll", c.get(f"/jobs/{job_id}"))
            if j.status_code == 200 and j.json()["status"] in TERMINAL:
                self.rec.timed("upload-async", time.monotonic() - t0)
                break
            time.sleep(0.5)
        self.rec.count(OTHER, "result", c.get(f"/jobs/{job_id}/result",
                                              params={"format": rng.choice(FORMATS)}))
        if rng.random() < 0.1:
            self.rec.count(OTHER, "list", c.get("/jobs", params={"limit": 100}))

    def flood(self) -> None:
        """Key A: 1 s clips back to back; a 429 is waited out for its Retry-After."""
        with self.rec.client("A", 60) as c:
            while time.monotonic() < self.deadline:
                try:
                    r = self.rec.count("A", "flood", c.post(
                        "/transcribe", files={"file": ("tiny.wav", self.media.tiny)}))
                except httpx.HTTPError as exc:
                    self.rec.error(f"flood: transport {type(exc).__name__}: {exc}")
                    time.sleep(1)
                    continue
                self.rec.track("A", "flood", r)
                if r.status_code == 429:
                    self.rec.note(f"A 429 {r.json()['error'].get('limit')}")
                    time.sleep(min(float(r.headers.get("retry-after", "1")), 30.0))
                else:
                    self.rec.check(r.status_code == 202, f"flood: {r.status_code} {r.text[:200]}")


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


def start_server(env: dict[str, str], data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = child_env(extra={**env, "BATCHSCRIBE_PORT": str(port),
                           "BATCHSCRIBE_STORAGE__DATA_DIR": str(data_dir)})
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not start:\n" + (data_dir / "server.log").read_text()[-3000:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=1200, help="seconds of load (default 20 min)")
    p.add_argument("--warmup-s", type=float, default=None, help="default: 20%% of the duration")
    p.add_argument("--clients", type=int, default=6, help="key B's mixed-load clients")
    p.add_argument("--flood", type=int, default=3, help="key A's flooding threads")
    p.add_argument("--hostile-gap-s", type=float, default=2.0)
    p.add_argument("--max-clip-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--drain-s", type=float, default=300.0, help="wait for accepted jobs to end")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--url", default=None, help="soak a running service (see server_env)")
    p.add_argument("--api-keys", default=None, help="with --url: KEY_A,KEY_B")
    p.add_argument("--hook-secret", default=None, help="with --url: its webhooks secret")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "soak.json")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    warmup = args.warmup_s if args.warmup_s is not None else 0.2 * args.duration
    machine = machine_info()

    keys = dict(zip("AB", args.api_keys.split(","), strict=True)) if args.api_keys else \
        {"A": secrets.token_hex(16), "B": secrets.token_hex(16)}
    secret = args.hook_secret or secrets.token_hex(16)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    proc, url, spool = None, args.url, None
    if url is None:
        digests = [hashlib.sha256(k.encode()).hexdigest() for k in keys.values()]
        proc, url = start_server(server_env(digests, secret), tmp)
        spool = tmp / "uploads"
    pid = proc.pid if proc else None
    hooks = HookReceiver(key_secrets(secret, keys), HOOK_TIMEOUT_S).start() \
        if args.url is None or args.hook_secret else None

    corpus = load_corpus(args.corpus)
    clips = [Path(c.path) for c in corpus if c.duration_s <= args.max_clip_s]
    media = make_media(corpus)
    rec = Recorder(url, keys)
    t0 = time.monotonic()
    load_ = Load(rec, clips, media, hooks.url if hooks else None, t0 + args.duration)
    hostile = Hostile(rec, media, MAX_UPLOAD, STREAMS_PER_KEY, spool, clips[0])
    threads = [threading.Thread(target=load_.client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.clients)]
    threads += [threading.Thread(target=load_.flood, daemon=True) for _ in range(args.flood)]
    threads.append(threading.Thread(target=hostile.run, daemon=True,
                                    args=(t0 + args.duration, args.hostile_gap_s, args.seed)))
    for t in threads:
        t.start()
    samples: list[tuple[float, int]] = []
    while time.monotonic() < t0 + args.duration:
        rss = read_rss(pid, url)
        if rss is not None:
            samples.append((round(time.monotonic() - t0, 1), rss))
        time.sleep(args.sample_s)
    for t in threads:
        t.join(max(1.0, t0 + args.duration + 300 - time.monotonic()))
    rec.check(not any(t.is_alive() for t in threads), "a client thread did not finish")
    rss = read_rss(pid, url)
    if rss is not None:
        samples.append((round(time.monotonic() - t0, 1), rss))
    jobs = audit(rec, hooks, args.drain_s)
    healthy = httpx.get(url + "/healthz", timeout=10).status_code == 200
    hook_stats = hooks.stats() if hooks else None
    if hooks:
        hooks.stop()
        rec.check(hook_stats is not None and hook_stats["bad_signatures"] == 0 and
                  not any(m["held_past_deadline"] for m in hook_stats["modes"].values()),
                  f"webhook receiver: {hook_stats}")
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)

    summary = summarise(samples, warmup, args.duration)
    other_429 = sum(n for k, n in rec.status.items()
                    if k.startswith(f"{OTHER} ") and k.endswith(" 429") and "events-cap" not in k)
    ok = (not rec.errors and healthy and summary["verdict"] == "flat" and other_429 == 0
          and jobs["lost_count"] == 0 and jobs["unexpected_count"] == 0)
    result: dict[str, Any] = {
        "pass": ok, "machine": machine, "commit": machine["git"], "tree_clean": machine["git_clean"],
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                      if k not in ("api_keys", "hook_secret")}, "warmup_s": warmup,
                   "clips": len(clips), "server_env": server_env(["<digest>"], "<secret>")},
        "duration_s": round(time.monotonic() - t0, 1), "summary": summary, "jobs": jobs,
        "other_key": {"429": other_429, "latency": {k: latencies(v) for k, v in rec.latency.items()}},
        "webhook_receiver": hook_stats, "requests": dict(sorted(rec.status.items())),
        "notes": dict(rec.notes), "errors": rec.errors[:50], "error_count": len(rec.errors),
        "healthy_at_end": healthy,
        "rss_samples": [{"t_s": t, "rss_mib": round(r / 2**20, 1)} for t, r in samples],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("pass", "summary", "jobs", "other_key",
                                             "webhook_receiver", "error_count", "errors")}, indent=2))
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"server data and log kept in {tmp}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
