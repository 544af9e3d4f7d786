"""OpenAI ``stream=true``: deltas in upload order as windows finish, then the whole text.

In process: the runner's per-window results (``finished_prefix``) on a fake engine, and the
event stream against a scripted door (gaps, another replica, failures, a client that hangs up)
whose job is followed through a real event hub (app/jobs/events.py). End to end with the
``openai`` client's stream iterator on the real model: the deltas add up to the final text and
to the non-streamed text, and the first delta comes while windows are still being decoded.
"""

from __future__ import annotations

import asyncio
import json
import wave
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import APIError, OpenAI

from app import audio
from app.api.openai import stream as openai_stream
from app.jobs import events as events_mod
from app.jobs.events import EventHub, Subscription
from app.jobs.work import Active
from app.windows import SAMPLE_RATE, JobOptions, WindowResult
from loadtest.lib.corpus import Clip
from tests import test_jobs
from tests.conftest import Server
from tests.helpers import wait_until
from tests.test_jobs import Rig

rig_factory = test_jobs.rig_factory  # the job-runner rig fixture, shared

# ---- the runner's side -------------------------------------------------------------------------


def wr(text: str) -> WindowResult:
    return WindowResult(text, "en", None, -0.1, 0.0, 1.0)


async def test_finished_prefix_stops_at_the_first_unfinished_window(
        rig_factory: Callable[..., Awaitable[Rig]]) -> None:
    rig = await rig_factory(start=False)
    runner = rig.runner
    assert runner.finished_prefix("nope", 0) is None  # not active here
    a = Active(asyncio.get_running_loop().create_future())  # type: ignore[arg-type]
    runner.active["j"] = a
    a.results.update({0: wr(" a"), 2: wr(" c")})
    assert runner.finished_prefix("j", 0) == [" a"]
    assert runner.finished_prefix("j", 1) == []  # window 1 is not back: c must wait
    a.results[1] = wr(" b")
    assert runner.finished_prefix("j", 1) == [" b", " c"]
    assert runner.finished_prefix("j", 3) == []


