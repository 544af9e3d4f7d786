"""POST /transcribe: spool the upload (or fetch audio_url), validate it, commit the job, answer
202 (or wait). The body is a multipart form, or the same fields as a JSON object with an
``audio_url`` (app/api/json_form.py)."""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app import audio
from app.api import idempotency
from app.api.deps import Caller, caller, job_answer, ready_state
from app.api.json_form import JsonFormRoute
from app.api.limits import admitted
from app.api.schemas import ErrorBody, Job
from app.config import Settings
from app.engine import languages
from app.errors import NO_RETRY, BadRequest, DiarizationOff, InvalidAudio, PayloadTooLarge, ServiceError
from app.jobs.blobs import drop_upload
from app.jobs.runner import new_job_id
from app.jobs.webhooks import check_callback_url
from app.net.fetch import fetch_audio
from app.state import AppState
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


def speaker_options(st: AppState, options: JobOptions, diarize: bool, num_speakers: int | None,
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
        if st.runner.speakers is None:
            raise DiarizationOff("speaker diarization is not available on this service",
                                 field="diarize")
        st.runner.speakers.check()  # off: 400; models that failed to load: 503
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
    """Copy the (already disk-spooled) upload under our own name, enforcing the size limit.
    fsynced: the job row that will point at it is committed only after (blobs.put syncs the
    folder)."""
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


KEPT_FORMAT_CHARS = frozenset("\u200c\u200d")  # zero-width (non-)joiners: parts of emoji and scripts


def clean_name(name: str | None) -> str | None:
    """A client's file name as a display name: control characters (NUL gave a 500 on
    PostgreSQL), unpaired surrogates (not encodable) and invisible format characters (e.g.
    right-to-left overrides, which disguise a name) removed; at most 255 characters."""
    if not name:
        return None
    kept = "".join(c for c in name if unicodedata.category(c) not in ("Cc", "Cs", "Cf")
                   or c in KEPT_FORMAT_CHARS)
    return kept.strip()[:255] or None


async def accept_upload(st: AppState, file: UploadFile | None, options: JobOptions,
                        who: Caller, callback_url: str | None = None,
                        audio_url: str | None = None,
                        check: Callable[[float], None] | None = None,
                        idempotency_key: str | None = None,
                        spool: Spool = spool_upload) -> str:
    """Spool (or fetch ``audio_url``) + probe + backpressure + commit. Returns the job id (the row
    is committed): the new job's, or the first job's when another request with the same
    Idempotency-Key committed first. ``check(duration_s)`` may refuse the upload after the probe.

    ``spool`` copies the upload to its spool path and returns the bytes written (raw PCM uploads
    of the whisper-asr-webservice API are wrapped in a WAV header on the way: app/api/asr.py)."""
    audio_url = (audio_url or "").strip() or None
    if (file is None) == (audio_url is None):
        raise MissingInput("send the audio as a multipart 'file' or name it in 'audio_url' "
                           "(one of the two)", field="file")
    # Both URL checks come before any byte is spooled or fetched.
    callback_url = await check_callback_url(st.settings.webhooks, st.outbound, callback_url)
    job_id = new_job_id()
    # The client's file name is display-only; the spool path is our random id.
    dest = st.spool_dir / job_id
    try:
        if file is not None:
            size = await run_in_threadpool(spool, file, dest, st.settings.limits.max_upload_bytes)
            filename = clean_name(file.filename)
        else:
            assert audio_url is not None
            fetched = await fetch_audio(st.settings, st.outbound, audio_url, dest)
            size, filename = fetched.size, clean_name(fetched.filename)
            options = replace(options, audio_url=fetched.url)
        if size == 0:
            raise InvalidAudio("the uploaded file is empty")
        info = await run_in_threadpool(audio.probe, dest, st.settings.limits.max_audio_s)
        if check is not None:
            check(info.duration_s)
        job_options = options
        async with admitted(st, info.duration_s, who.owner):  # 429 past the backlog bounds
            first = await idempotency.commit(
                st, who.owner, idempotency_key,
                lambda key: st.runner.submit(job_id, dest, filename, job_options,
                                             info.duration_s, who.owner, callback_url,
                                             idempotency_key=key))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    if first is not None:  # a concurrent request with this key won: this upload is not needed
        await drop_upload(st.runner.blobs, st.runner.blobs.key(dest))
        dest.unlink(missing_ok=True)
        return first
    return job_id


class MissingInput(ServiceError):
    status_code = 422
    error_type = "invalid_request"


@router.post("/transcribe", status_code=202, response_model=Job, responses=ERRORS)
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
    st: AppState = Depends(ready_state),
    who: Caller = Depends(caller),
) -> JSONResponse:
    # A key already known was answered before the body was read (idempotency.IdempotencyGate).
    key = idempotency.parse_key(idempotency_key)
    options = decode_options(st.settings, language, task, beam_size, initial_prompt, temperature,
                             word_timestamps, hotwords, language_detection)
    options = speaker_options(st, options, diarize, num_speakers, min_speakers, max_speakers,
                              channels)
    job_id = await accept_upload(st, file, options, who, callback_url, audio_url,
                                 idempotency_key=key)
    return await job_answer(st, job_id, wait)
