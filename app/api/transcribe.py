"""POST /transcribe: check the request, hand its audio to the door (which spools or fetches it,
probes it, admits it and commits the job), answer 202 (or wait). The body is a multipart form,
or the same fields as a JSON object with an ``audio_url`` (app/api/json_form.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse

from app.api import idempotency
from app.api.deps import Caller, caller, job_answer, ready_door
from app.api.json_form import JsonFormRoute
from app.api.schemas import ErrorBody, Job
from app.config import Settings
from app.engine import languages
from app.errors import NO_RETRY, BadRequest, PayloadTooLarge, ServiceError
from app.jobs.door import MAX_KNOWN, PART_BYTES, Door, Upload
from app.windows import JobOptions

router = APIRouter(tags=["transcription"], route_class=JsonFormRoute)

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (400, 413, 415, 422, 429, 502, 503)
}


HOTWORDS_HELP = ("Words or phrases to bias the transcript towards (names, jargon), as in "
                 "faster-whisper: added to each window's prompt.")
Spool = Callable[[UploadFile, Path, int], int]
MAX_SPEAKERS = 20  # bound on num/min/max_speakers (clustering itself has none)
DIARIZE_HELP = ("Who spoke when: speaker (SPEAKER_00, SPEAKER_01, ...) on segments and words, "
                "segments split at speaker turns. Speaker models on CPU, loaded on first use.")
CHANNELS_HELP = ("separate: transcribe each channel of a multichannel upload (a call recording) "
                 "on its own, speaker = channel_0, channel_1, ..., merged in time order; a mono "
                 "upload is its one channel. mix (default): one mono downmix.")


def speaker_options(d: Door, options: JobOptions, diarize: bool, num_speakers: int | None,
                    min_speakers: int | None, max_speakers: int | None,
                    channels: str = "mix") -> JobOptions:
    """The request's speaker options on top of ``options``, checked: 400 for combinations
    that cannot be met, before anything is uploaded."""
    asked = {"num_speakers": num_speakers, "min_speakers": min_speakers,
             "max_speakers": max_speakers}
    given = [k for k, v in asked.items() if v is not None]
    if given and not diarize:
        raise BadRequest(f"{given[0]} needs diarize=true", field=given[0], headers=NO_RETRY)
    lo, hi = min_speakers or 1, max_speakers or MAX_SPEAKERS
    if lo > hi:
        raise BadRequest(f"min_speakers ({min_speakers}) > max_speakers ({max_speakers})",
                         field="min_speakers", headers=NO_RETRY)
    if num_speakers is not None and not lo <= num_speakers <= hi:
        raise BadRequest(f"num_speakers ({num_speakers}) is outside min_speakers..max_speakers",
                         field="num_speakers", headers=NO_RETRY)
    if diarize and channels == "separate":
        raise BadRequest("channels=separate labels speakers by channel; it cannot be combined "
                         "with diarize=true", field="channels", headers=NO_RETRY)
    if diarize:
        d.check_speakers()  # off: 400; models that failed to load: 503
    return replace(options, diarize=diarize, num_speakers=num_speakers,
                   min_speakers=min_speakers, max_speakers=max_speakers,
                   channels=channels)  # type: ignore[arg-type]


def decode_options(settings: Settings, language: str | None, task: str, beam_size: int | None,
                   initial_prompt: str | None, temperature: float = 0.0,
                   word_timestamps: bool = False, hotwords: str | None = None,
                   language_detection: str = "per_upload") -> JobOptions:
    lang = (language or "").strip().lower() or None
    if lang is not None and lang not in languages.CODES:
        raise BadRequest(f"unknown language {language!r}; use an ISO 639-1 code such as 'en'",
                         field="language")
    beam, other = languages.default_beams(lang, beam_size, settings.default_beam_size,
                                          settings.default_beam_size_other)
    if temperature > 0:
        other = None  # sampling ignores the beam: no second generate per batch for it
    return JobOptions(
        language=lang, task=task,  # type: ignore[arg-type]
        beam_size=beam, other_beam_size=other,
        initial_prompt=(initial_prompt or "").strip() or None,
        hotwords=" ".join((hotwords or "").split()) or None,
        temperature=float(temperature), word_timestamps=word_timestamps,
        language_detection=language_detection,  # type: ignore[arg-type]
    )


def spool_upload(src: UploadFile, dest: Path, max_bytes: int) -> int:
    """Copy the (already disk-spooled) upload to the path the core gave, enforcing the size
    limit. fsynced: the job row that will point at it is committed only after (blobs.put syncs
    the folder). Blocking: the core runs it on a worker thread."""
    size = 0
    with dest.open("wb") as out:
        while block := src.file.read(1 << 20):
            size += len(block)
            if size > max_bytes:
                raise PayloadTooLarge(f"upload exceeds the limit of {max_bytes} bytes",
                                      limit_bytes=max_bytes)
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    return size


async def accept_upload(d: Door, file: UploadFile | None, options: JobOptions, who: Caller,
                        callback_url: str | None = None, audio_url: str | None = None,
                        check: Callable[[float], None] | None = None,
                        idempotency_key: str | None = None, spool: Spool = spool_upload) -> str:
    """Hand the request's audio (a ``file`` or an ``audio_url``) to the door, once: the job id
    it committed, or the first job's when another request with the same Idempotency-Key
    committed first. ``check(duration_s)`` may refuse the upload after the probe.

    ``spool`` copies the upload to the path the core gives and returns the bytes written (raw
    PCM uploads of the whisper-asr-webservice API are wrapped in a WAV header on the way:
    app/api/asr.py)."""
    audio_url = (audio_url or "").strip() or None
    if (file is None) == (audio_url is None):
        raise MissingInput("send the audio as a multipart 'file' or name it in 'audio_url' "
                           "(one of the two)", field="file")
    return await d.submit(Upload(
        options, who.owner, write=partial(spool, file) if file is not None else None,
        filename=file.filename if file is not None else None, audio_url=audio_url,
        callback_url=callback_url, idempotency_key=idempotency_key, check=check))


class MissingInput(ServiceError):
    status_code = 422
    error_type = "invalid_request"


@router.post("/transcribe", status_code=202, response_model=Job, responses=ERRORS,
             form_limits={"max_files": 1 + MAX_KNOWN})  # the upload and references
async def transcribe(
    request: Request,
    file: Annotated[UploadFile | None, File(
        description="Audio: wav, flac, mp3, ogg, m4a, webm. Or audio_url instead.")] = None,
    language: Annotated[str | None, Form(description="ISO 639-1; detected when absent.")] = None,
    language_detection: Annotated[Literal["per_upload", "per_window"], Form(
        description="Without a language: per_upload (the first speech decides for the whole "
        "upload) or per_window (each <= 30 s window its own: recordings that switch language; "
        "each segment carries its language).")] = "per_upload",
    task: Annotated[Literal["transcribe", "translate"], Form()] = "transcribe",
    beam_size: Annotated[int | None, Form(ge=1, le=10)] = None,
    initial_prompt: Annotated[str | None, Form(max_length=1000)] = None,
    hotwords: Annotated[str | None, Form(max_length=1000, description=HOTWORDS_HELP)] = None,
    temperature: Annotated[float, Form(ge=0, le=1, description="0: beam/greedy; > 0: sampling.")] = 0.0,
    word_timestamps: Annotated[bool, Form(description="Add word start/end times.")] = False,
    diarize: Annotated[bool, Form(description=DIARIZE_HELP)] = False,
    num_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: exactly this many speakers.")] = None,
    min_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: at least this many speakers.")] = None,
    max_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: at most this many speakers.")] = None,
    channels: Annotated[Literal["mix", "separate"], Form(description=CHANNELS_HELP)] = "mix",
    known_speaker_names: Annotated[list[str] | None, Form(
        description="diarize: names of known speakers, one per reference file, in order.")] = None,
    known_speaker_references: Annotated[list[UploadFile] | None, File(
        description="diarize: a clip of each known speaker alone (1.5-30 s; 2-10 s is plenty); "
        "speakers who match one are named after it (result.diarization.known_speakers: how "
        "similar each was).")] = None,
    callback_url: Annotated[str | None, Form(
        max_length=2048, description="POSTed the signed job summary when it ends (webhooks on).",
    )] = None,
    audio_url: Annotated[str | None, Form(
        max_length=2048, description="Instead of a file: an http(s):// or s3:// URL the service "
        "fetches (size and duration limits apply while it streams; private addresses only where "
        "the operator allows them).",
    )] = None,
    wait: Annotated[bool, Query(description="Answer with the finished job (200).")] = False,
    idempotency_key: idempotency.KeyHeader = None,
    d: Door = Depends(ready_door),
    who: Caller = Depends(caller),
) -> JSONResponse:
    # A key already known was answered before the body was read (idempotency.IdempotencyGate).
    key = idempotency.parse_key(idempotency_key)
    # The form takes 1 + MAX_KNOWN files (the references), but one audio file: FastAPI would keep
    # the last of several silently. The parsed form is cached: this reads nothing again.
    sent = len((await request.form()).getlist("file"))
    if sent > 1:
        raise BadRequest(f"one audio file per request: {sent} files were sent", field="file",
                         headers=NO_RETRY)
    options = decode_options(d.settings, language, task, beam_size, initial_prompt, temperature,
                             word_timestamps, hotwords, language_detection)
    options = speaker_options(d, options, diarize, num_speakers, min_speakers, max_speakers,
                              channels)
    if known_speaker_names or known_speaker_references:
        if not diarize:
            raise BadRequest("known speakers name diarized speakers: they need diarize=true",
                             field="known_speaker_references", headers=NO_RETRY)
        clips = [await f.read(PART_BYTES + 1) for f in known_speaker_references or []]
        if any(len(c) > PART_BYTES for c in clips):
            raise BadRequest(f"a reference clip is over {PART_BYTES >> 20} MB",
                             field="known_speaker_references", headers=NO_RETRY)
        known = await d.known_speakers(known_speaker_names or [], clips, "known_speaker_names",
                                       "known_speaker_references", who.owner)
        options = replace(options, known_speakers=known)
    job_id = await accept_upload(d, file, options, who, callback_url, audio_url,
                                 idempotency_key=key)
    return await job_answer(d, job_id, who.owner, wait)
