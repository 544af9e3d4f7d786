"""What the test files share: the service in a thread on a fake engine, uploads, clients, API
keys, polling, Prometheus samples. Fixtures built on these are in tests/conftest.py; the fake
engines and the batcher rig in tests/fakes.py; the corpus in loadtest/lib/corpus.py."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from app.config import Settings
from loadtest.lib.common import free_port

if TYPE_CHECKING:
    from openai import OpenAI

    from app.engine import Engine

# ---- the service in a thread -----------------------------------------------------------------


def fake_settings(tmp: Path, **kw: Any) -> Settings:
    """Settings for a service on a fake engine, its data in ``tmp``; ``kw`` as Settings'. No
    warm-up: the fakes count and gate the batches requests send (the warm-up is tested in
    tests/test_gpu_readiness.py)."""
    return Settings(storage={"data_dir": tmp}, model={"vad": "silero", "warmup": False},  # type: ignore[arg-type]
                    shutdown_grace_s=5, **kw)


@contextmanager
def serve(app: Any, settings: Settings | None = None) -> Iterator[str]:
    """Serve ``app`` (lifespan included) with uvicorn on a free port in a thread, configured as
    ``python -m app`` configures it for ``settings`` (None: the defaults); its URL."""
    from app.__main__ import server_config

    server = uvicorn.Server(server_config(app, settings or Settings.model_construct(),
                                          host="127.0.0.1", port=free_port(), lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the app did not start (see the log)")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(60)


@contextmanager
def fake_service(tmp: Path, engine: Engine | None = None, **settings: Any) -> Iterator[str]:
    """The real app (``create_app``) on ``engine`` (a new FakeEngine if None) with
    :func:`fake_settings`, served in a thread: its URL."""
    from app.main import create_app
    from tests.fakes import FakeEngine

    fake = engine or FakeEngine()
    config = fake_settings(tmp, **settings)
    with serve(create_app(config, engine_factory=lambda s: fake), config) as url:
        yield url


# ---- requests ----------------------------------------------------------------------------------


def post(client: httpx.Client, audio: Path | tuple[str, bytes] | None,
         route: str = "/transcribe", *, field: str = "file", wait: bool = False,
         **kw: Any) -> httpx.Response:
    """An upload as a client sends it: ``audio`` (a file, or a name and its bytes; None: no
    file, e.g. an ``audio_url``) in the form's ``field``; ``wait`` asks /transcribe to answer
    when the job ends; ``kw`` as httpx's ``post`` (data, json, params, headers)."""
    if wait:
        kw["params"] = {**(kw.get("params") or {}), "wait": "true"}
    if audio is None:
        return client.post(route, **kw)
    if isinstance(audio, Path):
        with audio.open("rb") as f:
            return client.post(route, files={field: (audio.name, f)}, **kw)
    return client.post(route, files={field: audio}, **kw)


def wait_done(client: httpx.Client, job_id: str, timeout: float = 300) -> dict[str, Any]:
    """The job once it ended (done, failed or cancelled)."""
    deadline = time.monotonic() + timeout  # a hang guard, not a performance threshold
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish")


def wait_until(what: Callable[[], bool], timeout: float, step: float = 0.5) -> bool:
    """Bounded poll: the bound only prevents a hang, it is never a performance claim."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(step)
    return what()


def openai_client(url: str, api_key: str = "unused", timeout: float = 600) -> OpenAI:
    """The official OpenAI client on the service at ``url``, without retries (a test sees the
    first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


# ---- API keys ----------------------------------------------------------------------------------


def sha(key: str) -> str:
    """What ``security.api_key_sha256`` holds for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- /metrics ----------------------------------------------------------------------------------


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Exposition text -> {sample name: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels`` (0 when the series is absent)."""
    got = [v for lab, v in samples(text).get(name, []) if labels.items() <= lab.items()]
    assert len(got) <= 1, (name, labels, got)
    return got[0] if got else 0.0
