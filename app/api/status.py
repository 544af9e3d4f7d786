"""GET /status: the service's state in one small JSON object, for the page at / (and people).

The same numbers as /metrics, without a Prometheus server to take rates: backlog, windows
waiting, jobs by status, and over the last minute the throughput (audio seconds per second), the
live real-time factor per engine worker and the mean batch size. Rates come from counter
readings this route keeps (one a second at most, for ``SPAN_S``); until one is a few seconds
old the figures are since start-up. No tenant's data is in it: /metrics shows the same.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import PurePath

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.api.deps import state
from app.state import AppState

router = APIRouter(tags=["health"])
SPAN_S = 60.0  # rates over about the last minute
MIN_SPAN_S = 3.0  # a younger reading gives rates too noisy to show
STORE_TIMEOUT_S = 2.0


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


@dataclass(frozen=True)
class _Reading:
    at: float
    audio: float
    busy: float
    windows: float
    batches: float


class Speedometer:
    """Counter readings of the last ``SPAN_S`` seconds; rates against the oldest."""

    def __init__(self) -> None:
        self.readings: deque[_Reading] = deque()

    def read(self, st: AppState) -> tuple[float, float | None, float | None, float | None]:
        get = st.metrics.registry.get_sample_value
        now = _Reading(time.monotonic(), get("batchscribe_audio_processed_seconds_total") or 0.0,
                       get("batchscribe_processing_seconds_total") or 0.0,
                       get("batchscribe_batch_size_windows_sum") or 0.0,
                       get("batchscribe_batch_size_windows_count") or 0.0)
        r = self.readings
        if not r or now.at - r[-1].at >= 1.0:
            r.append(now)
        while len(r) > 1 and now.at - r[1].at >= SPAN_S:
            r.popleft()
        base = r[0] if now.at - r[0].at >= MIN_SPAN_S else None
        span = now.at - base.at if base else 0.0
        audio = now.audio - (base.audio if base else 0.0)
        busy = now.busy - (base.busy if base else 0.0)
        windows = now.windows - (base.windows if base else 0.0)
        batches = now.batches - (base.batches if base else 0.0)
        return (round(span, 1),
                round(audio / span, 2) if base else None,
                round(audio / busy, 2) if busy > 0 else None,
                round(windows / batches, 2) if batches > 0 else None)


@router.get("/status", response_model=Status)
async def status(st: AppState = Depends(state)) -> Status:
    meter = st.extras.get("speedometer")
    if not isinstance(meter, Speedometer):
        meter = st.extras["speedometer"] = Speedometer()
    span, throughput, rtf, batch = meter.read(st)
    try:
        jobs = await asyncio.wait_for(st.store.counts(), STORE_TIMEOUT_S)
        backlog = await asyncio.wait_for(st.runner.backlog.seconds(1.0), STORE_TIMEOUT_S)
    except Exception:  # a slow store must not hang the page: show what memory holds
        jobs, backlog = {}, st.runner.backlog.admitting_s
    info = st.engine.engine.info
    return Status(ready=st.ready, model=PurePath(info.model).name, device=info.device,
                  workers=st.engine.workers, backlog_s=round(backlog, 1),
                  pending_windows=st.batcher.pending(), jobs=jobs,
                  span_s=span, throughput=throughput, rtf=rtf, batch_size=batch)
