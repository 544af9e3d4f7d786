"""Shared fixtures: the corpus, a real service process on the real model, a fake engine, a fake
GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

import app.engine.gpumem as gpumem
from app.config import ModelSettings, Settings
from app.engine.whisper import WhisperEngine
from loadtest.lib.common import free_port
from loadtest.lib.corpus import ML_CORPUS, Clip, read_manifest
from models.registry import resolve
from tests.fakegpu import FakeDevice, FakeGpu, install
from tests.fakes import Rigs
from tests.helpers import openai_client

if TYPE_CHECKING:
    from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("BATCHSCRIBE_CORPUS", ROOT.parent / "shared" / "corpus"))


# Test files by their wall time under three pytest workers (the profile's wall spans at 488aa19:
# 170 s for the first, ~45 s for the last), collected first, longest first: xdist's --dist
# loadfile hands files out in collection order (scripts/test turns its reordering off), so the
# run does not end waiting on a heavy file started late (there the three workers ended within
# 28 s of each other).
HEAVY_FIRST = ("test_ray_model", "test_dataset_model", "test_gpu_service", "test_unsure",
               "test_decode_cap", "test_accuracy", "test_parts_model", "test_postgres",
               "test_language", "test_crash", "test_default_beam", "test_stages",
               "test_openai_stream", "test_prep_procs", "test_live_model", "test_schemathesis",
               "test_diarize_devset", "test_speakers", "test_vad", "test_prometheus")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1] if isinstance(item, pytest.Function) else ""
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


_cpu: dict[str, float] = {}
_cpu_tests: dict[str, float] = {}
_wall_tests: dict[str, tuple[float, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``BATCHSCRIBE_TEST_CPU_PROFILE=<dir>``: CPU seconds per test file (this process and
    the child processes it waited for: servers, CLIs), one JSON file per pytest worker, and each
    test's wall-clock span (``<worker>-wall.json``: where a worker waited or ran alone). The
    suite is CPU-bound on 2 cores under three workers, so its wall time follows this sum."""
    if not os.environ.get("BATCHSCRIBE_TEST_CPU_PROFILE"):
        yield
        return
    import resource

    def used() -> float:
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime + _live_children_cpu()

    before, began = used(), time.time()
    yield
    _wall_tests[item.nodeid] = (round(began, 3), round(time.time(), 3))
    name = item.module.__name__ if isinstance(item, pytest.Function) else "?"
    spent = used() - before
    _cpu[name] = _cpu.get(name, 0.0) + spent
    _cpu_tests[item.nodeid] = spent  # (a module fixture's set-up counts in its first test)


def _live_children_cpu() -> float:
    """CPU seconds of this process's live descendants (and the children they waited for), from
    /proc: a session-scoped server's work counts against the tests that asked for it, not
    against whichever test's teardown happened to reap it (RUSAGE_CHILDREN counts a child only
    once waited for). A child reaped during a test moves from this sum into RUSAGE_CHILDREN, so
    the difference across a test stays its own."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(x) for x in fields[11:15]) / tick  # utime..cstime
    mine: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - mine
        mine |= frontier
    return sum(times[p] for p in mine)


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("BATCHSCRIBE_TEST_CPU_PROFILE")
    if out and _cpu:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{worker}.json").write_text(json.dumps(_cpu, indent=1))
        (Path(out) / f"{worker}-tests.json").write_text(json.dumps(_cpu_tests, indent=1))
        (Path(out) / f"{worker}-wall.json").write_text(json.dumps(_wall_tests, indent=1))


def need(ok: object, reason: str) -> None:
    """Skip the test when something it needs is missing, saying what; with ``CI`` set (.ci/run
    sets it), fail instead: a CI run must not pass by skipping what it was meant to test."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing requirement fails the run)", pytrace=False)
    pytest.skip(reason)


def corpus_clips() -> list[Clip]:
    """The corpus in its manifest's order (loadtest/lib/corpus.py: the benchmarks' clips)."""
    need((CORPUS / "manifest.jsonl").is_file(), f"corpus not found at {CORPUS} (set BATCHSCRIBE_CORPUS)")
    return read_manifest(CORPUS)


def multilingual_clips() -> list[Clip]:
    """The multilingual corpus in its manifest's order (the language of each clip its own)."""
    need((ML_CORPUS / "manifest.jsonl").is_file(), f"multilingual corpus not found at {ML_CORPUS} "
         "(set BATCHSCRIBE_MULTILINGUAL_CORPUS)")
    return read_manifest(ML_CORPUS)


@pytest.fixture(scope="session")
def clips() -> list[Clip]:
    return corpus_clips()


