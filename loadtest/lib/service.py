"""The service side of the benchmark: a real ``python -m app`` process and an asyncio HTTP client.

The client is deliberately thin (aiohttp, uploads held in memory, no parsing beyond the job JSON)
because it shares the 2 cores with the server it measures.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.lib.common import ROOT, child_env, free_port, proc_status_kb, wait_up, write_wav16
from loadtest.lib.corpus import SHORT_CLIP_S, Clip, replay_order
from loadtest.lib.probes import (
    CpuSnap,
    counter_delta,
    cpu_seconds,
    cpu_snap,
    cpu_split,
    histogram_delta,
    parse_metrics,
)
from loadtest.lib.stats import latency_summary

TERMINAL = ("done", "failed", "cancelled")
RETRIES_429 = 20  # posts of one request a 429 may take, each after its Retry-After


@dataclass
class Server:
    """``python -m app`` (or ``argv``) on a free port with its own data dir (as tests/conftest.py
    starts it)."""

    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    tcmalloc: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    argv: list[str] = field(default_factory=lambda: ["-m", "app"])  # after the interpreter
    cwd: Path = ROOT  # another source tree (a --base commit's) runs its own code

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def start(self, timeout: float = 300.0) -> Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = child_env(self.tcmalloc, {"BATCHSCRIBE_PORT": str(self.port),
                                        "BATCHSCRIBE_HOST": "127.0.0.1",
                                        "BATCHSCRIBE_STORAGE__DATA_DIR": str(self.data_dir),
                                        **self.env})
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, *self.argv], cwd=self.cwd, env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait_up(self.proc, self.url + "/readyz", timeout, "server", self.log_tail):
            return self
        self.stop()
        raise RuntimeError(f"server not ready in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.is_file() else ""

    def peak_rss_mb(self) -> float | None:
        kb = proc_status_kb(self.proc.pid, "VmHWM") if self.proc else None
        return None if kb is None else round(kb / 1024, 1)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


# ---- the client -------------------------------------------------------------------------------
@dataclass
class Result:
    clip: Clip
    sent: float  # monotonic
    done: float
    status: int
    text: str | None = None
    error: str | None = None
    words: int | None = None  # word timestamps in the result (when asked for)
    language: str | None = None  # the transcript's (detected when none was sent)

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.text is not None


class Client:
    """The load generator's HTTP side, on aiohttp: ~0.4 ms of CPU per request against ~1.5 ms
    with httpx (measured against a null-engine server, the former ``loadtest/overhead.py``: git
    history), CPU that the server it measures would otherwise lose. Create it
    inside the running event loop."""

    def __init__(self, url: str, clips: Sequence[Clip], language: str | None,
                 timeout: float = 900.0, fields: dict[str, str] | None = None) -> None:
        self.url = url
        self.language = language
        self.fields = fields or {}  # more form fields on every upload, e.g. diarize=true
        self.blobs = {c.id: c.path.read_bytes() for c in clips}
        self.http = aiohttp.ClientSession(
            url, connector=aiohttp.TCPConnector(limit=256),
            timeout=aiohttp.ClientTimeout(total=timeout))

    async def close(self) -> None:
        await self.http.close()

    def _form(self, name: str, blob: bytes) -> aiohttp.FormData:
        form = aiohttp.FormData()
        form.add_field("file", blob, filename=name)
        if self.language:
            form.add_field("language", self.language)
        for k, v in self.fields.items():
            form.add_field(k, v)
        return form

    async def transcribe(self, clip: Clip) -> Result:
        """One synchronous request (``?wait=true``): upload to finished transcript, timed from
        its first POST. A 429 is posted again after its Retry-After, as clients do (up to
        ``RETRIES_429`` times): a burst of 32 at once meets the per-key cap of 16 uploads being
        received (``limits.max_transfers_per_key``), and the WER pass once left 3 of 83 clips
        out that way, which read as 0.51 points of WER "from batching" (bench-core.json)."""
        sent = time.monotonic()
        for attempt in range(RETRIES_429 + 1):
            form = self._form(clip.path.name, self.blobs[clip.id])
            try:
                async with self.http.post("/transcribe", params={"wait": "true"},
                                          data=form) as r:
                    body = await r.text()
                    status = r.status
                    retry_after = r.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as exc:
                return Result(clip, sent, time.monotonic(), 0,
                              error=f"{type(exc).__name__}: {exc}")
            if status != 429 or attempt == RETRIES_429:
                break
            await asyncio.sleep(float(retry_after or 1.0))
        done = time.monotonic()
        if status != 200:
            return Result(clip, sent, done, status, error=body[:500])
        job = json.loads(body)
        if job.get("status") != "done":
            return Result(clip, sent, done, status, error=str(job.get("error")))
        words = job["result"].get("words")
        return Result(clip, sent, done, 200, text=job["result"]["text"],
                      words=None if words is None else len(words),
                      language=job["result"].get("language"))

    async def text_of(self, name: str, blob: bytes) -> str:
        """One synchronous request for any audio (not a corpus clip): its text ("" if not done)."""
        async with self.http.post("/transcribe", params={"wait": "true"},
                                  data=self._form(name, blob)) as r:
            job = await r.json()
        return str(job["result"]["text"]) if job.get("status") == "done" else ""

    async def submit(self, name: str, blob: bytes) -> str:
        """An asynchronous job (202); its id."""
        async with self.http.post("/transcribe", data=self._form(name, blob)) as r:
            r.raise_for_status()
            return str((await r.json())["id"])

    async def job(self, job_id: str) -> dict[str, Any]:
        async with self.http.get(f"/jobs/{job_id}") as r:
            r.raise_for_status()
            return dict(await r.json())

    async def cancel(self, job_id: str) -> None:
        async with self.http.delete(f"/jobs/{job_id}"):
            pass

    async def metrics(self) -> dict[tuple[str, str], float]:
        async with self.http.get("/metrics") as r:
            r.raise_for_status()
            return parse_metrics(await r.text())

    async def wait_idle(self, pid: int, timeout: float = 300.0) -> None:
        """Until no window is queued and the server burns no CPU (the last batch has finished)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = await self.metrics()
            c0 = cpu_seconds(pid)
            await asyncio.sleep(1.0)
            if m.get(("batchscribe_queue_pending_windows", ""), 0.0) == 0 and \
                    cpu_seconds(pid) - c0 < 0.1:
                return