async def test_every_window_is_readable_when_its_change_fires(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:
    """A job without a language: its first window is decoded alone, the rest after it; each
    window's result is in place, at its index, by the time the watchers are told."""
    rig = await rig_factory()
    clip = max(clips, key=lambda c: c.duration_s)  # ~60 s: a few windows
    seen: list[list[str] | None] = []
    changed = rig.runner.changed

    def spy(job_id: str) -> None:
        seen.append(rig.runner.finished_prefix(job_id, 0))
        changed(job_id)

    rig.runner.tools = replace(rig.runner.tools, changed=spy)  # what a job's work reports to
    upload = rig.tmp / "j1"
    upload.write_bytes(clip.path.read_bytes())
    await rig.runner.submit("j1", upload, clip.path.name, JobOptions(), clip.duration_s, None)
    assert await asyncio.wait_for(_ended(rig, "j1"), 60) == "done"
    row = await rig.store.get("j1")
    assert row is not None and row.windows_total is not None and row.windows_total >= 2
    full = [s for s in seen if s is not None and len(s) == row.windows_total]
    assert full, seen
    assert " ".join(t.strip() for t in full[0]) == row.result["text"]  # type: ignore[index]
    counts = [len(s) for s in seen if s is not None]
    assert counts == sorted(counts) and 1 in counts  # grew window by window, never shrank


async def _ended(rig: Rig, job_id: str) -> str:
    with rig.runner.events.follow(job_id) as sub:
        await sub.until_over(60)
    return await rig.status(job_id)


# ---- the stream against a scripted door --------------------------------------------------------


@dataclass
class Row:
    status: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    id: str = "j"
    windows_done: int = 0
    windows_total: int | None = None
    audio_seconds: float = 0.0

    @property
    def ended(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


@dataclass
class FakeDoor:
    """What the stream uses of the door, scripted: the job's row, the window texts finished
    so far (None: the job is not active here), and whether the service is draining. The job
    is followed through a real event hub reading the row."""

    row: Row
    prefix: list[str] | None = None
    stopped: bool = False
    cancelled: list[str] = field(default_factory=list)
    hub: EventHub = field(init=False)

    def __post_init__(self) -> None:
        async def read(job_id: str) -> Any:
            return self.row

        self.hub = EventHub(10, read)
        if self.stopped:
            self.hub.stop()

    def finished_texts(self, job_id: str, start: int) -> list[str] | None:
        return None if self.prefix is None else self.prefix[start:]

    def follow(self, job_id: str, owner: str | None) -> Subscription:
        return self.hub.follow(job_id, owner)

    def changed(self) -> None:
        """What the runner says when a window finishes (its count goes up)."""
        self.row.windows_done += 1
        self.hub.changed("j")

    async def get(self, job_id: str, owner: str | None) -> Row:
        return self.row

    async def cancel(self, job_id: str, owner: str | None) -> Row:
        if not self.row.ended:
            self.cancelled.append(self.row.status)
            self.row.status = "cancelled"
        return self.row


def parse(chunk: bytes) -> dict[str, Any] | None:
    text = chunk.decode()
    if text.startswith(":"):
        return None  # a keep-alive comment
    assert text.startswith("data: ") and text.endswith("\n\n"), text
    return json.loads(text[6:])  # type: ignore[no-any-return]


async def test_deltas_follow_upload_order_and_add_up_to_the_text() -> None:
    row = Row("running")
    runner = FakeDoor(row, prefix=[])
    gen = openai_stream.transcript_events(runner, "j", None)  # type: ignore[arg-type]
    got: list[dict[str, Any] | None] = []
    nxt = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.05)
    assert not nxt.done()  # nothing finished yet: nothing sent (keep-alives aside)
    runner.prefix = [" One.", "", "  Two "]  # an empty window adds no delta and no space
    runner.changed()
    got.append(parse(await nxt))
    got.append(parse(await gen.__anext__()))
    row.status, row.result = "done", {"text": "One. Two Three."}
    runner.prefix += [" Three."]
    runner.changed()
    got += [parse(c) async for c in gen]
    assert got == [
        {"type": "transcript.text.delta", "delta": "One.", "logprobs": None},
        {"type": "transcript.text.delta", "delta": " Two", "logprobs": None},
        {"type": "transcript.text.delta", "delta": " Three.", "logprobs": None},
        {"type": "transcript.text.done", "text": "One. Two Three.", "logprobs": None},
    ]
    assert runner.cancelled == []


async def test_a_job_on_another_replica_streams_keepalives_then_its_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_stream, "KEEPALIVE_S", 0.01)
    monkeypatch.setattr(events_mod, "RECHECK_S", 0.001)  # the store re-read: finds it done
    row = Row("running")
    gen = openai_stream.transcript_events(FakeDoor(row), "j", None)  # type: ignore[arg-type]
    assert [parse(await gen.__anext__()) for _ in range(2)] == [None, None]  # keep-alives
    row.status, row.result = "done", {"text": "All of it."}
    assert [parse(c) async for c in gen] == [
        {"type": "transcript.text.delta", "delta": "All of it.", "logprobs": None},
        {"type": "transcript.text.done", "text": "All of it.", "logprobs": None},
    ]


async def test_a_failed_job_ends_with_an_openai_error_event() -> None:
    row = Row("failed", error={"type": "transcription_failed", "message": "engine broke"})
    events = [parse(c) async for c in openai_stream.transcript_events(
        FakeDoor(row), "j", None)]  # type: ignore[arg-type]
    assert events == [{"error": {"message": "engine broke", "type": "server_error", "param": None,
                                 "code": "transcription_failed"}}]


async def test_a_client_that_hangs_up_cancels_the_job() -> None:
    row = Row("running")
    runner = FakeDoor(row, prefix=[" Hello."])
    gen = openai_stream.transcript_events(runner, "j", None)  # type: ignore[arg-type]
    assert isinstance(gen, AsyncGenerator)  # an async generator: what Starlette closes
    assert parse(await gen.__anext__()) is not None
    await gen.aclose()  # what Starlette does when the client disconnects
    await asyncio.sleep(0.05)  # the cancellation runs as its own task
    assert runner.cancelled == ["running"] and row.status == "cancelled"


async def test_draining_ends_the_stream_with_a_retryable_error() -> None:
    runner = FakeDoor(Row("running"), prefix=[], stopped=True)
    events = [parse(c) async for c in openai_stream.transcript_events(
        runner, "j", None)]  # type: ignore[arg-type]
    assert events[-1]["error"]["code"] == "shutting_down"  # type: ignore[index]
    await asyncio.sleep(0.05)
    assert runner.cancelled == ["running"]  # it will run nowhere else: the client retries


