"""Every Prometheus metric of the service, in one place, with buckets chosen for this workload.

The metrics live in a per-app registry (not the global default) so tests can create many apps in
one process without "duplicated timeseries" errors. Names carry their unit, as Prometheus asks;
counters get the ``_total`` suffix from prometheus-client. The Grafana dashboard
(deploy/grafana/batchscribe.json) and the alert rules (deploy/prometheus/alerts.yml) query these
names, and tests/test_metrics.py checks that every name they use is exposed.

Definitions (what the numbers mean):

* ``audio_processed_seconds_total``: speech seconds of the windows the engine transcribed (after
  VAD, so silence the VAD dropped is not counted); ``processing_seconds_total``: wall seconds the
  engine spent on batches, summed over engine workers (failed batches, e.g. OOM, included: that
  time is lost to throughput; without failures it equals ``batch_duration_seconds_sum``). Their
  rate ratio is the per-worker live real-time factor; ``rate(audio_processed)`` alone is the
  throughput in audio seconds per second.
* Batches: with two stages (CPU, app/batching/stages.py) a window goes through an encoder call and then a
  decoder batch. ``batch_size_windows``, ``batches_total{outcome="ok"}`` and ``batch_fill_ratio``
  count the batches that produce transcripts (decoder batches, or single-call ones), so each
  window is counted once; ``batch_duration_seconds`` observes every engine call, encoder calls
  included, so its ``_sum`` stays the engine's busy time.
* ``job_rtf_ratio``: per finished job, decoded audio seconds / (claimed -> done) wall seconds,
  the same number the API reports as the job's ``rtf``; ``job_queue_wait_seconds`` is the API's
  ``queue_wait_s`` (accepted -> claimed); ``queue_wait_seconds`` is a window's wait in the batcher.
* ``backlog_audio_seconds``: audio of the jobs queued or running in the (shared) job store, minus
  what this replica already transcribed of its running jobs. It is store-wide: with several
  replicas each reports the same backlog, so aggregate it with ``max``, not ``sum``.
* ``device_memory_*_bytes``: per GPU (NVML) used/total; on CPU the container's (cgroup) or the
  host's memory used/total. ``engine_memory_bytes``: what this process holds on that device
  (NVML per-process usage on GPU, resident set size on CPU).
* ``live_*``: ``live_turn_latency_seconds`` runs from the server's end of a turn
  (``speech_stopped``: the VAD's silence already waited; or the client's commit) to its
  ``completed``; ``live_stream_lag_seconds`` from the arrival of the message that ended the turn
  (so it adds the audio work of that message); ``live_interim_decodes_total{outcome}`` counts
  interim decodes sent to the batcher and those it shed.
* ``engine_up``: per engine (``cuda:1``), 1 in rotation, 0 out of it or never started (a GPU that
  failed its load or warm-up: the service serves on the others; ``/readyz`` gives the error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from app.engine.device import MemoryReading

# The ``_created`` series double the exposition for no use on dashboards or alerts.
disable_created_metrics()

# Windows per batch: powers of two up to the largest cap we allow by default, plus the odd sizes
# that OOM halving and partial batches produce.
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# One batch on CPU takes ~0.2 s per window in the encoder; GPU batches are 10-100x faster.
BATCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
# Queue wait and job latency span milliseconds (idle) to many minutes (hour-long uploads).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
# Real-time factor = audio seconds / processing seconds: below 1 the service falls behind.
RTF_BUCKETS = (0.5, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# A live turn's final: ~0.2-1 s idle on CPU, seconds when the engine falls behind.
LIVE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """Holds the metric objects; one instance per app."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes: the CPU "device memory"
        PlatformCollector(registry=r)
        p = "batchscribe_"
        self.audio_processed = Counter(
            p + "audio_processed_seconds", "Audio seconds transcribed by the engine.", registry=r
        )
        self.processing = Counter(
            p + "processing_seconds",
            "Wall seconds the engine spent running batches, failed ones included (summed over "
            "workers); "
            "rate(audio_processed)/rate(processing) is the live real-time factor.",
            registry=r,
        )
        self.job_rtf = Histogram(
            p + "job_rtf_ratio", "Per-job real-time factor (audio s / processing s).",
            buckets=RTF_BUCKETS, registry=r,
        )
        self.job_queue_wait = Histogram(
            p + "job_queue_wait_seconds", "Per finished job: accepted until claimed for work.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.job_latency = Histogram(
            p + "job_latency_seconds", "Job submit-to-finish time.", ["status"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.jobs_finished = Counter(
            p + "jobs_finished", "Jobs that ended, by final status.", ["status"], registry=r
        )
        self.jobs = Gauge(p + "jobs", "Jobs known to this replica by status.", ["status"], registry=r)
        self.pending_windows = Gauge(
            p + "queue_pending_windows", "Windows waiting in the batcher.", registry=r
        )
        self.backlog = Gauge(
            p + "backlog_audio_seconds",
            "Audio seconds accepted but not yet transcribed, store-wide: aggregate with max() "
            "across replicas (the autoscaling signal).", registry=r,
        )
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Time a window waited in the batcher before its batch ran.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            p + "batch_size_windows",
            "Windows per batch that produced transcripts (decoder batches with two stages).",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batches = Counter(p + "batches", "Engine batches run, by outcome.", ["outcome"], registry=r)
        self.batch_duration = Histogram(
            p + "batch_duration_seconds",
            "Engine time per successful engine call (with two stages, encoder and decoder calls).",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=r,
        )
        self.engine_call_age = Gauge(
            p + "engine_call_running_seconds",
            "Age of the oldest engine call still running (0 when none): alert well before "
            "batcher.stall_after_s, where /healthz turns 503.", registry=r,
        )
        self.batch_cap = Gauge(
            p + "batch_cap_windows", "Current batch cap (lowered by OOM backoff).", registry=r
        )
        self.oom_events = Counter(p + "oom_events", "Out-of-memory errors from the engine.", registry=r)
        self.interim_shed = Counter(
            p + "interim_shed", "Live interim decodes the batcher gave up on (behind, or "
            "superseded by a newer interim of the same turn).", registry=r)
        self.batch_fill = Histogram(
            p + "batch_fill_ratio",
            "Speech seconds in a batch / (windows x 30 s): how much of the padded input is audio.",
            buckets=FILL_BUCKETS, registry=r,
        )
        self.device_memory_used = Gauge(
            p + "device_memory_used_bytes",
            "Memory in use on the device, all processes (GPU: NVML; cpu: container or host).",
            ["device"], registry=r,
        )
        self.device_memory_total = Gauge(
            p + "device_memory_total_bytes", "Memory of the device in total.", ["device"],
            registry=r,
        )
        self.engine_memory = Gauge(
            p + "engine_memory_bytes",
            "Memory this process (the resident model) holds on the device: NVML per-process "
            "usage on GPU, resident set size on CPU.", ["device"], registry=r,
        )
        self.engine_up = Gauge(
            p + "engine_up",
            "1 while the engine serves, 0 while it is out of rotation or if it failed to start "
            "(its GPU failed the load or the warm-up; /readyz gives the error).", ["engine"],
            registry=r,
        )
        self.model_info = Info(p + "model", "The resident model.", registry=r)
        self.http_requests = Counter(
            p + "http_requests", "HTTP requests by route and status.",
            ["method", "route", "status"], registry=r,
        )
        self.http_duration = Histogram(
            p + "http_request_duration_seconds", "HTTP request time by route.", ["method", "route"],
            buckets=HTTP_BUCKETS, registry=r,
        )
        self.diarization = Histogram(
            p + "diarization_seconds",
            "Per diarized job: wall seconds of its speaker work (segmentation, embeddings and "
            "clustering, waits for shared speaker batches included), which runs beside its "
            "transcription.", buckets=LATENCY_BUCKETS, registry=r,
        )
        self.diarized_audio = Counter(
            p + "diarized_audio_seconds", "Audio seconds of finished diarized jobs.", registry=r
        )
        self.rejected = Counter(
            p + "rejected_requests", "Requests refused before a job was made, by reason.",
            ["reason"], registry=r,
        )
        # Known label values start at 0, so rate(), the error ratios and the dashboard have a
        # series before the first event (Prometheus' advice for labelled counters).
        for status in ("done", "failed", "cancelled"):
            self.jobs_finished.labels(status)
            self.job_latency.labels(status)
        for outcome in ("ok", "oom", "error"):
            self.batches.labels(outcome)
        for reason in ("backlog", "key_audio", "key_jobs"):
            self.rejected.labels(reason)
        self._live(r, p)

    def _live(self, r: CollectorRegistry, p: str) -> None:
        """Live transcription (``/v1/realtime``; see the module doc for what each measures)."""
        self.live_sessions = Gauge(p + "live_sessions_open", "Live sessions open now.", registry=r)
        self.live_refused = Counter(p + "live_sessions_refused", "Live sessions refused, by limit.",
                                    ["reason"], registry=r)
        self.live_turn_latency = Histogram(
            p + "live_turn_latency_seconds", "End of a turn's speech (speech_stopped, or the "
            "commit) to its completed transcript.", buckets=LIVE_BUCKETS, registry=r)
        self.live_interim = Counter(
            p + "live_interim_decodes", "Interim decodes of open turns: sent to the batcher, "
            "and shed by it (dropped, not an error).", ["outcome"], registry=r)
        self.live_lag = Histogram(
            p + "live_stream_lag_seconds", "Per stream, at each completed transcript: how far "
            "its text trails real time (arrival of the message that ended the turn to "
            "completed).", buckets=LIVE_BUCKETS, registry=r)
        for outcome in ("sent", "shed"):
            self.live_interim.labels(outcome)
        for reason in ("total", "key"):
            self.live_refused.labels(reason)

    def watch_outbound(self, in_flight: Callable[[], dict[tuple[str, str | None], int]],
                       cut_offs: Callable[[], dict[tuple[str, str], int]]) -> None:
        """The outbound guard's state, read at each scrape (app/net/slots.py): requests in
        flight per kind and API key, and requests cut off per kind and rule."""
        self.registry.register(_Outbound(in_flight, cut_offs))

    def batch_done(self, windows: int, audio_s: float, window_s: float) -> None:
        """A batch's results are out (two stages: its decode): sizes, fill and audio done."""
        self.batches.labels("ok").inc()
        self.batch_size.observe(windows)
        self.audio_processed.inc(audio_s)
        self.batch_fill.observe(min(1.0, audio_s / (windows * window_s)))

    def record_memory(self, readings: list[MemoryReading]) -> None:
        """Set the device memory gauges from one :class:`DeviceMonitor` reading."""
        for r in readings:
            self.device_memory_used.labels(r.device).set(r.used_bytes)
            self.device_memory_total.labels(r.device).set(r.total_bytes)
            if r.process_bytes is not None:
                self.engine_memory.labels(r.device).set(r.process_bytes)


class _Outbound(Collector):
    """``outbound_in_flight{kind,key}``: ``audio_url`` downloads (``fetch``) and webhook
    deliveries holding a slot now, per API key (its tenant id; ``none`` without keys);
    ``outbound_cut_off_total{kind,rule}``: requests this service cut off: ``min_rate`` (a
    download under ``outbound.min_fetch_rate_bytes_s``), ``deadline``, ``size``, ``busy`` (no
    slot within the deadline)."""

    def __init__(self, in_flight: Callable[[], dict[tuple[str, str | None], int]],
                 cut_offs: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._in_flight, self._cut_offs = in_flight, cut_offs

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("batchscribe_outbound_in_flight", "Outbound requests holding a "
                              "slot now, by kind (fetch, webhook) and API key.",
                              labels=["kind", "key"])
        for kind in ("fetch", "webhook"):  # a series before the first request
            g.add_metric([kind, "none"], 0.0)
        for (kind, key), n in self._in_flight().items():
            g.add_metric([kind, key or "none"], float(n))
        c = CounterMetricFamily("batchscribe_outbound_cut_off", "Outbound requests this service "
                                "cut off, by kind and rule (min_rate, deadline, size, busy).",
                                labels=["kind", "rule"])
        counts = self._cut_offs()
        for rule in ("min_rate", "deadline", "size", "busy"):
            c.add_metric(["fetch", rule], float(counts.get(("fetch", rule), 0)))
        yield g
        yield c