# ---- phases -----------------------------------------------------------------------------------
class Cycle:
    def __init__(self, clips: Sequence[Clip]) -> None:
        self.order = replay_order(clips)
        self.i = 0

    def next(self) -> Clip:
        c = self.order[self.i % len(self.order)]
        self.i += 1
        return c


async def closed_loop(client: Client, clips: Sequence[Clip], n_clients: int, warmup_s: float,
                      duration_s: float, pid: int | None = None,
                      engine_threads: int = 2) -> dict[str, Any]:
    """``n_clients`` each send the next clip as soon as their previous one finished.

    Throughput is measured in steady state: audio seconds of the requests that finish inside
    [warm-up end, warm-up end + duration] over ``duration``. Requests still in flight at the
    end are awaited (so the next phase starts on an idle server) but not counted.
    """
    cycle = Cycle(clips)
    results: list[Result] = []
    t0 = time.monotonic()
    t_start, t_stop = t0 + warmup_s, t0 + warmup_s + duration_s
    snaps: dict[str, dict[tuple[str, str], float]] = {}

    async def user() -> None:
        while time.monotonic() < t_stop:
            results.append(await client.transcribe(cycle.next()))

    cpu: dict[str, CpuSnap] = {}

    async def snapshot(at: float, key: str) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if pid is not None:
            cpu[key] = await asyncio.to_thread(cpu_snap, pid)
        snaps[key] = await client.metrics()

    await asyncio.gather(snapshot(t_start, "start"), snapshot(t_stop, "stop"),
                         *(user() for _ in range(n_clients)))
    window = [r for r in results if t_start <= r.done <= t_stop]
    ok = [r for r in window if r.ok]
    audio = sum(r.clip.duration_s for r in ok)
    return {
        "clients": n_clients, "warmup_s": warmup_s, "duration_s": duration_s,
        "throughput_x": round(audio / duration_s, 3), "audio_s": round(audio, 3),
        "requests_ok": len(ok), "requests_failed": len(window) - len(ok),
        "errors": sorted({r.error or "" for r in results if not r.ok})[:5],
        "latency_all": latency_summary([r.latency for r in ok]),
        "latency_short": latency_summary([r.latency for r in ok if r.clip.duration_s <= SHORT_CLIP_S]),
        "batch_size": histogram_delta(snaps["start"], snaps["stop"],
                                      "batchscribe_batch_size_windows"),
        "batch_fill": histogram_delta(snaps["start"], snaps["stop"], "batchscribe_batch_fill_ratio"),
        "queue_wait": histogram_delta(snaps["start"], snaps["stop"], "batchscribe_queue_wait_seconds"),
        "batch_duration": histogram_delta(snaps["start"], snaps["stop"],
                                          "batchscribe_batch_duration_seconds"),
        "engine_audio_s": counter_delta(snaps["start"], snaps["stop"],
                                        "batchscribe_audio_processed_seconds_total"),
        "cpu": (cpu_split(cpu["start"], cpu["stop"], duration_s, engine_threads)
                if pid is not None else None),
        "_results": results,
        "_counted": ok,  # the requests behind the throughput and latencies above
    }


async def sequential(client: Client, clips: Sequence[Clip], n: int) -> list[Result]:
    cycle = Cycle(clips)
    return [await client.transcribe(cycle.next()) for _ in range(n)]


async def all_at_once(client: Client, clips: Sequence[Clip], concurrency: int) -> list[Result]:
    sem = asyncio.Semaphore(concurrency)

    async def one(c: Clip) -> Result:
        async with sem:
            return await client.transcribe(c)

    return list(await asyncio.gather(*(one(c) for c in clips)))


def write_long_wav(clips: Sequence[Clip], path: Path, min_s: float, gap_s: float = 0.8,
                   used: list[Clip] | None = None) -> float:
    """Concatenate decoded corpus clips with silence gaps into one 16 kHz mono wav >= min_s;
    ``used`` gets the clips in the order written (their references are the file's)."""
    import numpy as np

    from app.audio import decode
    from app.windows import SAMPLE_RATE

    gap = np.zeros(int(gap_s * SAMPLE_RATE), np.float32)
    parts: list[np.ndarray] = []
    total = 0
    ordered = sorted(clips, key=lambda c: c.id)
    decoded = [decode(c.path, 4 * 3600.0) for c in ordered]
    while total < min_s * SAMPLE_RATE:
        for c, a in zip(ordered, decoded, strict=True):
            parts += [a, gap]
            total += len(a) + len(gap)
            if used is not None:
                used.append(c)
            if total >= min_s * SAMPLE_RATE:
                break
    return write_wav16(path, np.concatenate(parts), SAMPLE_RATE)


def server_env_defaults() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("BATCHSCRIBE_")}
