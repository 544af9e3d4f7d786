"""API keys and tenant isolation; without keys, open only on purpose and only to loopback Hosts.

Key A cannot read, cancel or list key B's jobs: every such request is a 404 that looks exactly
like the 404 for an id that never existed, so ids do not leak. Missing or invalid keys get a
JSON 401 with a ``WWW-Authenticate`` challenge; health and metrics are open unless configured
otherwise. Job ids are random (144 bits) and upload names are never used as paths.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AuthenticationError
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from app.api.middleware.keys import (
    ApiKeyMiddleware,
    KeyRing,
    LoopbackHostMiddleware,
    key_digest,
    open_paths,
    owner_of,
)
from app.config import SecuritySettings, Settings
from loadtest.lib.corpus import Clip
from tests.conftest import COLD, ROOT, Server, free_port
from tests.helpers import bearer, openai_client, sha, wait_until
from tests.test_asr import bazarr, pcm
from tests.wer import wer

KEY_A = "key-a-7f1c0e1d9b2a4c3e"
KEY_B = "key-b-0a9d8c7b6e5f4a3b"
JOB_ID = re.compile(r"^[A-Za-z0-9_-]{24}$")


# ---- settings and the key ring (no server) -----------------------------------------------------
def test_digests_from_env_comma_separated_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSCRIBE_SECURITY__API_KEY_SHA256", f" {sha(KEY_A)} ,{sha(KEY_B).upper()}")
    assert Settings().security.api_key_sha256 == [sha(KEY_A), sha(KEY_B)]
    monkeypatch.setenv("BATCHSCRIBE_SECURITY__API_KEY_SHA256", f'["{sha(KEY_A)}"]')
    assert Settings().security.api_key_sha256 == [sha(KEY_A)]
    monkeypatch.setenv("BATCHSCRIBE_SECURITY__API_KEY_SHA256", "")
    assert Settings().security.api_key_sha256 == []


def test_a_key_instead_of_its_digest_is_refused() -> None:
    with pytest.raises(ValidationError, match="64-character hex"):
        SecuritySettings(api_key_sha256=[KEY_A])


def test_key_ring() -> None:
    ring = KeyRing([sha(KEY_A), sha(KEY_B)])
    assert ring.owner(KEY_A) == owner_of(key_digest(KEY_A)) == sha(KEY_A)[:16]
    assert ring.owner(KEY_B) != ring.owner(KEY_A)
    assert ring.owner("nope") is None
    assert ring.owner(sha(KEY_A)) is None  # the digest is not a key


def test_closed_health_and_metrics_need_a_key() -> None:
    """With open_health/open_metrics off, probes need a key too (tested on a bare ASGI app)."""
    async def owner(request: Request) -> JSONResponse:
        return JSONResponse({"owner": getattr(request.state, "owner", None)})

    inner = Starlette(routes=[Route(p, owner) for p in ("/healthz", "/metrics", "/openapi.json")])
    settings = SecuritySettings(api_key_sha256=[sha(KEY_A)], open_health=False, open_metrics=False)
    app = ApiKeyMiddleware(inner, KeyRing(settings.api_key_sha256), open_paths(settings))
    with TestClient(app) as c:
        for path in ("/healthz", "/metrics"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers=bearer(KEY_A)).json() == {"owner": sha(KEY_A)[:16]}
        assert c.get("/openapi.json").status_code == 200  # the API description stays public


# ---- a real service with two keys --------------------------------------------------------------
ORPHAN_OLD, ORPHAN_YOUNG = "O" * 24, "Y" * 24  # uploads whose job row never got committed


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("keyed")
    # What a kill -9 between spooling and the commit leaves behind: files without a job row.
    (data / "uploads").mkdir()
    (data / "uploads" / ORPHAN_OLD).write_bytes(b"RIFF")
    (data / "uploads" / ORPHAN_YOUNG).write_bytes(b"RIFF")
    hour_ago = time.time() - 3600
    os.utime(data / "uploads" / ORPHAN_OLD, (hour_ago, hour_ago))
    srv = Server(data, env={
        **COLD, "BATCHSCRIBE_SECURITY__API_KEY_SHA256": f"{sha(KEY_A)},{sha(KEY_B)}",
    }).start()  # /readyz is open by default, so the fixture's readiness poll works
    yield srv
    srv.terminate()


@pytest.mark.model
def test_orphaned_uploads_are_swept(keyed: Server) -> None:
    """At start-up: an old upload no job references goes; a young one may be in flight, stays."""
    spool = keyed.data_dir / "uploads"
    assert wait_until(lambda: not (spool / ORPHAN_OLD).exists(), 30)
    assert (spool / ORPHAN_YOUNG).exists()


@pytest.fixture(scope="module")
def short_clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.set == "librispeech"), key=lambda c: c.duration_s)


def upload(srv: Server, key: str, clip: Clip, wait: bool = True) -> dict:
    with srv.client() as c, clip.path.open("rb") as f:
        r = c.post("/transcribe", params={"wait": str(wait).lower()}, data={"language": "en"},
                   files={"file": (clip.path.name, f)}, headers=bearer(key))
    assert r.status_code in (200, 202), r.text
    return r.json()


@pytest.mark.model
def test_missing_or_invalid_key_is_401(keyed: Server) -> None:
    with keyed.client() as c:
        for headers in ({}, {"Authorization": "Basic a2V5OmtleQ=="}, {"Authorization": "Bearer"}):
            r = c.get("/jobs", headers=headers)
            assert r.status_code == 401
            assert r.headers["www-authenticate"].startswith('Bearer realm="batchscribe"')
            assert r.json()["error"]["type"] == "unauthorized"
        r = c.get("/jobs", headers=bearer("wrong-key"))
        assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
        # Refused before the body is read: no upload is spooled for an unknown caller.
        r = c.post("/transcribe", files={"file": ("a.wav", b"\0" * 100_000)})
        assert r.status_code == 401
        assert r.headers["content-type"].startswith("application/json")


def test_v1_refusal_is_an_openai_error(keyed: Server) -> None:
    """The key check answers before any route runs; under /v1 it still speaks OpenAI's error
    shape, so the SDK users already have raises its AuthenticationError with our message."""
    oa = openai_client(keyed.url, api_key="wrong-key")
    with pytest.raises(AuthenticationError) as info:
        oa.models.list()
    assert info.value.status_code == 401
    assert info.value.body == {"message": "the API key is not valid", "param": None,
                               "type": "authentication_error", "code": "unauthorized"}


@pytest.mark.model
def test_health_metrics_and_docs_are_open(keyed: Server) -> None:
    with keyed.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 200
        assert c.get("/metrics").status_code == 200
        spec = c.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert "401" in spec["paths"]["/jobs"]["get"]["responses"]
    assert "security" not in spec["paths"]["/healthz"]["get"]


@pytest.mark.model
def test_key_isolation(keyed: Server, short_clip: Clip) -> None:
    job = upload(keyed, KEY_A, short_clip)
    assert job["status"] == "done"
    job_id = job["id"]
    ghost = "A" * 24  # an id that never existed: B's view of A's job must be indistinguishable
    with keyed.client() as c:
        spec = c.get("/openapi.json").json()
        assert c.get(f"/jobs/{job_id}", headers=bearer(KEY_A)).status_code == 200
        # Every per-job endpoint (including any added later), every method: 404 for B.
        per_job = [(p, m) for p, ops in spec["paths"].items() if "{job_id}" in p for m in ops]
        assert ("/jobs/{job_id}", "delete") in per_job
        for path, method in per_job:
            theirs = c.request(method, path.replace("{job_id}", job_id), headers=bearer(KEY_B))
            absent = c.request(method, path.replace("{job_id}", ghost), headers=bearer(KEY_B))
            assert theirs.status_code == absent.status_code == 404, (path, method, theirs.text)
            assert theirs.json()["error"]["type"] == absent.json()["error"]["type"]
        listed_b = c.get("/jobs", headers=bearer(KEY_B)).json()["jobs"]
        assert job_id not in {j["id"] for j in listed_b}
        listed_a = c.get("/jobs", headers=bearer(KEY_A)).json()["jobs"]
        assert job_id in {j["id"] for j in listed_a}
        # B's DELETE did nothing: A's job is still done, with its result.
        again = c.get(f"/jobs/{job_id}", headers=bearer(KEY_A)).json()
        assert again["status"] == "done" and again["result"]["text"]


@pytest.mark.model
def test_ids_are_random_and_spool_is_cleaned(keyed: Server, short_clip: Clip) -> None:
    jobs = [upload(keyed, KEY_B, short_clip, wait=False) for _ in range(4)]
    ids = [j["id"] for j in jobs]
    assert len(set(ids)) == len(ids) and all(JOB_ID.match(i) for i in ids)
    with keyed.client() as c:
        assert c.delete(f"/jobs/{ids[0]}", headers=bearer(KEY_B)).status_code == 200
        # The cancelled job's upload goes at once; the others' when they finish.
        spool = keyed.data_dir / "uploads"

        def settled() -> bool:
            states = [c.get(f"/jobs/{i}", headers=bearer(KEY_B)).json()["status"] for i in ids]
            return all(s in ("done", "cancelled") for s in states)

        assert wait_until(settled, 120)

    def left() -> list[str]:
        return [f.name for f in spool.iterdir() if f.name != ORPHAN_YOUNG]

    assert wait_until(lambda: not left(), 30), left()


# ---- open by accident -----------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_no_start_beyond_loopback_without_keys(tmp_path: Path, host: str) -> None:
    env = {**os.environ, "BATCHSCRIBE_HOST": host, "BATCHSCRIBE_PORT": str(free_port()),
           "BATCHSCRIBE_STORAGE__DATA_DIR": str(tmp_path)}
    env.pop("BATCHSCRIBE_SECURITY__API_KEY_SHA256", None)
    env.pop("BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS", None)
    p = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    [line] = p.stderr.strip().splitlines()  # one line, naming the settings to use
    assert "BATCHSCRIBE_SECURITY__API_KEY_SHA256" in line
    assert "BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=true" in line


@pytest.mark.model
def test_keyless_mode_serves_only_loopback_host_headers(server: Server) -> None:
    """A page that rebinds its own name to 127.0.0.1 still sends that name as Host."""
    port = server.port
    with server.client() as c:
        for host in ("attacker.example", f"attacker.example:{port}", "10.0.0.5", "[fe80::1]"):
            r = c.get("/jobs", headers={"Host": host})
            assert r.status_code == 421 and r.json()["error"]["type"] == "host_not_allowed", host
            assert r.headers["x-should-retry"] == "false"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert c.get("/jobs", headers={"Host": host}).status_code == 200, host
        assert c.get("/healthz", headers={"Host": "10.1.2.3:8000"}).status_code == 200  # probes


def test_keyless_a_key_in_the_path_is_cut_and_ignored() -> None:
    """Without keys, a Bazarr base URL kept from a keyed set-up (``/key/<key>``) still reaches its
    two routes, the key cut from the path as it is with keys; any other route under ``/key/`` is
    a JSON 404 that does not echo the key; the Host check still applies (bare ASGI app)."""
    async def path(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.scope["path"], "raw": request.scope["raw_path"].decode()})

    inner = Starlette(routes=[Route(p, path, methods=["GET", "POST"])
                              for p in ("/asr", "/detect-language", "/jobs", "/healthz")])
    app = LoopbackHostMiddleware(inner, [], open_paths(SecuritySettings()))
    secret = "kept-key-3c4d5e6f"
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        for route in ("/asr", "/detect-language"):
            r = c.post(f"/key/{secret}{route}?encode=false")
            assert r.status_code == 200 and r.json() == {"path": route, "raw": route}, r.text
        for route in ("/jobs", "/healthz", ""):
            r = c.get(f"/key/{secret}{route}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", r.text
            assert secret not in r.text and "/asr and /detect-language" in r.text
        r = c.post(f"/key/{secret}/asr", headers={"Host": "attacker.example"})
        assert r.status_code == 421 and secret not in r.text
        assert c.get("/jobs").json() == {"path": "/jobs", "raw": "/jobs"}  # the rest unchanged


@pytest.mark.model
def test_keyless_bazarr_with_a_key_in_its_base_url(server: Server, short_clip: Clip) -> None:
    """The real keyless service answers ``/key/<key>/asr`` as ``/asr``, and never logs the key."""
    secret = "kept-key-9a8b7c6d"
    with server.client() as c:
        r = bazarr(c, f"/key/{secret}/asr", pcm(short_clip.path), task="transcribe",
                   language="en", output="json")
        assert r.status_code == 200, r.text
        assert wer([short_clip.reference], [r.json()["text"]]) < 0.3, r.json()["text"]
        r = c.get(f"/key/{secret}/jobs")
        assert r.status_code == 404 and r.headers["x-should-retry"] == "false", r.text
    assert server.log_path is not None
    log = server.log_path.read_text(errors="replace")
    assert "POST /asr?" in log and secret not in log


@pytest.mark.model
def test_keys_make_the_host_header_irrelevant(keyed: Server) -> None:
    with keyed.client() as c:
        r = c.get("/jobs", headers={"Host": "transcribe.example.com", **bearer(KEY_A)})
    assert r.status_code == 200


@pytest.mark.model
def test_a_key_in_the_path_for_clients_that_send_no_header(keyed: Server, short_clip: Clip) -> None:
    """Bazarr takes a base URL and sends no header: ``http://host:8000/key/<key>`` serves its two
    routes as that key's tenant, and nothing else; the key is cut from the path before uvicorn's
    access log or an error body sees it."""
    body = pcm(short_clip.path)
    wrong = "not-a-key-5e6f7a8b"
    with keyed.client() as c:
        before_a = {j["id"] for j in c.get("/jobs", headers=bearer(KEY_A)).json()["jobs"]}
        r = bazarr(c, f"/key/{KEY_A}/asr", body, task="transcribe", language="en", output="json")
        assert r.status_code == 200, r.text
        assert wer([short_clip.reference], [r.json()["text"]]) < 0.3, r.json()["text"]
        d = bazarr(c, f"/key/{KEY_A}/detect-language", body)
        assert d.status_code == 200 and d.json()["language_code"] == "en", d.text
        new_a = {j["id"] for j in c.get("/jobs", headers=bearer(KEY_A)).json()["jobs"]} - before_a
        assert len(new_a) == 2  # both calls ran as A's jobs ...
        listed_b = {j["id"] for j in c.get("/jobs", headers=bearer(KEY_B)).json()["jobs"]}
        assert not new_a & listed_b  # ... and B sees neither
        bad = bazarr(c, f"/key/{wrong}/asr", body)
        assert bad.status_code == 401 and 'error="invalid_token"' in bad.headers["www-authenticate"]
        assert bad.json()["error"]["type"] == "unauthorized"
        # Only whisper-asr-webservice's routes take a key in the path; the rest need the header.
        for path in (f"/key/{KEY_A}/jobs", f"/key/{KEY_A}/v1/models", f"/key/{KEY_A}/healthz"):
            r = c.get(path)
            assert r.status_code == 401, (path, r.text)
            assert KEY_A not in r.text and "Authorization: Bearer" in r.json()["error"]["message"]
        assert c.get("/jobs").status_code == 401  # and a header-less call is still refused
    assert keyed.log_path is not None
    log = keyed.log_path.read_text(errors="replace")
    assert "POST /asr?" in log and "POST /detect-language?" in log  # the access log has them
    assert KEY_A not in log and wrong not in log
