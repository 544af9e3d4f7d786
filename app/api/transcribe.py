"""POST /transcribe: spool the upload, validate it, commit the job, answer 202 (or wait)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app import audio
from app.api import idempotency
from app.api.deps import Caller, caller, job_answer, ready_state
from app.api.limits import admitted
from app.errors import BadRequest, InvalidAudio, PayloadTooLarge
from app.jobs.runner import new_job_id
from app.jobs.webhooks import check_callback_url
from app.schemas import ErrorBody, Job
from app.state import AppState
from app.windows import JobOptions

router = APIRouter(tags=["transcription"])

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (400, 413, 415, 422, 429, 503)
}


def whisper_languages() -> frozenset[str]:
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    return frozenset(_LANGUAGE_CODES)


HOTWORDS_HELP = ("Words or phrases to bias the transcript towards (names, jargon), as in "
                 "faster-whisper: added to each window's prompt.")
Spool = Callable[[UploadFile, Path, int], int]


def decode_options(st: AppState, language: str | None, task: str, beam_size: int | None,
                   initial_prompt: str | None, temperature: float = 0.0,
                   word_timestamps: bool = False, hotwords: str | None = None,
                   language_detection: str = "per_upload") -> JobOptions:
    lang = (language or "").strip().lower() or None
    if lang is not None and lang not in st.languages:
        raise BadRequest(f"unknown language {language!r}; use an ISO 639-1 code such as 'en'",
                         field="language")
    return JobOptions(
        language=lang, task=task,  # type: ignore[arg-type]
        beam_size=beam_size or st.settings.default_beam_size,
        initial_prompt=(initial_prompt or "").strip() or None,
        hotwords=" ".join((hotwords or "").split()) or None,
        temperature=float(temperature), word_timestamps=word_timestamps,
        language_detection=language_detection,  # type: ignore[arg-type]
    )


def spool_upload(src: UploadFile, dest: Path, max_bytes: int) -> int:
    """Copy the (already disk-spooled) upload under our own name, enforcing the size limit."""
    size = 0
    with dest.open("wb") as out:
        while block := src.file.read(1 << 20):
            size += len(block)
            if size > max_bytes:
                raise PayloadTooLarge(f"upload exceeds the limit of {max_bytes} bytes",
                                      limit_bytes=max_bytes)
            out.write(block)
    return size


async def accept_upload(st: AppState, file: UploadFile, options: JobOptions,
                        who: Caller, callback_url: str | None = None,
                        idempotency_key: str | None = None,
                        spool: Spool = spool_upload) -> str:
    """Spool + probe + backpressure + commit. Returns the job id (the row is committed): the new
    job's, or the first job's when another request with the same Idempotency-Key committed first.

    ``spool`` copies the upload to its spool path and returns the bytes written (raw PCM uploads
    of the whisper-asr-webservice API are wrapped in a WAV header on the way: app/api/asr.py)."""
    callback_url = check_callback_url(st.settings.webhooks, callback_url)  # before any spooling
    job_id = new_job_id()
    # The client's file name is display-only; the spool path is our random id.
    dest = st.spool_dir / job_id
    try:
        size = await run_in_threadpool(spool, file, dest, st.settings.limits.max_upload_bytes)
        if size == 0:
            raise InvalidAudio("the uploaded file is empty")
        info = await run_in_threadpool(audio.probe, dest, st.settings.limits.max_audio_s)
        async with admitted(st, info.duration_s):  # 429 past the backlog bound
            first = await idempotency.commit(
                st, who.owner, idempotency_key,
                lambda key: st.runner.submit(job_id, dest, (file.filename or "")[:255] or None,
                                             options, info.duration_s, who.owner, callback_url,
                                             idempotency_key=key))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    if first is not None:  # a concurrent request with this key won: this upload is not needed
        await st.runner.drop_upload(st.runner.blobs.key(dest))
        dest.unlink(missing_ok=True)
        return first
    return job_id


@router.post("/transcribe", status_code=202, response_model=Job, responses=ERRORS)
async def transcribe(
    request: Request,
    file: Annotated[UploadFile, File(description="Audio: wav, flac, mp3, ogg, m4a, webm.")],
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
    callback_url: Annotated[str | None, Form(
        max_length=2048, description="POSTed the signed job summary when it ends (webhooks on).",
    )] = None,
    wait: Annotated[bool, Query(description="Answer with the finished job (200).")] = False,
    idempotency_key: idempotency.KeyHeader = None,
    st: AppState = Depends(ready_state),
    who: Caller = Depends(caller),
) -> JSONResponse:
    # A key already known was answered before the body was read (idempotency.IdempotencyGate).
    key = idempotency.parse_key(idempotency_key)
    options = decode_options(st, language, task, beam_size, initial_prompt, temperature,
                             word_timestamps, hotwords, language_detection)
    job_id = await accept_upload(st, file, options, who, callback_url, key)
    return await job_answer(st, job_id, wait)

