"""/metrics: answers while a batch runs, means what app/metrics.py says, and has every metric the
Grafana dashboard and the alert rules query. Runs the real app (uvicorn in a thread) on a fake
engine whose gate holds a batch open, so no model is needed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from app.audio import decode, prepare
from app.audio.vad import SileroVad
from app.config import BatcherSettings
from app.engine import EngineInfo
from app.main import JsonFormatter, create_app
from app.windows import SAMPLE_RATE
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip
from tests.conftest import ROOT, need
from tests.fakes import FakeEngine
from tests.helpers import fake_settings, samples, serve, value, wait_done
from tests.test_device import FakeNvml, two_gpus

DASHBOARD = ROOT / "deploy" / "grafana" / "batchscribe.json"
PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
            "group_right", "bool", "offset", "inf", "nan"}
SYNTHETIC = {"up"}  # made by Prometheus for every target, never exposed by the service


def long_wav(clips: list[Clip], path: Path, min_s: float) -> Path:
    """Real speech of at least ``min_s`` seconds: corpus clips decoded and joined by 0.5 s of
    silence, written as 16 kHz mono 16-bit wav with the standard library."""
    parts: list[np.ndarray] = []
    total = 0.0
    for c in sorted((c for c in clips if c.duration_s < 40), key=lambda c: (-c.duration_s, c.id)):
        parts += [decode(c.path, 3600), np.zeros(SAMPLE_RATE // 2, np.float32)]
        total += c.duration_s + 0.5
        if total >= min_s:
            break
    assert total >= min_s, "the corpus is too small for a long job"
    write_wav16(path, np.concatenate(parts), SAMPLE_RATE)
    return path


def vad_audio_seconds(path: Path) -> tuple[int, float]:
    """(windows, speech seconds) the service cuts from ``path`` with the CPU VAD (Silero): what
    ``batchscribe_audio_processed_seconds_total`` counts for that upload."""
    _, windows = prepare(path, SileroVad(), 4 * 3600)
    return len(windows), sum(w.duration for w in windows)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (labels, ranges, functions and keywords removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def queried_metrics() -> dict[str, set[str]]:
    """{metric name: where it is used} for the dashboard's panels and variables and the alerts."""
    used: dict[str, set[str]] = {}
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p.get("targets", []):
            for n in metric_names(t["expr"]):
                used.setdefault(n, set()).add(f"dashboard: {p['title']}")
    for var in dash["templating"]["list"]:
        q = var.get("definition", "")
        if q.startswith("label_values("):
            for n in metric_names(q[len("label_values("):].split(",")[0]):
                used.setdefault(n, set()).add(f"dashboard variable {var['name']}")
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            for n in metric_names(rule["expr"]):
                used.setdefault(n, set()).add(f"alert {rule['alert']}")
    return used


# ---- one app on a fake engine, with a batch held open --------------------------------------

@dataclass
class Run:
    url: str
    fake: FakeEngine
    job: dict[str, Any]
    windows: int
    speech_s: float
    during: dict[str, httpx.Response]
    after: str


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, clips: list[Clip]) -> Iterator[Run]:
    clip = max(clips, key=lambda c: c.duration_s)  # ~60 s: a few windows, one batch
    windows, speech_s = vad_audio_seconds(clip.path)
    assert windows >= 2
    fake = FakeEngine()
    fake.gate.clear()  # the first batch blocks inside the engine until the gate opens
    app = create_app(fake_settings(tmp_path_factory.mktemp("metrics")),
                     engine_factory=lambda s: fake)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        try:
            with clip.path.open("rb") as f:
                r = client.post("/transcribe", files={"file": (clip.path.name, f)},
                                data={"language": "en"})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            assert fake.entered.acquire(timeout=120), "no batch reached the engine"
            # The engine thread is now blocked inside transcribe_batch.
            during = {p: client.get(p) for p in ("/metrics", "/healthz", "/readyz")}
            during["job"] = client.get(f"/jobs/{job_id}")
            assert not fake.batches  # still blocked: nothing was answered by a finished batch
        finally:
            fake.gate.set()
        job = wait_done(client, job_id)
        after = client.get("/metrics").text
        yield Run(url, fake, job, windows, speech_s, during, after)


def test_metrics_and_health_answer_while_a_batch_is_running(run: Run) -> None:
    assert {p: r.status_code for p, r in run.during.items()} == {
        "/metrics": 200, "/healthz": 200, "/readyz": 200, "job": 200}
    text = run.during["/metrics"].text
    job = run.during["job"].json()
    assert job["status"] == "running" and job["progress"]["windows_done"] == 0
    assert value(text, "batchscribe_jobs", status="running") == 1
    assert value(text, "batchscribe_jobs", status="queued") == 0
    # Fresh at scrape time (not the maintenance loop's 10 s old value): nothing is transcribed
    # yet, so the backlog is exactly the job's decoded audio.
    assert value(text, "batchscribe_backlog_audio_seconds") == pytest.approx(
        job["audio_seconds"], abs=1e-3)
    assert value(text, "batchscribe_queue_pending_windows") == 0  # all are in the open batch
    assert value(text, "batchscribe_batch_size_windows_count") == 0
    assert value(text, "batchscribe_audio_processed_seconds_total") == 0


