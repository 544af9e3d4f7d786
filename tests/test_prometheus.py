"""A real Prometheus scrapes the real service (whisper-base) while it transcribes corpus audio;
PromQL (the dashboard's own expressions) must give the numbers the API reported for the jobs.

Prometheus comes from the Debian package ``prometheus`` (scripts/test installs it). No timing
thresholds: the checks are about what the numbers mean, see app/metrics.py for the definitions.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import COLD, Server, free_port, need
from tests.test_metrics import (
    ALERTS,
    DASHBOARD,
    PROM_DIR,
    long_wav,
    queried_metrics,
    vad_audio_seconds,
)

pytestmark = pytest.mark.model


@pytest.fixture(autouse=True)
def _prometheus_installed() -> None:
    need(shutil.which("prometheus"), "prometheus not installed (scripts/test installs the Debian "
         "package)")


SCRAPE_S = 1  # scrape interval and timeout: a sample's value was read within 1 s of its timestamp
MAX_ACTIVE = 2  # jobs the service works on at once: the others wait in the queue (the backlog)
PROGRESS_WINDOWS = 4  # a job of this many windows or more logs its progress (default 10)


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())  # the shipped config
        cfg["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
        cfg["rule_files"] = [str(ALERTS)]
        [job] = cfg["scrape_configs"]
        job.update(scrape_timeout=f"{SCRAPE_S}s", static_configs=[{"targets": [target]}])
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", "--web.listen-address=" + self.url[7:]],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for(lambda: httpx.get(self.url + "/-/ready").status_code == 200, "ready")

    def wait_for(self, ok: Any, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout  # a hang guard only
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited"
            try:
                if ok():
                    return
            except (httpx.HTTPError, IndexError, KeyError, ValueError):
                pass
            time.sleep(0.25)
        raise AssertionError(f"prometheus: {what} not reached")

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at else {})}
        body = httpx.get(self.url + "/api/v1/query", params=params, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def scalar(self, expr: str, at: float | None = None) -> float:
        [r] = self.query(expr, at)
        return float(r["value"][1])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@dataclass
class Run:
    prom: Prometheus
    server: Server
    jobs: list[dict[str, Any]]  # as the API reports them at the end
    windows: list[int]  # per job, recomputed with the service's VAD
    speech_s: list[float]
    t_end: float
    range_s: int  # a PromQL range covering the whole run, from before the first job
    live_rtf: list[float] = field(default_factory=list)  # dashboard RTF sampled mid-run


def dashboard_expr(title: str, ref: str, range_s: int) -> str:
    """A dashboard target's PromQL with Grafana's variables filled in."""
    panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title)
    expr: str = next(t["expr"] for t in panel["targets"] if t["refId"] == ref)
    return (expr.replace("$__rate_interval", f"{range_s}s").replace('"$job"', '"batchscribe"')
            .replace('"$instance"', '".*"'))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, clips: list[Clip]) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("prom")
    # 2 minutes, 5 windows: logs its progress (progress_log_windows 4). It was 330 s, 12 windows
    # for the default threshold of 10: 200 s more audio (~25 CPU-s) for the same log lines.
    long = long_wav(clips, tmp / "long.wav", 120)
    by_len = sorted(clips, key=lambda c: (-c.duration_s, c.id))
    short = [c for c in by_len if c.set in READ_SPEECH and c.duration_s < 20][:4]
    # The long job, one 60 s recording (a job of several windows, too few to log its progress)
    # and four short reads. (Three long recordings were sent: 106 s more audio, the same checks.)
    files = [long, by_len[0].path, *(c.path for c in short)]
    expected = [vad_audio_seconds(p) for p in files]
    assert expected[0][0] >= PROGRESS_WINDOWS > max(w for w, _ in expected[1:]), expected
    server = Server(tmp / "server", env={**COLD, "BATCHSCRIBE_STORAGE__MAX_ACTIVE_JOBS": str(MAX_ACTIVE),
                                         "BATCHSCRIBE_PROGRESS_LOG_WINDOWS": str(PROGRESS_WINDOWS)})
    server.start()
    prom = Prometheus(tmp, f"127.0.0.1:{server.port}")
    t_start = time.time()
    try:  # the counters' first samples are 0: rate() over the run is then exact
        prom.wait_for(lambda: prom.scalar("batchscribe_audio_processed_seconds_total") == 0,
                      "first scrape")
        with server.client() as client:
            ids = []
            for p in files:
                with p.open("rb") as f:
                    r = client.post("/transcribe", files={"file": (p.name, f)})
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            live: list[float] = []
            while True:
                jobs = [client.get(f"/jobs/{i}").json() for i in ids]
                if all(j["status"] in ("done", "failed", "cancelled") for j in jobs):
                    break
                res = prom.query(dashboard_expr("Real-time factor", "A", 5))
                live += [float(r["value"][1]) for r in res]
                time.sleep(1)
        n = len(ids)
        prom.wait_for(lambda: prom.scalar("batchscribe_job_rtf_ratio_count") == n, "last scrape")
        time.sleep(SCRAPE_S * 2)  # and a scrape or two more after it
        t_end = time.time()
        yield Run(prom, server, jobs, [w for w, _ in expected], [s for _, s in expected], t_end,
                  math.ceil(t_end - t_start) + 10, live)
    finally:
        prom.stop()
        server.terminate()


def test_jobs_done_and_windows_as_the_service_cuts_them(run: Run) -> None:
    assert [j["status"] for j in run.jobs] == ["done"] * len(run.jobs), run.jobs
    assert [j["progress"]["windows_total"] for j in run.jobs] == run.windows
    p = run.prom
    assert p.scalar('batchscribe_jobs{status="done"}', run.t_end) == len(run.jobs)
    assert p.scalar('batchscribe_jobs{status="running"}', run.t_end) == 0
    assert p.scalar("batchscribe_queue_pending_windows", run.t_end) == 0
    # Per job: the API's rtf and queue wait are what the histograms observed.
    assert p.scalar("batchscribe_job_rtf_ratio_sum", run.t_end) == pytest.approx(
        sum(j["rtf"] for j in run.jobs), abs=1e-3 * len(run.jobs))
    assert p.scalar("batchscribe_job_queue_wait_seconds_sum", run.t_end) == pytest.approx(
        sum(j["queue_wait_s"] for j in run.jobs), abs=1e-3)
    assert p.scalar('batchscribe_job_latency_seconds_count{status="done"}', run.t_end) == len(
        run.jobs)


def test_live_rtf_and_throughput(run: Run) -> None:
    p, at = run.prom, run.t_end
    audio = p.scalar("batchscribe_audio_processed_seconds_total", at)
    busy = p.scalar("batchscribe_processing_seconds_total", at)
    # Audio processed is the speech in the jobs' windows, each transcribed once.
    assert audio == pytest.approx(sum(run.speech_s), rel=1e-6)
    assert busy == pytest.approx(p.scalar("batchscribe_batch_duration_seconds_sum", at), rel=1e-9)
    # Engine-busy time fits inside the jobs' lifetimes on the engine's workers.
    [info] = p.query("batchscribe_model_info", at)
    workers = int(info["metric"]["workers"])
    span = max(j["finished_at"] for j in run.jobs) - min(j["started_at"] for j in run.jobs)
    assert 0 < busy <= workers * span
    # The dashboard's live RTF over the whole run is exactly audio / engine time.
    rtf = p.scalar(dashboard_expr("Real-time factor", "A", run.range_s), at)
    assert rtf == pytest.approx(audio / busy, rel=1e-9)
    assert p.scalar(dashboard_expr("Live RTF", "A", run.range_s), at) == pytest.approx(rtf)
    assert any(math.isfinite(v) and v > 0 for v in run.live_rtf), run.live_rtf  # seen mid-run


def test_backlog_follows_the_jobs(run: Run) -> None:
    p = run.prom
    [series] = p.query(f"batchscribe_backlog_audio_seconds[{run.range_s}s]", run.t_end)
    points = [(float(t), float(v)) for t, v in series["values"]]
    jobs = run.jobs
    queued_seen = False
    for t, v in points:
        # Jobs surely queued at t count in full; running ones between 0 and their audio; jobs
        # not yet accepted or already finished not at all. SCRAPE_S: the read lags the stamp.
        lo = sum(j["audio_seconds"] for j in jobs
                 if j["created_at"] < t - SCRAPE_S and j["started_at"] > t + SCRAPE_S)
        hi = sum(j["audio_seconds"] for j in jobs
                 if j["created_at"] < t + SCRAPE_S and j["finished_at"] > t - SCRAPE_S)
        assert lo - 1 <= v <= hi + 1, (t, v, lo, hi)
        queued_seen |= lo > 0
    assert queued_seen and max(v for _, v in points) > 0
    assert points[-1][1] == 0
    assert p.scalar(dashboard_expr("Backlog", "A", run.range_s), run.t_end) == 0


def test_batch_size(run: Run) -> None:
    p, at = run.prom, run.t_end
    windows = sum(j["progress"]["windows_total"] for j in run.jobs)
    count = p.scalar("batchscribe_batch_size_windows_count", at)
    assert p.scalar("batchscribe_batch_size_windows_sum", at) == windows
    assert count == p.scalar('batchscribe_batches_total{outcome="ok"}', at)
    cap = p.scalar("batchscribe_batch_cap_windows", at)
    assert math.ceil(windows / cap) <= count <= windows
    mean = p.scalar(dashboard_expr("Mean batch size, cap and fill", "A", run.range_s), at)
    assert mean == pytest.approx(windows / count, rel=1e-9)
    assert p.scalar('batchscribe_batch_size_windows_bucket{le="+Inf"}', at) == count


def test_every_queried_metric_is_in_prometheus(run: Run) -> None:
    missing = {n: sorted(w) for n, w in queried_metrics().items()
               if not run.prom.query(f'count({{__name__="{n}"}})', run.t_end)}
    assert not missing, missing


def test_alert_rules_are_loaded_and_healthy(run: Run) -> None:
    body = httpx.get(run.prom.url + "/api/v1/rules").json()
    rules = [r for g in body["data"]["groups"] for r in g["rules"]]
    want = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == want
    assert all(r["health"] == "ok" for r in rules), rules
    firing = {r["name"] for r in rules if r["state"] == "firing"}
    assert not firing & {"BatchscribeDown", "BatchscribeAbsent", "BatchscribeOutOfMemory"}


def test_progress_of_the_long_job_is_in_the_service_log(run: Run) -> None:
    job = run.jobs[0]  # the long one
    total = job["progress"]["windows_total"]
    assert run.server.log_path is not None
    lines = [json.loads(ln) for ln in run.server.log_path.read_text().splitlines()
             if ln.startswith("{") and '"job progress"' in ln]
    mine = [ln for ln in lines if ln["job_id"] == job["id"]]
    assert mine and all(ln["windows_total"] == total and ln["rtf"] > 0 for ln in mine)
    done = [ln["windows_done"] for ln in mine]
    assert done == sorted(done) and done[-1] == total
    assert not [ln for ln in lines if ln["job_id"] != job["id"]]  # short jobs stay quiet
