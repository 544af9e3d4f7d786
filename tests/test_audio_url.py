"""``audio_url`` on ``POST /transcribe`` (issue 21): the service fetches the audio itself, through
the outbound guard. A file server on 127.0.0.2 (allowed by ``outbound.allowed_hosts``) serves a
corpus clip, an endless stream and a 2 h FLAC; the service fetches the clip from a form field or
a JSON body, refuses private addresses (nothing connects), and stops a download while it streams
once it passes the size limit or its header passes the duration limit. ``s3://`` URLs are in
tests/test_blobs.py (against moto's S3 server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from loadtest.lib.corpus import Clip
from tests.conftest import COLD, Server
from tests.helpers import sha
from tests.test_hostile import post_as
from tests.test_security import KEY_A
from tests.wer import wer

pytestmark = pytest.mark.model

MAX_UPLOAD = 8 * 1024 * 1024
MAX_AUDIO_S = 600.0
FILE_HOST = "127.0.0.2"  # allowed by the service's outbound.allowed_hosts; 127.0.0.1 is not


class Files:
    """Serves ``files`` by path. ``streams`` are sent without a length at ~13 MB/s (unthrottled,
    loopback's socket buffers, up to 32 MB here, would hide where the reader stopped), and
    ``/endless`` is zeros forever. Counts the bytes each stream got out before the service
    hung up."""

    def __init__(self, host: str, files: dict[str, bytes],
                 streams: dict[str, bytes] | None = None) -> None:
        self.host = host
        self.files = files
        self.streams = {"/endless": b"", **(streams or {})}
        self.sent: dict[str, int] = {}
        self.cut: set[str] = set()  # streams the other side closed
        self.hits: list[str] = []
        rx = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                rx.hits.append(self.path)
                path = self.path.split("?")[0]
                try:
                    if path in rx.streams:
                        self.send_response(200)
                        self.send_header("Connection", "close")
                        self.end_headers()
                        try:
                            self._stream(path, rx.streams[path])
                        except OSError:
                            rx.cut.add(path)
                    elif path in rx.files:
                        body = rx.files[path]
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        rx.sent[path] = len(body)
                    else:
                        self.send_response(404)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                except OSError:
                    pass

            def _stream(self, path: str, body: bytes) -> None:
                rx.sent[path] = 0
                while rx.sent[path] < (len(body) or 1 << 32):
                    block = body[rx.sent[path]:rx.sent[path] + 65536] or b"\0" * 65536
                    self.wfile.write(block)
                    rx.sent[path] += len(block)
                    time.sleep(0.005)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.server.server_port}{path}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(ok: Any, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout  # a hang guard, not a threshold
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def short_clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.set == "ljspeech" and c.duration_s > 3),
               key=lambda c: c.duration_s)


@pytest.fixture(scope="module")
def fetching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("fetching"), env={**COLD,
        "BATCHSCRIBE_SECURITY__API_KEY_SHA256": sha(KEY_A),
        "BATCHSCRIBE_OUTBOUND__ALLOWED_HOSTS": f'["{FILE_HOST}"]',
        "BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "BATCHSCRIBE_LIMITS__MAX_AUDIO_S": str(MAX_AUDIO_S),
    }).start()
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def files(short_clip: Clip) -> Iterator[Files]:
    from tests.test_bad_input import two_hour_flac

    long_flac = two_hour_flac()  # 2 h of silence: ~1.3 MB, its header says 7200 s
    assert len(long_flac) > 1 << 20
    fs = Files(FILE_HOST, {"/clip.flac": short_clip.path.read_bytes()}, {"/long.flac": long_flac})
    yield fs
    fs.stop()


# ---- audio_url ----------------------------------------------------------------------------------
def test_audio_url_form_and_json(fetching: Server, files: Files, short_clip: Clip) -> None:
    url = files.url("/clip.flac").replace("http://", "http://user:secret@") + "?token=abc&v=2"
    for kind in ("form", "json"):
        body = {"audio_url": url, "language": "en"}
        r = (post_as(fetching, KEY_A, wait=True, data=body) if kind == "form"
             else post_as(fetching, KEY_A, wait=True, json=body))
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["status"] == "done" and job["filename"] == "clip.flac", job
        assert wer([short_clip.reference], [job["result"]["text"]]) < 0.3, job["result"]["text"]
        # Recorded without its credentials.
        assert job["options"]["audio_url"] == files.url("/clip.flac") + "?token=REDACTED&v=2"
    r = post_as(fetching, KEY_A, json={"audio_url": url, "beam_size": "3"})  # JSON types are strict
    assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "body.beam_size"
    r = post_as(fetching, KEY_A, json={"audio_url": url, "file": "x"})
    assert r.status_code == 422, r.text
    r = post_as(fetching, KEY_A, data={"audio_url": url},
             files={"file": (short_clip.path.name, short_clip.path.read_bytes())})
    assert r.status_code == 422 and "one of the two" in r.json()["error"]["message"]


def test_audio_url_on_a_private_address_is_refused(fetching: Server, short_clip: Clip) -> None:
    private = Files("127.0.0.1", {"/clip.flac": short_clip.path.read_bytes()})
    try:
        for url in (private.url("/clip.flac"),
                    private.url("/clip.flac").replace("127.0.0.1", "localhost"),
                    "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd",
                    "s3://some-bucket/clip.flac"):
            r = post_as(fetching, KEY_A, json={"audio_url": url})
            assert r.status_code == 400, (url, r.text)
            assert r.json()["error"]["field"] == "audio_url"
        assert private.hits == []  # refused before any connection
    finally:
        private.stop()


def test_audio_url_limits_apply_while_it_streams(fetching: Server, files: Files) -> None:
    """The job is answered at once (the download is part of it) and fails with the error an
    upload would have got."""
    r = post_as(fetching, KEY_A, json={"audio_url": files.url("/endless")}, wait=True, timeout=60)
    assert r.json()["status"] == "failed", r.text
    assert r.json()["error"]["type"] == "payload_too_large"
    assert r.json()["error"]["limit_bytes"] == MAX_UPLOAD
    # Cut off at the limit: the endless stream ended, a little after the limit.
    assert wait_for(lambda: "/endless" in files.cut), files.sent
    assert files.sent["/endless"] < MAX_UPLOAD + (2 << 20), files.sent
    r = post_as(fetching, KEY_A, json={"audio_url": files.url("/long.flac")}, wait=True, timeout=60)
    assert r.json()["status"] == "failed", r.text
    err = r.json()["error"]
    assert err["limit_s"] == MAX_AUDIO_S and err["duration_s"] == pytest.approx(7200.0)
    # The header said 2 h: stopped once the first MiB was probed, before the file's end.
    assert wait_for(lambda: "/long.flac" in files.cut), files.sent
    assert files.sent["/long.flac"] < len(files.streams["/long.flac"]), files.sent