# ---- end to end, real model --------------------------------------------------------------------


def stream(oa: OpenAI, path: Path, on_first: Callable[[str], Any] | None = None,
           **kw: Any) -> tuple[list[str], str, Any]:
    """(deltas, the done event's text, what ``on_first(job_id)`` returned at the first delta)."""
    deltas: list[str] = []
    done: str | None = None
    first = None
    with path.open("rb") as f:
        events = oa.audio.transcriptions.create(model="whisper-1", file=f, stream=True, **kw)
    job_id = events.response.headers["x-batchscribe-job-id"]
    for ev in events:
        if ev.type == "transcript.text.delta":
            if not deltas and on_first:
                first = on_first(job_id)
            deltas.append(ev.delta)
        elif ev.type == "transcript.text.done":
            done = ev.text
    assert done is not None, "no transcript.text.done event"
    return deltas, done, first


@pytest.fixture(scope="module")
def long_wav(clips: list[Clip], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~5 minutes of read speech (every read-speech clip, with short pauses): many windows, so
    several batches one after another however the batcher groups them."""
    gap = np.zeros(SAMPLE_RATE // 2, np.float32)
    picked = sorted((c for c in clips if c.set in ("librispeech", "ljspeech", "librivox",
                                                   "librivox_long")), key=lambda c: c.id)
    samples = np.concatenate([x for c in picked for x in (audio.decode(c.path, 600), gap)])
    path = tmp_path_factory.mktemp("long") / "long.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


@pytest.mark.model
def test_stream_adds_up_to_the_final_and_the_plain_text(oa: OpenAI, clips: list[Clip]) -> None:
    by_id = {c.id: c for c in clips}
    picked = [by_id[i] for i in ("librivox-shakespeare-sonnet-1", "jfk-inaugural-1961",
                                 "librispeech-2412-153948-0000")]
    assert picked[0].duration_s >= 50
    with ThreadPoolExecutor(len(picked)) as ex:
        streamed = list(ex.map(lambda c: stream(oa, c.path), picked))
        plain = list(ex.map(lambda c: _plain(oa, c.path), picked))
    for clip, (deltas, done, _), text in zip(picked, streamed, plain, strict=True):
        assert deltas and "".join(deltas) == done == text, clip.id
    assert len(streamed[0][0]) >= 2  # the long clip: one delta per window
    as_text = stream(oa, picked[1].path, response_format="text")
    assert as_text[1] == plain[1]


def _plain(oa: OpenAI, path: Path) -> str:
    with path.open("rb") as f:
        return oa.audio.transcriptions.create(model="whisper-1", file=f).text


@pytest.mark.model
def test_first_delta_comes_while_windows_are_still_decoding(
        oa: OpenAI, server: Server, long_wav: Path) -> None:
    with server.client() as client:
        def progress(job_id: str) -> dict[str, Any]:
            return client.get(f"/jobs/{job_id}").json()["progress"]  # type: ignore[no-any-return]

        deltas, done, first = stream(oa, long_wav, on_first=progress)
        assert first["windows_total"] >= 8, first
        assert first["windows_done"] < first["windows_total"], first
        # The deltas add up to the final text. That the streamed text is the plain one is shown
        # above on a multi-window clip; the done event is the job's stored text, which the plain
        # answer is too (app/api/openai), so transcribing these 5.5 minutes a second time here
        # (~20 CPU-s) showed nothing more.
        assert "".join(deltas) == done


@pytest.mark.model
def test_streamed_errors_and_hangups(oa: OpenAI, server: Server, long_wav: Path) -> None:
    with pytest.raises(APIError) as bad, long_wav.open("rb") as f:
        oa.audio.transcriptions.create(model="whisper-1", file=f, stream=True,
                                       response_format="srt")
    assert "stream=true needs response_format json or text" in str(bad.value)
    # A client that leaves after the first delta: its job is cancelled, not left running.
    with httpx.Client(base_url=server.url, timeout=300) as client, long_wav.open("rb") as f:
        with client.stream("POST", "/v1/audio/transcriptions", files={"file": ("long.wav", f)},
                           data={"model": "whisper-1", "stream": "true"}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            job_id = r.headers["x-batchscribe-job-id"]
            next(line for line in r.iter_lines() if line.startswith("data: "))
        assert wait_until(lambda: client.get(f"/jobs/{job_id}").json()["status"] == "cancelled", 60)
