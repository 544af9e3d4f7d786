"""Liveness, readiness and Prometheus metrics: all answer while a batch is running.

Batches run on the engine's own threads, so these handlers never wait for inference. ``/metrics``
refreshes the point-in-time gauges as it is scraped: pending windows and device memory from
memory/NVML, the backlog and jobs by status from the job store (bounded by a timeout, keeping the
last values when the store is slow, so a scrape never hangs on the database).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import state
from app.state import AppState

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)
STORE_TIMEOUT_S = 2.0  # well under Prometheus' default 10 s scrape timeout


@router.get("/healthz", responses={503: {"description": "An engine call has stalled."}})
async def healthz(request: Request) -> JSONResponse:
    """The process is alive: its event loop answers and no engine call has run for longer than
    ``batcher.stall_after_s``. A hung call never returns and cannot be cancelled from Python, so
    the way out is a restart (liveness probe), after which its jobs are requeued."""
    st: AppState | None = getattr(request.app.state, "bs", None)  # None while the model loads
    if st is not None and (running := st.batcher.oldest_call_s()) > st.settings.batcher.stall_after_s:
        log.error("engine call running for %.0f s: reporting unhealthy", running)
        return JSONResponse({"status": "engine_stalled", "engine_call_running_s": round(running)},
                            status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", responses={503: {"description": "Loading the model, or draining."}})
async def readyz(st: AppState = Depends(state)) -> JSONResponse:
    """Ready to take work: the model is loaded and the service is not draining."""
    info = st.engine.engine.info
    body = {"status": "ready" if st.ready else "not_ready", "model": info.model,
            "device": info.device, "compute_type": info.compute_type}
    return JSONResponse(body, status_code=200 if st.ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)  # documents text/plain, not JSON
async def metrics(st: AppState = Depends(state)) -> Response:
    try:
        await asyncio.wait_for(st.runner.refresh_gauges(), STORE_TIMEOUT_S)
    except Exception as exc:  # slow or closed store: serve the maintenance loop's last values
        log.warning("metrics: store gauges not refreshed (%s)", type(exc).__name__)
    st.refresh_gauges()
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
