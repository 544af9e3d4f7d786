"""The soak's bookkeeping (:class:`Recorder`) and its hostile client (:class:`Hostile`): the
inputs of issue 18, sent at a modest rate beside the mixed load, each answer checked.

Every hostile request goes out under the "other" key (B), the one that must never see a 429
from the flood of key A; only the deliberate over-the-cap event stream (kind ``events-cap``)
is expected to get one. Playlists name key A's jobs: another tenant's spool files.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import openai

from loadtest.lib.hostile_inputs import SSRF_URLS, playlists, wav_declaring

TERMINAL = ("done", "failed", "cancelled")
OTHER = "B"  # the key that sends normal (and hostile) requests; "A" floods tiny jobs


@dataclass(frozen=True)
class Expect:
    """What an accepted job must end as."""

    statuses: frozenset[str] = frozenset({"done"})
    error_type: str | None = None  # a failed job's error type must be this one
    min_audio_s: float = 0.0  # counted at (about) its decoded length
    hook: str | None = None  # the receiver mode of its callback_url


DONE = Expect()
CANCELLABLE = Expect(frozenset({"done", "cancelled"}))


@dataclass
class Media:
    """The payloads, made once before the load starts."""

    clip: tuple[str, bytes]  # a short corpus clip (<= 10 s)
    tiny: bytes  # 1 s of speech, WAV
    mkv: bytes  # Matroska whose header says 5 s
    mkv_real_s: float
    liar_flac: bytes  # STREAMINFO says 1 s, frames hold 300 s (over the soak's max_audio_s)
    header_only: bytes  # a WAV header and no samples
    long_wav: bytes  # speech long enough to still run while its event streams are counted


class Recorder:
    """Status counts, errors, accepted jobs and latencies, shared by every client thread."""

    def __init__(self, url: str, keys: dict[str, str]) -> None:
        self.url = url
        self.keys = keys
        self.lock = threading.Lock()
        self.status: Counter[str] = Counter()  # "<key> <kind> <status code>"
        self.notes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.jobs: dict[str, tuple[str, str, Expect]] = {}  # id -> key, kind, expectation
        self.cancelled: set[str] = set()
        self.latency: dict[str, list[float]] = defaultdict(list)

    def client(self, key: str, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.keys[key]}"})

    def tally(self, key: str, kind: str, status: int, text: str = "") -> None:
        with self.lock:
            self.status[f"{key} {kind} {status}"] += 1
            if status >= 500:
                self.errors.append(f"{key} {kind}: {status} {text[:200]}")

    def count(self, key: str, kind: str, r: httpx.Response) -> httpx.Response:
        self.tally(key, kind, r.status_code, r.text if r.status_code >= 500 else "")
        return r

    def error(self, msg: str) -> None:
        with self.lock:
            self.errors.append(msg)

    def check(self, ok: bool, msg: str) -> bool:
        if not ok:
            self.error(msg)
        return ok

    def note(self, what: str) -> None:
        with self.lock:
            self.notes[what] += 1

    def track(self, key: str, kind: str, r: httpx.Response, expect: Expect = DONE) -> str | None:
        """Remember the job an accepted (200/202) answer names; its id."""
        if r.status_code not in (200, 202):
            return None
        job_id = str(r.json()["id"])
        self.track_id(key, kind, job_id, expect)
        return job_id

    def track_id(self, key: str, kind: str, job_id: str, expect: Expect = DONE) -> None:
        with self.lock:
            self.jobs.setdefault(job_id, (key, kind, expect))

    def cancelled_by_us(self, job_id: str) -> None:
        with self.lock:
            self.cancelled.add(job_id)

    def timed(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latency[kind].append(seconds)

    def latest(self, key: str) -> str | None:
        with self.lock:
            mine = [i for i, (k, _, _) in self.jobs.items() if k == key]
        return mine[-1] if mine else None

    def named(self, key: str, names: set[str]) -> list[dict[str, Any]]:
        """The key's newest jobs whose file name is one of ``names``."""
        with self.client(key) as c:
            jobs = self.count(key, "list", c.get("/jobs", params={"limit": 1000})).json()["jobs"]
        return [j for j in jobs if j["filename"] in names]


