"""``batchscribe dataset MANIFEST -o OUT.jsonl``: a whole dataset through one or more services.

Three kinds of task share one event loop:

* the *feeder* hands rows to whichever server has room (app/client/flow.py: files in flight
  sized from the service's backlog, 429s and Retry-After); an upload task per row posts it with
  an Idempotency-Key (run id, row, attempt) and records the job in the checkpoint;
* one *poller* per server follows all of that server's jobs with ``GET /jobs?ids=...`` (one
  request per 100 jobs, every tenth of the queued work's duration, 0.5-5 s; before the speed
  is known, 0.5 s while jobs finish, backing off to 5 s while none do), so thousands in flight
  cost a few requests, not a connection each;
* finished jobs become output rows, written and recorded by the checkpoint (app/client/
  checkpoint.py) on its own thread, one fsync'ed batch per poll.

A server that stops answering (killed, restarting, draining) is paused with a back-off and its
uploads are requeued for the others or for later; its jobs are followed again once it is back
(they are in its store). Errors a retry cannot fix (a 4xx other than 429, a failed job) fail
the row, and the summary lists them; ``--resume --retry-failed`` tries those rows again.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from app.client.checkpoint import Checkpoint
from app.client.flow import Flow
from app.client.manifest import Manifest, Row
from app.client.progress import Progress
from app.client.rows import Extras, output_row

TERMINAL = ("done", "failed", "cancelled")
POLL_MIN_S, POLL_MAX_S = 0.5, 5.0
MAX_IDS = 100  # the service's GET /jobs?ids= bound
LOST_AFTER = 3  # polls in a row without a job before it counts as gone (then resubmitted)
MAX_SERVER_ERRORS = 5  # 5xx answers to one row's upload before the row fails


class Fatal(Exception):
    """Nothing more can succeed (a refused API key): the run stops."""


@dataclass
class Request:
    language: str | None = None
    task: str = "transcribe"
    word_timestamps: bool = False

    def form(self) -> dict[str, str]:
        data = {"task": self.task, "word_timestamps": str(self.word_timestamps).lower()}
        if self.language:
            data["language"] = self.language
        return data


@dataclass
class Server:
    url: str
    flow: Flow
    submit: bool = True  # False: only follows jobs an earlier run sent there
    uploads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    follow: dict[str, int] = field(default_factory=dict)  # job id -> row
    misses: dict[str, int] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # it has jobs to follow again


class Run:
    def __init__(self, manifest: Manifest, ckpt: Checkpoint, servers: list[Server],
                 request: Request, extras: Extras, progress: Progress,
                 headers: dict[str, str], retry_failed: bool = False) -> None:
        self.rows = manifest.rows
        self.stems = manifest.subtitle_stems() if extras.subtitles else {}
        self.ckpt, self.servers, self.request, self.extras = ckpt, servers, request, extras
        self.progress, self.headers = progress, headers
        self.pending: deque[int] = deque()
        self.server_errors: dict[int, int] = {}
        self.changed = asyncio.Event()  # room may have opened, or rows came back
        self.finished = asyncio.Event()
        self.fatal: str | None = None
        self.uploading: set[asyncio.Task[None]] = set()
        self.io = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")  # fsyncs, in order
        by_url = {s.url: s for s in servers}
        st = ckpt.state
        for row in self.rows:
            i = row.index
            if i in st.done:
                continue
            if i in st.failed and not retry_failed:
                continue
            sub = st.submitted.get(i)
            if sub is None:
                self.pending.append(i)
                continue
            if sub.server not in by_url:  # sent there by an earlier run: follow it there
                by_url[sub.server] = Server(sub.server, Flow(), submit=False)
                servers.append(by_url[sub.server])
            by_url[sub.server].follow[sub.job] = i
            by_url[sub.server].flow.in_flight += 1
        self.remaining = len(self.pending) + sum(len(s.follow) for s in servers)

    # ---- the whole run ------------------------------------------------------------------------
    async def main(self, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> bool:
        """True when every row ended (done or failed); False on the time-out. ``transport``:
        tests' stand-in for the network."""
        if self.remaining == 0:
            return True
        limits = httpx.Limits(max_connections=16 + 8 * len(self.servers), max_keepalive_connections=32)
        timeout = httpx.Timeout(120.0, connect=10.0, write=300.0)
        async with httpx.AsyncClient(headers=self.headers, timeout=timeout, limits=limits,
                                     transport=transport) as http:
            self.http = http
            tasks = [asyncio.create_task(self._feed(), name="feed")]
            tasks += [asyncio.create_task(self._poll(s), name=f"poll {s.url}") for s in self.servers]
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout_s):
                        await self.finished.wait()
            finally:
                self.finished.set()
                self.changed.set()
                for s in self.servers:
                    s.wake.set()
                tasks += self.uploading
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.io.shutdown(wait=True)
        if self.fatal:
            raise Fatal(self.fatal)
        return self.remaining == 0

    def _ended(self, n: int = 1) -> None:
        self.remaining -= n
        if self.remaining <= 0:
            self.finished.set()
            for s in self.servers:
                s.wake.set()

    def say(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    # ---- submitting ---------------------------------------------------------------------------
    async def _feed(self) -> None:
        while not self.finished.is_set():
            self.changed.clear()
            now = time.monotonic()
            open_ = [s for s in self.servers if s.submit and s.flow.room(now) > 0]
            while self.pending and open_:
                server = max(open_, key=lambda s: s.flow.room(now))
                server.flow.in_flight += 1
                self._show_in_flight()
                task = asyncio.create_task(self._submit(server, self.rows[self.pending.popleft()]))
                self.uploading.add(task)
                task.add_done_callback(self.uploading.discard)
                open_ = [s for s in open_ if s.flow.room(now) > 0]
            paused = [s.flow.paused_until - now for s in self.servers
                      if s.submit and s.flow.paused_until > now]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(paused) if paused else None):
                    await self.changed.wait()

    async def _submit(self, server: Server, row: Row) -> None:
        attempt = self.ckpt.state.attempt(row.index)
        key = self.ckpt.idempotency_key(row.index, attempt)
        try:
            async with server.uploads:
                r = await self._post(server, row, key)
        except OSError as exc:  # the local file: missing or unreadable
            await self._fail(server, row.index, attempt, f"{type(exc).__name__}: {exc}")
            return
        except httpx.TransportError as exc:
            self._unreachable(server, exc)
            self._requeue(server, row.index)
            return
        if r.status_code in (200, 202):
            job_id = str(r.json()["id"])
            await self._io(self.ckpt.submitted, row.index, attempt, server.url, job_id)
            server.follow[job_id] = row.index
            if len(server.follow) == 1:
                server.wake.set()  # its poller may be backed off while it had nothing to follow
            return
        if r.status_code == 429:
            err = _error(r)
            server.flow.overloaded(_seconds(r.headers.get("Retry-After")), err.get("limit_s"))
            self._requeue(server, row.index)
        elif r.status_code in (401, 403):
            self.fatal = f"{server.url}: {_message(r)}"
            self.finished.set()
        elif r.status_code >= 500 or r.status_code == 408:
            self.server_errors[row.index] = n = self.server_errors.get(row.index, 0) + 1
            if n >= MAX_SERVER_ERRORS and r.status_code != 503:
                await self._fail(server, row.index, attempt, _message(r))
            else:
                self._unreachable(server, _message(r))
                self._requeue(server, row.index)
        else:  # 4xx: this row's input (not audio, too long, a bad option); retrying cannot help
            await self._fail(server, row.index, attempt, _message(r))

    async def _post(self, server: Server, row: Row, key: str) -> httpx.Response:
        url, headers, data = f"{server.url}/transcribe", {"Idempotency-Key": key}, self.request.form()
        if row.remote:  # the service fetches it (audio_url): never downloaded here
            return await self.http.post(url, data={**data, "audio_url": row.audio}, headers=headers)
        path = Path(row.audio)
        content = await asyncio.to_thread(path.read_bytes)
        return await self.http.post(url, data=data, headers=headers,
                                    files={"file": (path.name, content)})

    def _requeue(self, server: Server, row: int) -> None:
        server.flow.in_flight -= 1
        self.pending.appendleft(row)
        self._show_in_flight()
        self.changed.set()

    def _unreachable(self, server: Server, why: object) -> None:
        pause = server.flow.unreachable()
        if server.flow.failures == 1:
            self.say(f"{server.url}: {why}; retrying (back-off up to 30 s)")
        elif pause >= 30 and server.flow.failures % 10 == 0:
            self.say(f"{server.url}: still unreachable ({why})")

    async def _fail(self, server: Server, row: int, attempt: int, error: str) -> None:
        await self._io(self.ckpt.fail, row, attempt, error)
        server.flow.in_flight -= 1
        self.progress.update(failed=1)
        self._show_in_flight()
        self.changed.set()
        self._ended()

    # ---- following ----------------------------------------------------------------------------
    async def _poll(self, server: Server) -> None:
        interval = POLL_MIN_S
        while not self.finished.is_set():
            server.wake.clear()  # before the poll: a job followed meanwhile wakes the next one
            ended = 0
            if server.follow:
                try:
                    ended = await self._poll_once(server)
                except (httpx.TransportError, _Unavailable) as exc:
                    self._unreachable(server, exc)
                    interval = POLL_MAX_S
            ideal = server.flow.poll_interval()
            if ideal is not None and not server.flow.failures:
                interval = min(POLL_MAX_S, max(POLL_MIN_S, ideal))
            else:
                interval = POLL_MIN_S if ended else min(POLL_MAX_S, interval * 1.5)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await server.wake.wait()

    async def _poll_once(self, server: Server) -> int:
        ids = list(server.follow)
        jobs: dict[str, dict[str, Any]] = {}
        for k in range(0, len(ids), MAX_IDS):
            r = await self.http.get(f"{server.url}/jobs", params={"ids": ",".join(ids[k:k + MAX_IDS])})
            if r.status_code != 200:
                raise _Unavailable(_message(r))
            if server.flow.failures:
                self.say(f"{server.url}: answering again")
            if "X-Backlog-Seconds" in r.headers:
                limit = r.headers.get("X-Backlog-Limit-Seconds")
                server.flow.observe(float(r.headers["X-Backlog-Seconds"]), float(limit) if limit else None)
                self.changed.set()  # the cap may have grown: the feeder looks again
            jobs.update({j["id"]: j for j in r.json()["jobs"]})
        done, ended = [], 0
        for job_id in ids:
            job = jobs.get(job_id)
            row = server.follow[job_id]
            if job is None:  # expired, or a store that lost it: post again (same key)
                server.misses[job_id] = server.misses.get(job_id, 0) + 1
                if server.misses[job_id] >= LOST_AFTER:
                    self.say(f"row {row}: job {job_id} is gone from {server.url}; submitting again")
                    del server.follow[job_id], server.misses[job_id]
                    self._requeue(server, row)
                continue
            server.misses.pop(job_id, None)
            if job["status"] == "done":
                done.append((row, job))
            elif job["status"] in TERMINAL:
                del server.follow[job_id]
                err = job.get("error") or {}
                await self._fail(server, row, self.ckpt.state.attempt(row),
                                 f"job {job_id} {job['status']}: {err.get('type', '')} "
                                 f"{err.get('message', '')}".strip())
                ended += 1
        if done:
            audio = await self._io(self._write, done)
            now = time.monotonic()
            for (_, job), a in zip(done, audio, strict=True):
                del server.follow[job["id"]]
                server.flow.finished(a, now)
            server.flow.in_flight -= len(done)
            self.progress.update(files=len(done), audio_s=sum(audio))
            self._show_in_flight()
            self.changed.set()
            self._ended(len(done))
        return ended + len(done)

    def _write(self, done: list[tuple[int, dict[str, Any]]]) -> list[float]:
        """On the checkpoint thread: build the rows (scores, subtitle files), write, record."""
        built = [(row, *output_row(self.rows[row], job, self.extras, self.stems.get(row, "")))
                 for row, job in done]
        self.ckpt.finish(built)
        return [float(facts["audio_s"]) for _, _, facts in built]

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def _show_in_flight(self) -> None:
        self.progress.in_flight = sum(s.flow.in_flight for s in self.servers)


class _Unavailable(Exception):
    pass


def _seconds(retry_after: str | None, default: float = 5.0) -> float:
    """Retry-After in seconds (the service sends seconds; an HTTP date or junk: the default)."""
    try:
        return max(0.0, float(retry_after)) if retry_after else default
    except ValueError:
        return default


def _error(r: httpx.Response) -> dict[str, Any]:
    try:
        err = r.json().get("error")
        return err if isinstance(err, dict) else {}
    except ValueError:
        return {}


def _message(r: httpx.Response) -> str:
    err = _error(r)
    if err:
        return f"{err.get('message')} ({r.status_code} {err.get('type') or err.get('code')})"
    return f"HTTP {r.status_code}: {r.text[:200]}"
