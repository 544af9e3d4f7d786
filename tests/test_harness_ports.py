"""Issue 51, item 3, the cause of "41 jobs for 16 manifest rows": a test's server taken for
another's.

The service binds its port only once its model is loaded (uvicorn runs the lifespan first), and
``Server`` picked a free port before starting it: in that window another pytest worker's
server could pick and bind the same port, and the readiness poll, which asked only whether the
port answered ``/readyz``, took the other process for this one. Whatever the test then sent
"its" server went to the other test's server and store. Reproduced here on purpose: a second
server started on a port the first one holds. Now it is picked again on a port of its own
(the default, ``port=0``), or, with a port given, fails loudly; its jobs stay its own.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from loadtest.lib.corpus import Clip
from tests.conftest import Server


def submit(srv: Server, clip: Clip) -> str:
    with clip.path.open("rb") as f:
        r = httpx.post(srv.url + "/transcribe", files={"file": (clip.path.name, f)},
                       data={"language": "en"}, timeout=60)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_a_server_is_never_taken_for_the_one_already_on_its_port(
        make_server: type[Server], tmp_path: Path, clips: list[Clip]) -> None:
    clip = min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)
    first = make_server(tmp_path / "first", module="tests.fake_replica").start()
    taken = make_server(tmp_path / "fixed", port=first.port, module="tests.fake_replica")
    # A port given: loud, not someone else's server. (PortTaken, as pytest loads conftest.py:
    # a module of its own, not tests.conftest.)
    with pytest.raises(RuntimeError, match="was taken by another process"):
        taken.start()
    second = make_server(tmp_path / "second", module="tests.fake_replica")
    second.port = first.port  # what free_port() handed out twice, as if by another worker
    second.start()
    assert second.port != first.port and second.proc is not None and second.proc.poll() is None
    job = submit(second, clip)
    assert httpx.get(f"{second.url}/jobs/{job}").status_code == 200  # its own store
    assert httpx.get(f"{first.url}/jobs/{job}").status_code == 404  # not the other's