class Hostile:
    """One client cycling through the hostile inputs in random order, ``gap_s`` apart."""

    def __init__(self, rec: Recorder, media: Media, max_upload: int, streams_per_key: int,
                 spool_dir: Path | None, absolute: Path) -> None:
        self.rec = rec
        self.media = media
        self.max_upload = max_upload
        self.streams_per_key = streams_per_key
        self.spool_dir = spool_dir
        self.absolute = absolute
        self.n = 0  # actions so far: unique file names
        self.round = 0  # cycles so far: each action alternates its variant by its parity

    def run(self, deadline: float, gap_s: float, seed: int) -> None:
        rng = random.Random(seed)
        actions: list[Callable[[], None]] = [
            self.playlist, self.absurd_wavs, self.lying_mkv, self.ssrf, self.sdk,
            self.idempotency, self.oversize, self.form_caps, self.events_cap]
        while time.monotonic() < deadline:
            self.round += 1
            rng.shuffle(actions)
            for act in actions:
                if time.monotonic() >= deadline:
                    return
                self.n += 1
                try:
                    act()
                except (httpx.HTTPError, OSError, openai.APIConnectionError) as exc:
                    self.rec.error(f"{act.__name__}: transport {type(exc).__name__}: {exc}")
                except Exception as exc:  # a probe that cannot read an answer: a finding too
                    self.rec.error(f"{act.__name__}: {type(exc).__name__}: {exc}")
                time.sleep(gap_s)

    def post(self, kind: str, files: Any, data: dict[str, str] | None = None,
             path: str = "/transcribe", **kw: Any) -> httpx.Response:
        with self.rec.client(OTHER) as c:
            r = self.rec.count(OTHER, kind, c.post(path, files=files, data=data, **kw))
        self.rec.check(r.status_code not in (200, 202) or self.rec.track(OTHER, kind, r) is None,
                       f"{kind}: accepted ({r.status_code}) {r.text[:200]}")
        return r

    # ---- media that must never become a job -------------------------------------------------
    def playlist(self) -> None:
        other = self.rec.latest("A") or "x" * 24
        absolute = (self.spool_dir / other) if self.spool_dir and self.round % 2 else self.absolute
        names = set()
        for name, body in playlists(other, absolute).items():
            name = f"pl{self.n}-{name}"
            names.add(name)
            r = self.post("playlist", {"file": (name, body)})
            err = r.json().get("error", {}) if r.status_code < 500 else {}
            message = err.get("message", "/tmp")
            self.rec.check(r.status_code == 415 and err.get("type") == "unsupported_media"
                           and not any(p in message for p in ("/tmp", "/root", "/work", "spool")),
                           f"playlist {name}: {r.status_code} {r.text[:200]}")
        made = self.rec.named(OTHER, names)
        self.rec.check(not made, f"playlists made jobs: {[j['id'] for j in made]}")

    def absurd_wavs(self) -> None:
        for rate, channels in ((10_000_000, 1), (16000, 64), (0, 1)):
            r = self.post("absurd-wav", {"file": ("absurd.wav", wav_declaring(rate, channels))})
            self.rec.check(r.status_code in (415, 422),
                           f"wav {rate} Hz x {channels}: {r.status_code} {r.text[:200]}")

    def ssrf(self) -> None:
        for url in SSRF_URLS:
            r = self.post("ssrf", {"file": self.media.clip}, {"callback_url": url})
            err = r.json().get("error", {}) if r.status_code < 500 else {}
            self.rec.check(r.status_code == 400 and err.get("field") == "callback_url"
                           and "127." not in err.get("message", "")
                           and r.headers.get("x-should-retry") == "false",
                           f"ssrf {url}: {r.status_code} {r.text[:200]}")

    def oversize(self) -> None:
        """A declared length over the limit (a few bytes sent, the rest never): 413 unread.
        Then a chunked body of twice the limit: 413, cut off while it streams."""
        u = urlsplit(self.rec.url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
        try:
            conn.putrequest("POST", "/transcribe")
            conn.putheader("Authorization", f"Bearer {self.rec.keys[OTHER]}")
            conn.putheader("Content-Type", "multipart/form-data; boundary=b")
            conn.putheader("Content-Length", str(4 * self.max_upload))
            conn.endheaders(b"--b\r\n")
            resp = conn.getresponse()
            status, body = resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()
        self.rec.tally(OTHER, "oversize-declared", status, body)
        self.rec.check(status == 413 and str(self.max_upload) in body,
                       f"declared oversize: {status} {body[:200]}")

        def chunked() -> Iterator[bytes]:
            yield (b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n'
                   b"Content-Type: audio/wav\r\n\r\n")
            for _ in range(2 * self.max_upload // (1 << 20) + 1):
                yield b"\x01" * (1 << 20)
            yield b"\r\n--b--\r\n"

        with self.rec.client(OTHER) as c:
            r = self.rec.count(OTHER, "oversize-chunked", c.post(
                "/transcribe", content=chunked(),
                headers={"content-type": "multipart/form-data; boundary=b"}))
        self.rec.check(r.status_code == 413, f"chunked oversize: {r.status_code} {r.text[:200]}")

    def form_caps(self) -> None:
        tiny = ("t.wav", self.media.tiny)
        r = self.post("form-files", [("file", (f"p{i}.wav", self.media.tiny)) for i in range(20)])
        self.rec.check(r.status_code == 400 and "files" in r.text
                       and r.headers.get("x-should-retry") == "false",
                       f"20 file parts: {r.status_code} {r.text[:200]}")
        r = self.post("form-fields", {"file": tiny}, {f"f{i}": "x" for i in range(40)})
        self.rec.check(r.status_code == 400 and "fields" in r.text,
                       f"40 fields: {r.status_code} {r.text[:200]}")
        r = self.post("form-files-v1", [("file", tiny), ("file", tiny)], {"model": "whisper-1"},
                      path="/v1/audio/transcriptions")
        self.rec.check(r.status_code == 400 and
                       set(r.json().get("error", {})) == {"message", "type", "param", "code"},
                       f"/v1 two files: {r.status_code} {r.text[:200]}")

    # ---- jobs that must end right -------------------------------------------------------------
    def lying_mkv(self) -> None:
        """A header that says 5 s for 90 s of audio: admitted (and charged) at the file's timed
        length, issue 38's promise (tests/test_shared_slots.py). The soak expected the header's
        5 s at admission until issue 51 (43 false errors in a 20-minute run)."""
        real = self.media.mkv_real_s
        r = self.post_accepted("lying-mkv", {"file": (f"liar{self.n}.mka", self.media.mkv)},
                               Expect(min_audio_s=0.9 * real))
        if r.status_code == 202:
            self.rec.check(r.json()["audio_seconds"] >= 0.9 * real,
                           f"lying mkv admitted at {r.json()['audio_seconds']} s, under the "
                           f"{real:.0f} s its file holds (charged its header's?)")

    def post_accepted(self, kind: str, files: Any, expect: Expect,
                      data: dict[str, str] | None = None) -> httpx.Response:
        with self.rec.client(OTHER) as c:
            r = self.rec.count(OTHER, kind, c.post("/transcribe", files=files,
                                                   data={"language": "en", **(data or {})}))
        self.rec.track(OTHER, kind, r, expect)
        self.rec.check(r.status_code == 202, f"{kind}: {r.status_code} {r.text[:200]}")
        return r

    def idempotency(self) -> None:
        """The same POST twice with one Idempotency-Key (at once, or one after the other):
        one job, both answers name it."""
        key, name = uuid.uuid4().hex, f"idem{self.n}.flac"

        def once(_: int = 0) -> httpx.Response:
            with self.rec.client(OTHER) as c:
                return self.rec.count(OTHER, "idempotency", c.post(
                    "/transcribe", headers={"Idempotency-Key": key}, data={"language": "en"},
                    files={"file": (name, self.media.clip[1])}))

        if self.round % 2:
            with ThreadPoolExecutor(2) as ex:
                rs = list(ex.map(once, range(2)))
        else:
            rs = [once(), once()]
        ids = {self.rec.track(OTHER, "idempotency", r) for r in rs}
        self.rec.check([r.status_code for r in rs] == [202, 202] and len(ids) == 1,
                       f"idempotency: {[r.status_code for r in rs]}, ids {ids}")
        made = self.rec.named(OTHER, {name})
        self.rec.check(len(made) == 1, f"idempotency: {len(made)} jobs for one key")

    def sdk(self) -> None:
        """The real OpenAI client (its default two retries on): an undecodable upload gets one
        4xx that says not to retry, one request, at most one job; then a normal one."""
        seen: list[httpx.Request] = []
        answers: list[httpx.Response] = []
        liar = bool(self.round % 2)
        name = f"sdk{self.n}.flac" if liar else f"sdk{self.n}.wav"
        with httpx.Client(event_hooks={"request": [seen.append], "response": [answers.append]},
                          timeout=600) as http_client:
            # (cast: the SDK's annotation names its own httpx fork; it drives any httpx.Client)
            oa = openai.OpenAI(base_url=self.rec.url + "/v1", api_key=self.rec.keys[OTHER],
                               http_client=cast(Any, http_client))
            try:
                oa.audio.transcriptions.create(
                    model="whisper-1", file=(name, self.media.liar_flac if liar
                                             else self.media.header_only))
                self.rec.error(f"sdk: undecodable {name} was transcribed")
            except openai.APIStatusError as exc:
                r = self.rec.count(OTHER, "sdk-bad", cast(httpx.Response, exc.response))
                job_id = r.headers.get("x-batchscribe-job-id")
                self.rec.check(r.status_code == (413 if liar else 422)
                               and r.headers.get("x-should-retry") == "false"
                               and (job_id is not None) == liar,
                               f"sdk {name}: {r.status_code} job {job_id} {r.text[:200]}")
                if job_id:
                    self.rec.track_id(OTHER, "sdk-bad", job_id,
                                      Expect(frozenset({"failed"}), "payload_too_large"))
            self.rec.check(len(seen) == 1, f"sdk {name}: {len(seen)} requests")
            self.rec.check(len(self.rec.named(OTHER, {name})) == int(liar), f"sdk {name}: jobs")
            seen.clear()
            t0 = time.monotonic()
            out = oa.audio.transcriptions.create(model="whisper-1", file=self.media.clip,
                                                 language="en")
            self.rec.timed("sdk", time.monotonic() - t0)
            r = self.rec.count(OTHER, "sdk", answers[-1])
            self.rec.check(isinstance(out.text, str) and len(seen) == 1,
                           f"sdk normal: {len(seen)} requests")
            if job := r.headers.get("x-batchscribe-job-id"):
                self.rec.track_id(OTHER, "sdk", job)

    def events_cap(self) -> None:
        """``streams_per_key`` event streams on one running job, then one more: 429 naming the
        limit. The job is then cancelled and every stream must end."""
        r = self.post_accepted("events-job", {"file": ("long.wav", self.media.long_wav)},
                               CANCELLABLE)
        if r.status_code != 202:
            return
        job_id = r.json()["id"]
        events: list[list[str]] = [[] for _ in range(self.streams_per_key)]
        first = [threading.Event() for _ in events]

        def listen(i: int) -> None:
            with self.rec.client(OTHER, 120) as c, c.stream("GET", f"/jobs/{job_id}/events") as s:
                self.rec.tally(OTHER, "events", s.status_code)
                for line in (s.iter_lines() if s.status_code == 200 else ()):
                    if line.startswith("event: "):
                        events[i].append(line[7:])
                        first[i].set()
            first[i].set()

        readers = [threading.Thread(target=listen, args=(i,), daemon=True) for i in range(len(events))]
        for t in readers:
            t.start()
        for e in first:
            e.wait(30)
        with self.rec.client(OTHER, 60) as c:
            extra = self.rec.count(OTHER, "events-cap", c.get(f"/jobs/{job_id}/events"))
            status = c.get(f"/jobs/{job_id}").json()["status"]
            if extra.status_code == 429:
                self.rec.check(extra.json()["error"].get("limit") == "max_event_streams_per_key"
                               and bool(extra.headers.get("retry-after")),
                               f"events cap: {extra.text[:200]}")
            elif status in TERMINAL:
                self.rec.note("events-cap: the job ended before the extra stream")
            else:
                self.rec.error(f"events cap: stream {len(events) + 1} got {extra.status_code}")
            self.rec.cancelled_by_us(job_id)
            self.rec.count(OTHER, "cancel", c.delete(f"/jobs/{job_id}"))
        for t in readers:
            t.join(60)
        self.rec.check(not any(t.is_alive() for t in readers), "an event stream outlived its job")
        self.rec.check(all(e and e[-1] in TERMINAL for e in events), f"events: {events}")
