"""The service's own state: liveness, readiness, Prometheus metrics and GET /status. All answer
while a batch is running: batches run on the engine's own threads, so these handlers never wait
for inference.

``/metrics`` refreshes the point-in-time gauges as it is scraped: pending windows and device
memory from memory/NVML, the backlog and jobs by status from the job store (bounded by a
timeout, keeping the last values when the store is slow, so a scrape never hangs on the
database).

``/status``: the same numbers in one small JSON object, for the page at / (and people), without
a Prometheus server to take rates: backlog, windows waiting, jobs by status, and over the last
minute the throughput (audio seconds per second), the live real-time factor per engine worker
and the mean batch size. Rates come from counter readings the core keeps (app/jobs/speed.py:
one a second at most, for a minute); until one is a few seconds old the figures are since
start-up. No tenant's data is in it: /metrics shows the same.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from app.api.deps import door
from app.jobs.door import Door

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)


@router.get("/healthz", responses={503: {"description": "An engine call has stalled, or the "
                                    "engines keep failing (a GPU in a sticky error state)."}})
async def healthz(request: Request) -> JSONResponse:
    """The process is alive: its event loop answers, no engine call has run for longer than
    ``batcher.stall_after_s``, and its engines are not all failing. A hung call never returns
    and cannot be cancelled from Python, and a GPU in a sticky CUDA error state (an illegal
    memory access) fails every call until the process restarts, so the way out of both is a
    restart (liveness probe), after which their jobs are requeued."""
    d: Door | None = getattr(request.app.state, "door", None)  # None while the model loads
    if d is None:
        return JSONResponse({"status": "ok"})
    health = d.health()
    if health.status == "engine_stalled":
        log.error("engine call running for %.0f s: reporting unhealthy",
                  health.detail["engine_call_running_s"])
    elif health.status == "engine_failing":
        log.error("engines failing: %s: reporting unhealthy", health.detail["reason"])
    return JSONResponse({"status": health.status, **health.detail},
                        status_code=200 if health.status == "ok" else 503)


@router.get("/readyz", responses={503: {"description": "Draining, or the engines are failing."}})
async def readyz(d: Door = Depends(door)) -> JSONResponse:
    """Ready to take work: the model is loaded and warmed up on its device (the lifespan runs the
    warm-up before the server listens), the service is not draining, and its engines are not
    all failing. The body gives the batch sizing the warm-up measured."""
    r = d.readiness()
    body = {"status": "ready" if r.ready else "not_ready", **asdict(r)}
    del body["ready"]
    return JSONResponse(body, status_code=200 if r.ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)  # documents text/plain, not JSON
async def metrics(d: Door = Depends(door)) -> Response:
    return Response(await d.metrics_text(), media_type=CONTENT_TYPE_LATEST)


class Status(BaseModel):
    ready: bool
    model: str
    device: str
    workers: int = Field(description="Engine workers (batches run at once).")
    backlog_s: float = Field(description="Accepted audio not yet transcribed, seconds.")
    pending_windows: int = Field(description="Windows waiting for the engine.")
    jobs: dict[str, int] = Field(description="Jobs in the store by status.")
    span_s: float = Field(description="What the rates below are measured over (seconds).")
    throughput: float | None = Field(description="Audio seconds transcribed per wall second.")
    rtf: float | None = Field(description="Live real-time factor per worker: audio s / engine s.")
    batch_size: float | None = Field(description="Mean windows per batch.")


@router.get("/status", response_model=Status)
async def status(d: Door = Depends(door)) -> Status:
    return Status(**asdict(await d.status()))
