"""Bad-input corpus, generated here: every file gets a correct result or a clear JSON 4xx.

Zero 5xx, and /healthz answers throughout (a watcher thread polls it for the whole module).
The service runs with small limits (4 MiB upload, 1 h audio) so the limit cases stay cheap.
Files are made with numpy + ``wave`` and PyAV (mp3/flac/…); no ffmpeg binary is needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jiwer
import numpy as np
import pytest
from openai import APIStatusError

from loadtest.lib.common import proc_status_kb
from loadtest.lib.corpus import Clip
from loadtest.lib.hostile_inputs import encode, encode_chunks, load, wav
from tests.conftest import COLD, Server, corpus_clips
from tests.helpers import openai_client

pytestmark = pytest.mark.model

MAX_UPLOAD = 4 * 1024 * 1024
MAX_AUDIO_S = 3600.0


# ---- generators (load, wav, encode: loadtest/lib/hostile_inputs.py) ----------------------------
def two_hour_flac() -> bytes:
    """2 h of digital silence: FLAC squeezes it to ~1.3 MB, so only the duration limit applies."""
    rate = 8000
    minute = np.zeros((1, rate * 60), dtype=np.int16)
    return encode_chunks((minute for _ in range(120)), rate, "flac", "flac")


def huge_header_wav(speech: np.ndarray) -> bytes:
    """A real 16 kHz wav whose RIFF and data sizes claim 4 GiB (what streaming writers emit)."""
    data = bytearray(wav(speech, 16000))
    data[4:8] = (0xFFFFFFFF).to_bytes(4, "little")
    assert data[36:40] == b"data"
    data[40:44] = (0xFFFFFFFF).to_bytes(4, "little")
    return bytes(data)


# ---- the corpus ------------------------------------------------------------------------------
# expect: "done" (a result, checked by `check`), or the 4xx status code.
Check = Callable[[dict], None]


def speech_like(ref: str, max_wer: float) -> Check:
    def check(result: dict) -> None:
        hyp = result["text"].lower().replace(",", "").replace(".", "")
        assert jiwer.wer(ref.lower(), hyp) <= max_wer, result["text"]
    return check


def empty_text(result: dict) -> None:
    assert result["text"] == "" and result["segments"] == []


def anything(result: dict) -> None:
    assert isinstance(result["text"], str)


def build_cases(clip: Clip) -> dict[str, tuple[str, bytes, int | str, Check]]:
    s16 = load(clip.path, 16000)[:, 0]
    ref = clip.reference
    rng = np.random.default_rng(7)
    mp3 = encode(s16, 16000, "mp3", "libmp3lame")
    flac = encode(s16, 16000, "flac", "flac")
    good = wav(s16, 16000)
    return {
        "empty": ("empty.wav", b"", 422, anything),
        "zero_length_audio": ("zero.wav", wav(np.zeros(0, np.float32), 16000), 422, anything),
        "one_sample": ("one.wav", wav(np.full(1, 0.1, np.float32), 16000), "done", empty_text),
        "silence": ("silence.wav", wav(np.zeros(16000 * 10, np.float32), 16000), "done", empty_text),
        "white_noise": ("noise.wav", wav(rng.uniform(-0.5, 0.5, 16000 * 10).astype(np.float32),
                                         16000), "done", anything),
        "truncated_wav": ("cut.wav", good[: len(good) // 2], "done", anything),
        "truncated_mp3": ("cut.mp3", mp3[: len(mp3) // 2], "done", anything),
        "truncated_flac": ("cut.flac", flac[: len(flac) // 2], "done", anything),
        "text_renamed_wav": ("notes.wav", b"this is a text file, not audio\n" * 40, 415, anything),
        "random_bytes": ("blob.mp3", rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes(), 415,
                         anything),
        "header_only_wav": ("header.wav", good[:44], 422, anything),
        "huge_size_header": ("huge.wav", huge_header_wav(s16), "done", speech_like(ref, 0.35)),
        "rate_8k": ("8k.wav", wav(load(clip.path, 8000)[:, 0], 8000), "done", speech_like(ref, 0.5)),
        "rate_48k": ("48k.wav", wav(load(clip.path, 48000)[:, 0], 48000), "done",
                     speech_like(ref, 0.35)),
        "stereo": ("stereo.wav", wav(load(clip.path, 16000, 2), 16000), "done",
                   speech_like(ref, 0.35)),
        "pcm_24bit": ("24bit.wav", wav(s16, 16000, width=3), "done", speech_like(ref, 0.35)),
        "mp3": ("speech.mp3", mp3, "done", speech_like(ref, 0.35)),
        "just_over_size_limit": ("big.wav", wav(np.zeros(MAX_UPLOAD // 2, np.float32), 16000)
                                 [: MAX_UPLOAD + 1], 413, anything),
        "two_hours": ("long.flac", two_hour_flac(), 413, anything),
        "path_traversal": ("../../../../tmp/batchscribe-pwned.wav", good, "done", anything),
        "windows_traversal": ("..\\..\\Windows\\win.ini", good, "done", anything),
        "absolute_path": ("/etc/passwd", good, "done", anything),
        "unicode_name": ("日本語 音声 🎤 Ωmega.wav", good, "done", anything),
        "control_chars_name": ("a\tb\x01c.wav", good, "done", anything),
    }


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("bad-input"), env={**COLD,
        "BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "BATCHSCRIBE_LIMITS__MAX_AUDIO_S": str(MAX_AUDIO_S),
    }).start()
    yield srv
    srv.terminate()


class HealthWatch(threading.Thread):
    """Polls /healthz every 0.2 s; records every failure (status or time-out)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.wait(0.2):
                try:
                    r = c.get("/healthz")
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:100]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))


