"""Liveness, readiness and Prometheus metrics: all answer while a batch is running."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import state
from app.state import AppState

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive and its event loop answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(st: AppState = Depends(state)) -> JSONResponse:
    """Ready to take work: the model is loaded and the service is not draining."""
    info = st.engine.engine.info
    body = {"status": "ready" if st.ready else "not_ready", "model": info.model,
            "device": info.device, "compute_type": info.compute_type}
    return JSONResponse(body, status_code=200 if st.ready else 503)


@router.get("/metrics")
async def metrics(st: AppState = Depends(state)) -> Response:
    st.refresh_gauges()
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
