"""An OpenAI audio request run through the door: the model named checked, the upload made a job
(or a replayed one found), the job waited for (or streamed), and its result in the format asked.

Clients that retry: the OpenAI SDK resends the whole upload on 408/409/429/5xx and on its own
600 s time-out, unless the answer says ``x-should-retry: false``. So every answer no retry can
change says so; the request is answered within ``limits.openai_wait_s``, audio too long to
finish in that time at the current speed is refused up front (413), and a job still running at
the deadline is cancelled, never left running behind a 504 while the SDK uploads it again.
"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.api import idempotency
from app.api.deps import Caller
from app.api.errors import ModelNotFound, openai_reply, status_of
from app.api.openai import stream as sse
from app.api.openai.protocol import ALIASES, TranscriptionRequest, chunking_fields, parse_chunking
from app.api.uploads import accept_upload, decode_options, speaker_options
from app.api.waiting import ended_or_gone
from app.errors import PayloadTooLarge, public_error
from app.jobs.door import Door, JobView
from app.results.formats import MEDIA_TYPES, render
from app.results.openai import ModelCard, diarized_json, verbose_json

STARTED = int(time.time())  # the model card's "created": when this process loaded it
SPEED_MARGIN = 0.8  # of the measured speed: the estimate must not promise what it cannot keep
JOB_HEADER = "X-Batchscribe-Job-Id"


def check_model(d: Door, model: str) -> None:
    if model not in (d.model_name(), *ALIASES):
        raise ModelNotFound(f"The model `{model}` does not exist; this service runs "
                            f"`{d.model_name()}` (also reachable as {', '.join(ALIASES)}).",
                            field="model")


def card(d: Door) -> ModelCard:
    return ModelCard(id=d.model_name(), created=STARTED, owned_by="batchscribe")


async def chunking(request: Request, d: Door, raw: str | None) -> dict[str, float] | None:
    """``chunking_strategy`` (a string, or the ``chunking_strategy[...]`` fields the openai
    client sends) as the request's VAD settings; 400 naming the field when invalid or when this
    service's VAD cannot take them."""
    form = await request.form()  # parsed already for the route: Starlette's cached copy
    settings = parse_chunking(raw, chunking_fields(form))
    d.check_chunking(settings)
    return settings


async def transcribe(request: Request, d: Door, who: Caller,
                     req: TranscriptionRequest) -> Response:
    """Run the request: 200 with the transcript, the stream, or the error no retry changes."""
    key = req.idempotency_key
    check_model(d, req.model)
    req.check()
    options = decode_options(d.settings, req.language, req.task, None, req.prompt,
                             req.temperature, req.aligned, req.hotwords)
    options = replace(options, logprobs=req.logprobs, vad=req.vad)
    if req.fmt == "diarized_json":
        options = speaker_options(d, options, True, None, None, None)
        options = replace(options, known_speakers=req.known)
    wait_s = min(d.settings.limits.sync_timeout_s, d.settings.limits.openai_wait_s)
    first = await d.replay(who.owner, key) if key else None
    job_id = first.id if first else await accept_upload(
        d, req.file, options, who.owner,
        check=None if req.stream else lambda s: _fits(d, s, wait_s), idempotency_key=key)
    if req.stream:  # issue 21: no deadline, the client sees text as windows finish
        return sse.stream_response(d, job_id, who.owner, {JOB_HEADER: job_id}, req.logprobs)
    # With a key the job outlives this request: the client's retry (same key) collects it.
    row = await _wait(request, d, job_id, who.owner, wait_s, cancel_if_gone=key is None)
    headers = {JOB_HEADER: job_id}
    if first is not None:
        headers[idempotency.REPLAYED] = "true"
    if row is not None and not row.ended and d.stopped:
        # Draining: the client will retry elsewhere, so a keyless copy must not run after the
        # restart; a keyed one stays queued for the retry to find.
        if key is None:
            await d.cancel(job_id, who.owner)
        return openai_reply(503, "the service is restarting; retry the request",
                            code="shutting_down", headers={**headers, "Retry-After": "1"})
    if row is not None and not row.ended:
        # Nobody can collect a synchronous answer later, and the SDK would upload the file
        # again after its own time-out: the job is cancelled, the answer says where to go.
        await d.cancel(job_id, who.owner)
        return openai_reply(
            504, f"the transcription did not finish within {wait_s:.0f} s, this service's "
            "limit for a synchronous /v1 request (under the OpenAI SDK's 600 s time-out); it "
            "was cancelled. Send long audio to POST /transcribe and poll GET /jobs/{id}.",
            code="sync_timeout", headers={**headers, "x-should-retry": "false"})
    if row is None or row.status != "done" or row.result is None:
        return _unfinished(job_id, row, headers)
    return _answer(row, req, headers)


def _answer(row: JobView, req: TranscriptionRequest, headers: dict[str, str]) -> Response:
    """A done job's result in the request's ``response_format``."""
    result = row.result or {}
    extra = {"logprobs": result.get("logprobs") or []} if req.logprobs else {}
    if req.fmt == "json":
        return JSONResponse({"text": result["text"], **extra}, headers=headers)
    if req.fmt == "verbose_json":
        return JSONResponse({**verbose_json(result, req.task, "word" in req.granularities),
                             **extra}, headers=headers)
    if req.fmt == "diarized_json":
        return JSONResponse(diarized_json(result), headers=headers)
    return PlainTextResponse(render(result, req.fmt, req.cue), media_type=MEDIA_TYPES[req.fmt],
                             headers=headers)


def _fits(d: Door, audio_s: float, wait_s: float) -> None:
    """413 (no retry can fix it) for audio the service cannot transcribe within ``wait_s`` at
    its current speed: refused before it runs, not after the client waited for nothing."""
    most = wait_s * d.speed() * SPEED_MARGIN
    if audio_s > most:
        raise PayloadTooLarge(
            f"{audio_s:.0f} s of audio is more than this service transcribes within {wait_s:.0f} s "
            f"(its limit for a synchronous /v1 request, at about {most:.0f} s of audio now); send "
            "it to POST /transcribe and poll GET /jobs/{id}, or ask for stream=true",
            limit_s=round(most, 1), duration_s=round(audio_s, 3), field="file")


async def _wait(request: Request, d: Door, job_id: str, owner: str | None, wait_s: float,
                cancel_if_gone: bool = True) -> JobView | None:
    """Wait for the job (at most ``wait_s``); stop waiting as soon as the client disconnects,
    and then cancel the job unless ``cancel_if_gone`` is off."""
    row, left = await ended_or_gone(request, d, job_id, owner, wait_s)
    if cancel_if_gone and left and row is not None and not row.ended:
        await d.cancel(job_id, owner)
    return row


def _unfinished(job_id: str, row: JobView | None, headers: dict[str, str]) -> Response:
    """A job that ended without a transcript. Sending the same audio again gives the same
    answer (audio found undecodable while it was prepared is a 4xx, as at upload), so no
    retry: the SDK would otherwise make a new job per retry."""
    final = {**headers, "x-should-retry": "false"}
    if row is not None and row.status == "failed":
        err = public_error(row.error) or {}
        kind = str(err.get("type", "internal_error"))
        return openai_reply(status_of(kind), str(err.get("message", "transcription failed")),
                            code=kind, headers=final)
    gone = "was cancelled" if row is not None else "no longer exists"
    return openai_reply(409, f"job {job_id} {gone}", code="cancelled", headers=final)
