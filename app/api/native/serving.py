"""The native job API's work with the door: a request made into a job, and a job made into an
answer (the job itself, its result in six formats, or the job once it ended).

The routes (app/api/native/api_router.py) parse and call these; the IdempotencyGate middleware
(app/api/middleware/idempotency.py) answers a replayed ``POST /transcribe`` with
:func:`job_answer` too, as the route would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath

from fastapi import UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.api.deps import Caller
from app.api.native.protocol import to_job
from app.api.uploads import accept_upload, decode_options, speaker_options
from app.errors import BadRequest, Conflict, NotFound, public_error
from app.jobs.door import Door, JobView
from app.results.formats import MEDIA_TYPES, CueOptions, Format, render, to_rttm
from app.speakers.limits import PART_BYTES


@dataclass(frozen=True)
class TranscribeRequest:
    """``POST /transcribe``'s fields, as the form (or its JSON body) gave them."""

    file: UploadFile | None
    audio_url: str | None
    language: str | None
    language_detection: str
    task: str
    beam_size: int | None
    initial_prompt: str | None
    hotwords: str | None
    temperature: float
    word_timestamps: bool
    diarize: bool
    num_speakers: int | None
    min_speakers: int | None
    max_speakers: int | None
    channels: str
    known_speaker_names: Sequence[str]
    known_speaker_references: Sequence[UploadFile]
    callback_url: str | None
    wait: bool
    idempotency_key: str | None  # parsed


async def start_job(d: Door, who: Caller, req: TranscribeRequest) -> JSONResponse:
    """Check the request, hand its audio to the door (which spools or fetches it, probes it,
    admits it and commits the job), answer 202 (or wait)."""
    options = decode_options(d.settings, req.language, req.task, req.beam_size,
                             req.initial_prompt, req.temperature, req.word_timestamps,
                             req.hotwords, req.language_detection)
    options = speaker_options(d, options, req.diarize, req.num_speakers, req.min_speakers,
                              req.max_speakers, req.channels)
    if req.known_speaker_names or req.known_speaker_references:
        if not req.diarize:
            raise BadRequest("known speakers name diarized speakers: they need diarize=true",
                             field="known_speaker_references", no_retry=True)
        clips = [await f.read(PART_BYTES + 1) for f in req.known_speaker_references]
        if any(len(c) > PART_BYTES for c in clips):
            raise BadRequest(f"a reference clip is over {PART_BYTES >> 20} MB",
                             field="known_speaker_references", no_retry=True)
        known = await d.known_speakers(req.known_speaker_names, clips, "known_speaker_names",
                                       "known_speaker_references", who.owner)
        options = replace(options, known_speakers=known)
    job_id = await accept_upload(d, req.file, options, who.owner, req.callback_url,
                                 req.audio_url, idempotency_key=req.idempotency_key)
    return await job_answer(d, job_id, who.owner, req.wait)


async def job_answer(d: Door, job_id: str, owner: str | None, wait: bool,
                     replayed: bool = False) -> JSONResponse:
    """POST /transcribe's answer for a committed job: 202 with the job, or with ``wait`` the job
    once it ends (200), or as it stands when the wait times out (202). ``replayed``: the job was
    made by an earlier request with the same Idempotency-Key (app/api/idempotency.py)."""
    if wait:
        # On timeout the job keeps running; the client gets 202 and polls status_url.
        with d.follow(job_id, owner) as sub:
            await sub.until_over(d.settings.limits.sync_timeout_s)
    view = await d.get(job_id, owner)
    if view is None:  # expired between its commit (or lookup) and now
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    job = to_job(view)
    headers = {"Location": job.status_url}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    code = 200 if wait and view.ended else 202
    return JSONResponse(job.model_dump(mode="json"), status_code=code, headers=headers)


def result_answer(job: JobView, fmt: Format, cue: CueOptions) -> Response:
    """A done job's result in ``fmt``; 409 while it is not done (with its error once failed),
    400 for speaker turns (rttm) of a job that was not diarized."""
    if job.status != "done" or job.result is None:
        raise Conflict(f"job {job.id} is {job.status}; the result exists once it is done",
                       status=job.status, error=public_error(job.error))
    if fmt == "json":
        return JSONResponse(job.result)
    if fmt == "rttm":  # the speaker turns, named after the upload (scorers match by file id)
        if job.result.get("turns") is None:
            raise BadRequest("format=rttm gives speaker turns: the job needs diarize=true",
                             field="format")
        uri = PurePath(job.filename or job.id).stem or job.id
        return PlainTextResponse(to_rttm(job.result, uri), media_type=MEDIA_TYPES[fmt])
    return PlainTextResponse(render(job.result, fmt, cue), media_type=MEDIA_TYPES[fmt])