# A real-model service without its warm-up (~1.3 of its ~6 CPU-s to ready, measured): for tests
# that make no claim about the warm-up or the first request's latency. The shared ``server``
# stays warm (the production default: the warm-up path runs on the real model there).
COLD = {"BATCHSCRIBE_MODEL__WARMUP": "false"}


class PortTaken(RuntimeError):
    """Another process bound the server's port first."""


@dataclass
class Server:
    """A real ``python -m app`` process: the same code path as production, killable.

    Ready means *this* process answers: its own log says it listens on its port, and the port
    answers ``/readyz``. A readiness answer alone was taken from whatever listened there: the
    service binds its port only after loading its model, so a port picked free (``free_port``)
    could be picked again meanwhile by another pytest worker's server, which, bound first,
    answered this one's readiness poll; the test then fed its jobs to the other test's server
    and database (issue 51: 41 jobs in one test's PostgreSQL table for its 16 manifest rows).
    A port taken that way is picked again (``port=0``, the default) or fails loudly (a port
    given, e.g. a restart on the same one)."""

    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # 0: a free one, picked again if another process binds it first
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    module: str = "app"  # what ``python -m`` runs (tests/fakegpu_app.py: the same on a fake GPU)
    args: list[str] = field(default_factory=list)  # its command line (app/config/cli.py)

    def __post_init__(self) -> None:
        self.fixed_port = self.port != 0
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> Server:
        for attempt in range(3):
            try:
                return self._start(timeout)
            except PortTaken:
                if self.fixed_port or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> Server:
        env = {**os.environ, "BATCHSCRIBE_PORT": str(self.port),
               "BATCHSCRIBE_STORAGE__DATA_DIR": str(self.data_dir), **self.env}
        self.log_path = self.data_dir / f"server-{self.port}-{int(time.time() * 1000)}.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT,
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
        listening = f"running on http://127.0.0.1:{self.port} "  # uvicorn's line once bound
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log()
                if "address already in use" in text:
                    raise PortTaken(f"port {self.port} was taken by another process:\n{text}")
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text}")
            try:
                if listening in self.log_path.read_text(errors="replace") and \
                        httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 300), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real-model service shared by the end-to-end tests (the model loads once)."""
    srv = Server(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.terminate()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[type[Server]]:
    """Servers a test starts and kills itself; all are stopped at the end."""
    started: list[Server] = []

    class Own(Server):
        def start(self, timeout: float = 180.0) -> Server:
            started.append(self)
            return super().start(timeout)

    yield Own
    for s in started:
        s.kill()


@pytest.fixture(scope="session")
def engine() -> Iterator[WhisperEngine]:
    """The real engine in-process (one worker, two threads): for tests of the model seam. One
    for the whole run (it was one per module: five loads of the model); a test that changes
    it puts it back (tests/test_default_beam.py)."""
    s = Settings()
    eng = WhisperEngine(resolve(s.model.name, s.model.cache_dir, True),
                        ModelSettings(num_workers=1, cpu_threads=2), s.model.name)
    yield eng
    eng.close()


@pytest.fixture
def gpu_patch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Installs a fake GPU (tests/fakegpu.py) for one test: ``gpu_patch(totals_mb=(4096, 2048))``
    makes two; everything it patched is put back afterwards."""
    import ctranslate2

    monkeypatch.setattr(ctranslate2.models, "Whisper", ctranslate2.models.Whisper)
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", ctranslate2.get_cuda_device_count)
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types",
                        ctranslate2.get_supported_compute_types)
    monkeypatch.setitem(sys.modules, "pynvml", sys.modules.get("pynvml"))
    monkeypatch.setattr(gpumem, "_meter", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mib = 1 << 20

    def make(totals_mb: Sequence[int] = (4096,), **kw: Any) -> FakeGpu:
        devices = [FakeDevice(k, t * mib, 300 * mib) for k, t in enumerate(totals_mb)]
        gpu = FakeGpu(devices=devices, decode_bytes=kw.pop("decode_mb", 150) * mib,
                      encode_bytes=kw.pop("encode_mb", 50) * mib,
                      align_bytes=kw.pop("align_mb", 20) * mib, **kw)
        return install(gpu)

    yield make


@pytest.fixture(scope="session")
def oa(server: Server) -> Iterator[OpenAI]:
    """The official OpenAI client on the shared real-model service (tests/helpers.py's
    ``openai_client``: no retries)."""
    client = openai_client(server.url)
    yield client
    client.close()


@pytest.fixture
async def rigs() -> AsyncIterator[Rigs]:
    """Batchers on fake engines as the service wires them (tests/fakes.py's ``Rig``):
    ``rigs.make(FakeEngine(), max_batch_size=4)``; all stopped at the end, gates open."""
    made = Rigs()
    yield made
    await made.stop()