@pytest.fixture(scope="module")
def watch(limited: Server) -> Iterator[HealthWatch]:
    w = HealthWatch(limited.url)
    w.start()
    yield w
    w.stop.set()
    w.join(10)


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple[str, bytes, int | str, Check]]:
    clip = next(c for c in corpus_clips() if c.set == "librispeech" and 5 < c.duration_s < 15)
    return build_cases(clip)


CASE_NAMES = [
    "empty", "zero_length_audio", "one_sample", "silence", "white_noise", "truncated_wav",
    "truncated_mp3", "truncated_flac", "text_renamed_wav", "random_bytes", "header_only_wav",
    "huge_size_header", "rate_8k", "rate_48k", "stereo", "pcm_24bit", "mp3",
    "just_over_size_limit", "two_hours", "path_traversal", "windows_traversal", "absolute_path",
    "unicode_name", "control_chars_name",
]


def assert_clear_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] and len(err["message"]) > 10, err
    return err


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input(name: str, limited: Server, watch: HealthWatch,
                   cases: dict[str, tuple[str, bytes, int | str, Check]]) -> None:
    filename, data, expect, check = cases[name]
    with limited.client(timeout=120) as c:
        r = c.post("/transcribe", params={"wait": "true"}, data={"language": "en"},
                   files={"file": (filename, data, "application/octet-stream")})
    assert r.status_code < 500, r.text
    if expect != "done":
        err = assert_clear_error(r, int(expect))
        if expect == 413:
            assert "limit_bytes" in err or "limit_s" in err, err  # the body names the limit
        if name == "two_hours":
            # Rejected from the container header (the decoder reports no duration_s).
            assert err["duration_s"] == pytest.approx(7200.0) and err["limit_s"] == MAX_AUDIO_S
        return
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "done", job
    if filename.isprintable():  # (clients percent-encode control characters)
        assert job["filename"] == filename[:255]  # kept as a display name, nothing more
    check(job["result"])


def test_missing_file_is_422(limited: Server) -> None:
    with limited.client() as c:
        err = assert_clear_error(c.post("/transcribe", data={"language": "en"}), 422)
        assert "file" in err["message"]
        # A plain form field named "file" is not an upload either.
        assert_clear_error(c.post("/transcribe", data={"file": "not a file"}), 422)
        assert_clear_error(c.post("/transcribe", content=b"raw bytes",
                                  headers={"content-type": "audio/wav"}), 422)


def test_streamed_oversize_body_is_cut_off(limited: Server) -> None:
    """A chunked body (no Content-Length) far over the limit: 413, and the server stops reading."""
    rss_before = rss_bytes(limited)
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        yield (b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n'
               b"Content-Type: audio/wav\r\n\r\n")
        for _ in range(64):  # 64 MiB: 16x the limit
            sent += 1 << 20
            yield b"\x01" * (1 << 20)
        yield b"\r\n--b--\r\n"

    with limited.client() as c:
        r = c.post("/transcribe", content=body(),
                   headers={"content-type": "multipart/form-data; boundary=b"})
    err = assert_clear_error(r, 413)
    assert err["limit_bytes"] == MAX_UPLOAD
    # The body was neither buffered nor kept: RSS grew by far less than what the client sent.
    assert rss_bytes(limited) - rss_before < 32 * 1024 * 1024


def test_declared_oversize_body_is_refused_unread(limited: Server) -> None:
    with limited.client() as c:
        r = c.post("/transcribe", files={"file": ("big.wav", b"\0" * (MAX_UPLOAD * 2))})
    err = assert_clear_error(r, 413)
    assert err["limit_bytes"] == MAX_UPLOAD and str(MAX_UPLOAD) in err["message"]


def test_v1_oversize_body_is_an_openai_error(limited: Server) -> None:
    """The body limit answers from middleware, before any route: /v1 still gets OpenAI's shape."""
    oa = openai_client(limited.url)
    with pytest.raises(APIStatusError) as info:
        oa.audio.transcriptions.create(model="whisper-1",
                                       file=("big.wav", b"\0" * (MAX_UPLOAD * 2)))
    assert info.value.status_code == 413
    body = info.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and str(MAX_UPLOAD) in body["message"]


def test_file_names_are_never_paths(limited: Server) -> None:
    """Only random job ids live in the spool; nothing was written where the names point."""
    assert not Path("/tmp/batchscribe-pwned.wav").exists()
    spool = limited.data_dir / "uploads"
    for f in spool.iterdir():
        assert len(f.name) == 24 and f.name.replace("-", "").replace("_", "").isalnum(), f.name


def test_spool_is_empty_when_jobs_end(limited: Server) -> None:
    spool = limited.data_dir / "uploads"
    deadline = time.monotonic() + 60  # bounded: only guards against a hang
    while any(spool.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list(spool.iterdir())


def test_health_answered_throughout(watch: HealthWatch) -> None:
    assert watch.ok > 0
    assert watch.failures == []


def rss_bytes(srv: Server) -> int:
    assert srv.proc is not None
    kb = proc_status_kb(srv.proc.pid, "VmRSS")
    assert kb is not None, "no VmRSS"
    return kb * 1024