def test_metrics_after_the_job_match_the_api(run: Run) -> None:
    job, t = run.job, run.after
    assert job["status"] == "done", job
    assert job["progress"]["windows_total"] == run.windows
    assert value(t, "batchscribe_backlog_audio_seconds") == 0
    assert value(t, "batchscribe_jobs", status="done") == 1
    assert value(t, "batchscribe_jobs", status="running") == 0
    assert value(t, "batchscribe_jobs_finished_total", status="done") == 1
    # Throughput/RTF counters: the VAD windows' speech, and the batches' engine time.
    assert value(t, "batchscribe_audio_processed_seconds_total") == pytest.approx(run.speech_s)
    assert value(t, "batchscribe_processing_seconds_total") == pytest.approx(
        value(t, "batchscribe_batch_duration_seconds_sum"))
    # Batches: every window once, in the batches the engine really ran.
    sizes = [len(tags) for _, tags in run.fake.batches]
    assert value(t, "batchscribe_batch_size_windows_sum") == sum(sizes) == run.windows
    assert value(t, "batchscribe_batch_size_windows_count") == len(sizes)
    assert value(t, "batchscribe_batches_total", outcome="ok") == len(sizes)
    assert len(sizes) == 1  # one job's windows, submitted at once, under the default cap
    assert value(t, "batchscribe_batch_fill_ratio_sum") == pytest.approx(
        run.speech_s / (run.windows * 30.0))
    assert value(t, "batchscribe_batch_cap_windows") == BatcherSettings().max_batch_size
    assert value(t, "batchscribe_queue_wait_seconds_count") == run.windows
    # Per job: the API's numbers.
    assert value(t, "batchscribe_job_rtf_ratio_count") == 1
    assert value(t, "batchscribe_job_rtf_ratio_sum") == pytest.approx(job["rtf"], abs=1e-3)
    assert value(t, "batchscribe_job_queue_wait_seconds_sum") == pytest.approx(
        job["queue_wait_s"], abs=1e-6)
    assert value(t, "batchscribe_job_latency_seconds_count", status="done") == 1
    # HTTP by route template (never the job id), model info, memory on CPU.
    assert value(t, "batchscribe_http_requests_total", method="POST", route="/transcribe",
                 status="202") == 1
    assert value(t, "batchscribe_http_requests_total", method="GET", route="/jobs/{job_id}",
                 status="200") >= 1
    assert value(t, "batchscribe_model_info", model="fake", device="cpu", compute_type="int8") == 1
    assert value(t, "batchscribe_engine_memory_bytes", device="cpu") == pytest.approx(
        value(t, "process_resident_memory_bytes"), rel=0.2)
    assert 0 < value(t, "batchscribe_device_memory_used_bytes", device="cpu") <= value(
        t, "batchscribe_device_memory_total_bytes", device="cpu")


def test_oom_backoff_is_visible(tmp_path: Path, clips: list[Clip]) -> None:
    clip = max(clips, key=lambda c: c.duration_s)
    windows, _ = vad_audio_seconds(clip.path)

    def oom_above_one(ws: Any) -> None:
        if len(ws) > 1:
            raise RuntimeError("CUDA failed with error out of memory")

    fake = FakeEngine(fail=oom_above_one)
    app = create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        with clip.path.open("rb") as f:
            r = client.post("/transcribe", files={"file": (clip.path.name, f)},
                            data={"language": "en"})
        job = wait_done(client, r.json()["id"])
        t = client.get("/metrics").text
    assert job["status"] == "done", job
    ooms = value(t, "batchscribe_oom_events_total")
    assert ooms >= 1 and value(t, "batchscribe_batches_total", outcome="oom") == ooms
    assert value(t, "batchscribe_batch_cap_windows") == 1
    assert value(t, "batchscribe_batch_size_windows_count") == windows  # retried one by one
    assert value(t, "batchscribe_queue_wait_seconds_count") == windows  # each window once
    assert value(t, "batchscribe_processing_seconds_total") >= value(
        t, "batchscribe_batch_duration_seconds_sum")  # the failed batches' time counts too


