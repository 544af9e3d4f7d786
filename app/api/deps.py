"""What every family's routes take from a request: the door, the caller, a job lookup, and the
subtitle cue options (the same on every route that renders subtitles)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Form, Query, Request

from app.errors import NotFound, NotReady
from app.jobs.door import Door, JobView
from app.results.formats import LINE_CHARS, CueOptions


def door(request: Request) -> Door:
    d: Door = request.app.state.door
    return d


def ready_door(request: Request) -> Door:
    d = door(request)
    if not d.ready:
        raise NotReady("the model is not loaded yet, or the service is shutting down")
    return d


@dataclass
class Caller:
    owner: str | None  # the API key's id; None when keys are off


def caller(request: Request) -> Caller:
    return Caller(getattr(request.state, "owner", None))


async def load_job(d: Door, job_id: str, who: Caller) -> JobView:
    job = await d.get(job_id, who.owner)
    if job is None:  # or another tenant's: "not found", not "forbidden", ids must not leak
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    return job


# Subtitle cue options (srt, vtt, tsv), the same on every route that renders subtitles.
WIDTH_HELP = "Characters per subtitle line (srt, vtt)."
COUNT_HELP = "Lines per cue; a longer segment becomes several cues (srt, vtt, tsv). Unset: no limit."
CUE_S_HELP = "Longest cue in seconds; a longer segment becomes several cues (srt, vtt, tsv)."


def cue_query(
    max_line_width: Annotated[int, Query(ge=10, le=1000, description=WIDTH_HELP)] = LINE_CHARS,
    max_line_count: Annotated[int | None, Query(ge=1, le=20, description=COUNT_HELP)] = None,
    max_cue_s: Annotated[float | None, Query(ge=1, le=600, description=CUE_S_HELP)] = None,
) -> CueOptions:
    return CueOptions(max_line_width, max_line_count, max_cue_s)


def cue_form(
    max_line_width: Annotated[int, Form(ge=10, le=1000, description=WIDTH_HELP)] = LINE_CHARS,
    max_line_count: Annotated[int | None, Form(ge=1, le=20, description=COUNT_HELP)] = None,
    max_cue_s: Annotated[float | None, Form(ge=1, le=600, description=CUE_S_HELP)] = None,
) -> CueOptions:
    return CueOptions(max_line_width, max_line_count, max_cue_s)
