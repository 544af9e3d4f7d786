"""The page at /, in a real browser: Playwright driving Debian's chromium, headless.

A service with API keys: the page itself loads without one (like /docs), asks for a key, refuses
a wrong one, then uploads two corpus clips, follows their event streams, shows the transcripts
and the service's state, and downloads subtitles. ``playwright install`` is never run (it
downloads browsers; the network is closed): the browser is the distribution's, installed by
``scripts/test`` like postgresql. With ``CI`` set, a missing browser fails the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import srt

from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import COLD, Server
from tests.wer import wer

pytestmark = pytest.mark.model

CHROMIUM = Path(os.environ.get("BATCHSCRIBE_CHROMIUM", "/usr/bin/chromium"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "page-key-3c9e1f7a5b"
DONE_MS = 300_000  # a hang guard for two short clips on a busy machine, not a speed claim


def missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} (scripts/test installs it)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def pw() -> Iterator[Any]:
    """One Playwright per module: a second sync_playwright() while one is open fails ("Sync API
    inside the asyncio loop")."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed (the test extra)")
    if not (CHROMIUM.is_file() or shutil.which(str(CHROMIUM))):
        missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(pw: Any) -> Iterator[Any]:
    b = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
    yield b
    b.close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    srv = Server(tmp_path_factory.mktemp("web"),
                 env={**COLD, "BATCHSCRIBE_SECURITY__API_KEY_SHA256": digest}).start()
    yield srv
    srv.terminate()


def test_page_is_public_and_the_api_is_not(keyed: Server) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for asset in ("/web/app.js", "/web/style.css"):
            assert c.get(asset).status_code == 200
        assert c.get("/web/__init__.py").status_code == 401  # only the page's files are public
        assert c.get("/status").status_code == 401
        assert c.post("/asr", files={"audio_file": ("a", b"\0" * 64)}).status_code == 401
        status = c.get("/status", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert status["ready"] is True and status["workers"] >= 1


def test_upload_follow_read_and_download(browser: Any, keyed: Server, clips: list[Clip],
                                         tmp_path: Path) -> None:
    from playwright.sync_api import expect

    by_id = {c.id: c for c in clips}
    picked = [by_id["librivox-shakespeare-sonnet-1"], by_id["jfk-inaugural-1961"]]
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(keyed.url + "/")

    page.wait_for_selector("#key-form:not([hidden])")  # the service wants a key: the page asks
    page.fill("#key", "not-the-key")
    page.click("#key-save")
    # Playwright's own text matcher: a string given to wait_for_function is evaluated in the
    # page, which the page's Content-Security-Policy (script-src 'self') forbids once it polls.
    expect(page.locator("#key-error")).to_contain_text("not accepted")
    page.fill("#key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#st-ready.ok")
    assert page.is_hidden("#key-form") and page.is_visible("#drop")

    page.set_input_files("#files", [str(c.path) for c in picked])
    jobs = page.locator(".job")
    for k in range(len(picked)):
        jobs.nth(k).locator(".transcript .text").wait_for(timeout=DONE_MS)
    for k, clip in enumerate(picked):
        job = jobs.nth(k)
        assert job.get_attribute("data-state") == "done"
        assert job.locator(".name").inner_text() == clip.path.name
        # Progress came from the job's event stream, and the bar ended full.
        assert int(job.get_attribute("data-progress-events") or 0) >= 1
        bar = job.locator("progress")
        assert bar.evaluate("b => b.value === b.max")
        text = job.locator(".transcript .text").inner_text()
        assert wer([clip.reference], [text]) < 0.3, text

        with page.expect_download() as dl:
            job.locator(".downloads button[data-format=srt]").click()
        assert dl.value.suggested_filename == clip.path.stem + ".srt"
        cues = list(srt.parse(Path(dl.value.path()).read_text()))
        assert cues and all(c.end.total_seconds() <= clip.duration_s + 0.05 for c in cues)
        with page.expect_download() as dl:
            job.locator(".downloads button[data-format=json]").click()
        assert json.loads(Path(dl.value.path()).read_text())["text"] == text

    sonnet = jobs.nth(0)
    assert int(sonnet.get_attribute("data-progress-events") or 0) >= 2  # two windows: seen move
    # The state panel read /status with the key: the engine has run batches by now.
    expect(page.locator("#st-batch")).to_contain_text("windows")
    assert "ready" in page.inner_text("#st-ready")
    assert errors == []
    context.close()


def test_the_microphone_streams_live_and_its_words_appear(keyed: Server, clips: list[Clip],
                                                          pw: Any, tmp_path: Path) -> None:
    """The page's live button in Chromium, its microphone a corpus clip (Chromium's fake
    capture device plays a WAV file): a client secret, the WebSocket, the AudioWorklet at
    24 kHz, server VAD; the clip's words appear on the page as a final turn."""
    from playwright.sync_api import expect

    from app.audio import decode

    clip = min((c for c in clips if c.set in READ_SPEECH and c.duration_s >= 4.0),
               key=lambda c: c.duration_s)
    audio = np.concatenate([np.zeros(8_000, np.float32), decode(clip.path, 60.0),
                            np.zeros(40_000, np.float32)])  # trailing silence ends the turn
    wav = tmp_path / "mic.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    mic = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
           f"--use-file-for-fake-audio-capture={wav}%noloop",
           "--autoplay-policy=no-user-gesture-required"]
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS + mic)
    try:
        context = browser.new_context()
        context.grant_permissions(["microphone"], origin=keyed.url)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(keyed.url + "/")
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#key", KEY)
        page.click("#key-save")
        page.wait_for_selector("#st-ready.ok")
        page.click("#mic")
        expect(page.locator("#mic")).to_have_attribute("data-live", "on")
        final = page.locator(".live-turn.final .text").first
        final.wait_for(timeout=60_000)
        text = final.inner_text()
        page.click("#mic")  # stop: the session closes and is kept as a job
        assert wer([clip.reference], [text]) < 0.3, text
        assert page.inner_text("#live-error") == "" and errors == []
    finally:
        browser.close()


def test_the_speakers_option_shows_who_spoke(browser: Any, keyed: Server) -> None:
    """The page's speakers option (diarize=true) on the diarization corpus's two-speaker sample:
    the transcript reads as speaker turns, each labelled and each a change of speaker, and
    every segment in the list names its speaker before its words."""
    import itertools

    from playwright.sync_api import expect

    from tests.test_speakers import CORPUS, SAMPLE, corpus_item

    sample = CORPUS / corpus_item(SAMPLE)["file"]
    page = browser.new_context().new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(keyed.url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#st-ready.ok")
    page.check("#opt-speakers")
    page.set_input_files("#files", [str(sample)])
    job = page.locator(".job").first
    job.locator(".transcript .text").wait_for(timeout=DONE_MS)
    assert job.get_attribute("data-state") == "done"
    labels = job.locator(".transcript .text .turn .speaker").all_inner_texts()
    assert set(labels) == {"SPEAKER_00", "SPEAKER_01"}, labels
    assert all(a != b for a, b in itertools.pairwise(labels)), labels  # a turn per change
    expect(job.locator("details summary")).to_contain_text("2 speakers")
    lines = job.locator("details div")
    assert lines.count() >= len(labels)
    for k in range(lines.count()):  # text_content: the list is folded (<details>)
        line, who = lines.nth(k), lines.nth(k).locator(".speaker").text_content() or ""
        assert who in labels, who
        assert (line.text_content() or "").split(who, 1)[1].strip()  # words after the name
    assert errors == []