def test_a_stalled_engine_call_fails_liveness(tmp_path: Path, clips: list[Clip]) -> None:
    """An engine call that does not return (a hung driver, fault-injected: the gate stays shut)
    turns /healthz to 503 once it outlives batcher.stall_after_s, with the age on /metrics; when
    the call returns, liveness recovers and the job finishes."""
    clip = min(clips, key=lambda c: c.duration_s)
    fake = FakeEngine()
    fake.gate.clear()
    app = create_app(fake_settings(tmp_path, batcher={"stall_after_s": 1}),
                     engine_factory=lambda s: fake)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        with clip.path.open("rb") as f:
            r = client.post("/transcribe", files={"file": (clip.path.name, f)},
                            data={"language": "en"})
        assert r.status_code == 202, r.text
        assert fake.entered.acquire(timeout=120), "no batch reached the engine"
        deadline = time.monotonic() + 30  # bounded: only guards against a hang
        while (h := client.get("/healthz")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.status_code == 503 and h.json()["status"] == "engine_stalled", h.text
        assert h.json()["engine_call_running_s"] >= 1
        assert value(client.get("/metrics").text, "batchscribe_engine_call_running_seconds") >= 1
        fake.gate.set()
        job = wait_done(client, r.json()["id"])
        assert job["status"] == "done", job
        assert client.get("/healthz").json() == {"status": "ok"}
        assert value(client.get("/metrics").text, "batchscribe_engine_call_running_seconds") == 0


def test_every_metric_the_dashboard_and_alerts_query_is_exposed(run: Run) -> None:
    used = queried_metrics()
    # The extraction works: the core signals are among the names found.
    assert {"batchscribe_audio_processed_seconds_total", "batchscribe_processing_seconds_total",
            "batchscribe_backlog_audio_seconds", "batchscribe_batch_size_windows_bucket",
            "batchscribe_job_latency_seconds_bucket", "batchscribe_device_memory_used_bytes",
            "batchscribe_device_memory_total_bytes", "batchscribe_oom_events_total",
            "batchscribe_http_requests_total", "up"} <= set(used)
    exposed = set(samples(httpx.get(run.url + "/metrics").text))
    missing = {n: sorted(w) for n, w in used.items() if n not in exposed | SYNTHETIC}
    assert not missing, missing


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "__inputs" not in dash and dash.get("id") is None  # importable anywhere
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for d in [p["datasource"], *(t["datasource"] for t in p["targets"])]:
            assert d == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for want in ("rtf", "throughput", "backlog", "batch size distribution", "job latency p50 / p95",
                 "device memory: used vs total", "oom", "error"):
        assert want in titles, want


def test_promtool_checks_rules_config_and_alert_unit_tests() -> None:
    need(shutil.which("promtool"), "promtool not installed (scripts/test installs the Debian "
         "package prometheus)")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                 ["check", "config", "prometheus.yml"]):
        p = subprocess.run(["promtool", *args], cwd=PROM_DIR, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr


def test_progress_is_logged_for_a_long_job(tmp_path: Path, clips: list[Clip],
                                           caplog: pytest.LogCaptureFixture) -> None:
    path = long_wav(clips, tmp_path / "long.wav", 330)
    fake = FakeEngine()
    app = create_app(fake_settings(tmp_path / "data"), engine_factory=lambda s: fake)
    with caplog.at_level(logging.INFO, "app.jobs.runner"), serve(app) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        with path.open("rb") as f:
            r = client.post("/transcribe", files={"file": ("long.wav", f)})
        job = wait_done(client, r.json()["id"])
    total = job["progress"]["windows_total"]
    assert job["status"] == "done" and total >= 10
    lines = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records
             if rec.getMessage() == "job progress"]
    assert lines, "no progress log"
    # Windows can finish while the upload is still being cut: the total is null until known.
    assert all(ln["job_id"] == job["id"] and ln["windows_total"] in (None, total) for ln in lines)
    assert lines[-1]["windows_total"] == total
    assert all(ln["windows_expected"] == total for ln in lines if ln["windows_total"])
    done = [ln["windows_done"] for ln in lines]
    assert done == sorted(done) and done[-1] == total
    assert len(done) <= total // max(1, total // 10) + 1  # about ten lines, not one per window
    assert all(ln["rtf"] > 0 and ln["level"] == "INFO" and ln["logger"] == "app.jobs.runner"
               for ln in lines)


def test_two_fake_gpus_through_the_whole_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(two_gpus()))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeEngine()
    fake.info = EngineInfo("fake", "cuda", "float16", 1)
    with serve(create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)) as url:
        t = httpx.get(url + "/metrics").text
    gib = 1 << 30
    assert value(t, "batchscribe_device_memory_total_bytes", device="cuda:0") == 16 * gib
    assert value(t, "batchscribe_device_memory_total_bytes", device="cuda:1") == 24 * gib
    assert value(t, "batchscribe_device_memory_used_bytes", device="cuda:1") == 5 * gib
    assert value(t, "batchscribe_engine_memory_bytes", device="cuda:1") == 4 * gib
    assert "cuda:0" not in str(samples(t).get("batchscribe_engine_memory_bytes"))
    assert value(t, "batchscribe_model_info", device="cuda", compute_type="float16") == 1


def test_no_gpu_behind_a_cuda_engine_still_serves_metrics(tmp_path: Path) -> None:
    """The real nvidia-ml-py on a machine without a driver: NVML init fails, torch sees no GPU,
    /metrics answers without device series."""
    fake = FakeEngine()
    fake.info = EngineInfo("fake", "cuda", "float16", 1)
    with serve(create_app(fake_settings(tmp_path), engine_factory=lambda s: fake)) as url:
        r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    devices = {lab["device"] for lab, _ in samples(r.text).get(
        "batchscribe_device_memory_total_bytes", [])}
    assert devices <= {f"cuda:{i}" for i in range(64)}  # never a "cpu" reading on a GPU engine
    if shutil.which("nvidia-smi") is None:
        assert devices == set()
