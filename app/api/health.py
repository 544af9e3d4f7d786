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


@router.get("/healthz", responses={503: {"description": "An engine call has stalled, or the "
                                    "engines keep failing (a GPU in a sticky error state)."}})
async def healthz(request: Request) -> JSONResponse:
    """The process is alive: its event loop answers, no engine call has run for longer than
    ``batcher.stall_after_s``, and its engines are not all failing. A hung call never returns
    and cannot be cancelled from Python, and a GPU in a sticky CUDA error state (an illegal
    memory access) fails every call until the process restarts, so the way out of both is a
    restart (liveness probe), after which their jobs are requeued."""
    st: AppState | None = getattr(request.app.state, "bs", None)  # None while the model loads
    if st is None:
        return JSONResponse({"status": "ok"})
    if (running := st.batcher.oldest_call_s()) > st.settings.batcher.stall_after_s:
        log.error("engine call running for %.0f s: reporting unhealthy", running)
        return JSONResponse({"status": "engine_stalled", "engine_call_running_s": round(running)},
                            status_code=503)
    if (reason := st.engine.unhealthy()) is not None:
        log.error("engines failing: %s: reporting unhealthy", reason)
        return JSONResponse({"status": "engine_failing", "reason": reason,
                             "engines": st.engine.status()}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", responses={503: {"description": "Draining, or the engines are failing."}})
async def readyz(st: AppState = Depends(state)) -> JSONResponse:
    """Ready to take work: the model is loaded and warmed up on its device (the lifespan runs the
    warm-up before the server listens), the service is not draining, and its engines are not
    all failing. The body gives the batch sizing the warm-up measured."""
    info = st.engine.engine.info
    ready = st.ready and st.engine.unhealthy() is None
    body = {"status": "ready" if ready else "not_ready", "model": info.model,
            "device": info.device, "compute_type": info.compute_type,
            "engines": st.engine.status(), "sizing": st.extras.get("sizing")}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)  # documents text/plain, not JSON
async def metrics(st: AppState = Depends(state)) -> Response:
    try:
        await asyncio.wait_for(st.runner.refresh_gauges(), STORE_TIMEOUT_S)
    except Exception as exc:  # slow or closed store: serve the maintenance loop's last values
        log.warning("metrics: store gauges not refreshed (%s)", type(exc).__name__)
    st.refresh_gauges()
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
