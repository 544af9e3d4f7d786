"""OpenAI-compatible audio API: /v1/audio/transcriptions, /v1/audio/translations, /v1/models.

A thin layer over the job API: the upload is accepted exactly like POST /transcribe (spooled,
probed, backpressured, committed), goes through the same micro-batcher, and the request waits
for its job. If the client hangs up first, the job is cancelled: nobody can collect the answer
of a synchronous call (the OpenAI client would retry and pay twice). Errors on these routes use
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; the rest of the API keeps
:mod:`app.errors`' shape.

Clients that retry: the OpenAI SDK resends the whole upload on 408/409/429/5xx and on its own
600 s time-out, unless the answer says ``x-should-retry: false``. So every answer no retry can
change says so (a job that failed on its audio answers with that error's 4xx, as the upload
check would have); the request is answered within ``limits.openai_wait_s`` (540 s), and audio
too long to finish in that time at the current speed is refused up front (413, naming
``POST /transcribe``); a job still running at the deadline is cancelled, never left running
behind a 504 while the SDK uploads it again.

Segments: verbose_json, srt and vtt are decoded with word alignment, so segments are sentences
(OpenAI-like, subtitle-sized) instead of whole 30 s windows; words are returned only when
``timestamp_granularities[]`` asks for them.

Speakers: ``response_format=diarized_json`` runs the job with ``diarize=true`` and answers in the
shape of OpenAI's diarization model (``TranscriptionDiarized`` in the ``openai`` package: ``task``,
``duration``, ``text``, ``segments`` of ``type`` ``transcript.text.segment`` with ``id``,
``speaker``, ``start``, ``end``, ``text``, and ``usage`` by duration). Speakers are named as
OpenAI names them without known speakers: ``A``, ``B``, ... in order of first appearance.
``model`` may be ``gpt-4o-transcribe-diarize`` (what clients of that model send).
``chunking_strategy``'s ``server_vad`` object sets the VAD for the request (app/audio/server_vad.py);
``include[]=logprobs`` adds token log-probabilities (app/results/logprobs.py).
``known_speaker_names[]`` with ``known_speaker_references[]`` (data URLs, up to 4) name the
speakers they match (app/speakers/named.py); unmatched ones keep letters, and the answer's
``known_speakers`` says how similar each reference was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from app.api import idempotency, openai_stream
from app.api.deps import Caller, caller, cue_form, door, ready_door
from app.api.transcribe import HOTWORDS_HELP, accept_upload, decode_options, speaker_options
from app.api.waiting import ended_or_gone
from app.errors import (
    NO_RETRY,
    BadRequest,
    PayloadTooLarge,
    ServiceError,
    openai_body,
    public_error,
    status_of,
)
from app.jobs.door import PART_BYTES, Door, JobView
from app.results.formats import MEDIA_TYPES, CueOptions, render
from app.results.openai import (
    ModelCard,
    ModelList,
    OpenAIDiarized,
    OpenAIError,
    OpenAITranscription,
    diarized_json,
    verbose_json,
)

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt", "diarized_json"]
Granularity = Literal["word", "segment"]
# What OpenAI clients send: served by the loaded model (diarized_json adds the speaker models).
ALIASES = ("whisper-1", "gpt-4o-transcribe-diarize")
STARTED = int(time.time())  # the model card's "created": when this process loaded it


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": OpenAIError} for c in codes}


SUBTITLES = {"content": {MEDIA_TYPES[f]: {"schema": {"type": "string"}} for f in ("text", "srt", "vtt")}
             | {"text/event-stream": {"schema": {"type": "string"}}}}  # issue 21: stream=true
AUDIO_RESPONSES = {200: {"model": OpenAITranscription | OpenAIDiarized, **SUBTITLES},
                   **_errors(400, 404, 409, 413, 415, 422, 429, 500, 502, 503, 504)}


def openai_error(status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_body(status, message, code=code, param=param), status_code=status,
                        headers=headers)


class OpenAIRoute(APIRoute):
    """Renders every error raised while handling a /v1 request in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ServiceError as exc:
                return JSONResponse(exc.body_for(request.url.path), status_code=exc.status_code,
                                    headers=exc.headers)
            except RequestValidationError as exc:  # OpenAI answers 400, naming the parameter
                errs = exc.errors()
                loc = [str(p) for p in (errs[0].get("loc", ()) if errs else ()) if p != "body"]
                msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
                                for e in errs) or "invalid request"
                return openai_error(400, msg, code="invalid_value", param=".".join(loc) or None)
            except StarletteHTTPException as exc:
                return openai_error(exc.status_code, str(exc.detail), headers=exc.headers)

        return handle


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


def check_model(d: Door, model: str) -> None:
    if model not in (d.model_name(), *ALIASES):
        raise _ModelNotFound(f"The model `{model}` does not exist; this service runs "
                             f"`{d.model_name()}` (also reachable as {', '.join(ALIASES)}).",
                             field="model")


class _ModelNotFound(ServiceError):
    status_code = 404
    error_type = "model_not_found"


def _card(d: Door) -> ModelCard:
    return ModelCard(id=d.model_name(), created=STARTED, owned_by="batchscribe")


@router.get("/models", response_model=ModelList)
async def list_models(d: Door = Depends(door)) -> ModelList:
    return ModelList(data=[_card(d)])


@router.get("/models/{model}", response_model=ModelCard, responses=_errors(404, 422))
async def get_model(model: str, d: Door = Depends(door)) -> ModelCard:
    check_model(d, model)
    return _card(d)


FileField = Annotated[UploadFile, File(description="Audio: wav, flac, mp3, ogg, m4a, webm.")]
ModelField = Annotated[str, Form(description="whisper-1, or the id from GET /v1/models.")]
PromptField = Annotated[str | None, Form(max_length=1000)]
FormatField = Annotated[ResponseFormat, Form()]
TemperatureField = Annotated[float, Form(ge=0, le=1)]


@router.post("/audio/transcriptions", response_model=None, responses=AUDIO_RESPONSES,
             form_limits={"max_part_size": PART_BYTES})  # data URLs of reference clips
async def transcriptions(
    request: Request, file: FileField, model: ModelField,
    language: Annotated[str | None, Form(description="ISO 639-1; detected when absent.")] = None,
    prompt: PromptField = None, response_format: FormatField = "json",
    temperature: TemperatureField = 0.0,
    granularities: Annotated[list[Granularity] | None, Form(alias="timestamp_granularities[]")] = None,
    granularities_plain: Annotated[list[Granularity] | None,
                                   Form(alias="timestamp_granularities")] = None,
    # issue 21: Server-Sent Events as windows finish (app/api/openai_stream.py), and hotwords.
    stream: Annotated[bool, Form(description="Server-Sent Events: transcript.text.delta as "
                                 "windows finish, then transcript.text.done (json/text).")] = False,
    hotwords: Annotated[str | None, Form(max_length=1000, description=HOTWORDS_HELP)] = None,
    # OpenAI's diarization fields (gpt-4o-transcribe-diarize).
    chunking_strategy: Annotated[str | None, Form(
        max_length=300, description='"auto" (the service\'s VAD settings) or a server_vad '
        'object: threshold 0-1, prefix_padding_ms 0-5000, silence_duration_ms 0-10000 (also '
        "as chunking_strategy[...] fields, as the openai client sends it).")] = None,
    known_names: Annotated[list[str] | None, Form(alias="known_speaker_names[]")] = None,
    known_refs: Annotated[list[str] | None, Form(alias="known_speaker_references[]")] = None,
    include: Annotated[list[str] | None, Form(
        alias="include[]", description="logprobs: token log-probabilities (json, "
        "verbose_json, the stream's events).")] = None,
    include_plain: Annotated[list[str] | None, Form(alias="include")] = None,
    cue: CueOptions = Depends(cue_form),
    idempotency_key: idempotency.KeyHeader = None,
    d: Door = Depends(ready_door), who: Caller = Depends(caller),
) -> Response:
    gran: set[str] = set(granularities or []) | set(granularities_plain or [])
    logprobs = wants_logprobs([*(include or []), *(include_plain or [])], response_format)
    vad = await chunking(request, d, chunking_strategy)
    known = None
    if known_names or known_refs:
        if response_format != "diarized_json":
            raise BadRequest("known speakers name diarized speakers: they need "
                             "response_format=diarized_json", field="known_speaker_names[]",
                             headers=NO_RETRY)
        check_model(d, model)
        known = await d.known_speakers(known_names or [], known_refs or [],
                                       "known_speaker_names[]", "known_speaker_references[]",
                                       who.owner)
    return await _run(request, d, who, file, model, "transcribe", language, prompt,
                      response_format, temperature, gran, cue, stream, hotwords, idempotency_key,
                      known, logprobs, vad)


@router.post("/audio/translations", response_model=None, responses=AUDIO_RESPONSES)
async def translations(
    request: Request, file: FileField, model: ModelField, prompt: PromptField = None,
    response_format: FormatField = "json", temperature: TemperatureField = 0.0,
    cue: CueOptions = Depends(cue_form),
    idempotency_key: idempotency.KeyHeader = None,
    d: Door = Depends(ready_door), who: Caller = Depends(caller),
) -> Response:
    """Speech in any language to English text (Whisper's translate task)."""
    if response_format == "diarized_json":
        raise BadRequest("diarized_json is a transcription format", field="response_format",
                         headers=NO_RETRY)
    return await _run(request, d, who, file, model, "translate", None, prompt, response_format,
                      temperature, set(), cue, raw_key=idempotency_key)


async def _run(request: Request, d: Door, who: Caller, file: UploadFile, model: str,
               task: str, language: str | None, prompt: str | None, fmt: str,
               temperature: float, gran: set[str], cue: CueOptions | None = None,
               stream: bool = False, hotwords: str | None = None,
               raw_key: str | None = None, known: list[dict[str, Any]] | None = None,
               logprobs: bool = False, vad: dict[str, float] | None = None) -> Response:
    key = idempotency.parse_key(raw_key)
    check_model(d, model)
    if "word" in gran and fmt != "verbose_json":
        raise BadRequest("timestamp_granularities word needs response_format=verbose_json",
                         field="timestamp_granularities[]")
    if stream and fmt not in ("json", "text"):  # issue 21: deltas are text
        raise BadRequest("stream=true needs response_format json or text", field="stream")
    aligned = fmt in ("verbose_json", "srt", "vtt") or logprobs  # logprobs: the align pass's
    options = decode_options(d.settings, language, task, None, prompt, temperature, aligned,
                             hotwords)
    options = replace(options, logprobs=logprobs, vad=vad)
    if fmt == "diarized_json":
        options = speaker_options(d, options, True, None, None, None)
        options = replace(options, known_speakers=known)
    wait_s = min(d.settings.limits.sync_timeout_s, d.settings.limits.openai_wait_s)
    first = await d.replay(who.owner, key) if key else None
    job_id = first.id if first else await accept_upload(
        d, file, options, who, check=None if stream else lambda s: _fits(d, s, wait_s),
        idempotency_key=key)
    if stream:  # issue 21: no deadline, the client sees text as windows finish
        return openai_stream.stream_response(d, job_id, who.owner,
                                             {"X-Batchscribe-Job-Id": job_id}, logprobs)
    # With a key the job outlives this request: the client's retry (same key) collects it.
    row = await _wait(request, d, job_id, who.owner, wait_s, cancel_if_gone=key is None)
    headers = {"X-Batchscribe-Job-Id": job_id}
    if first is not None:
        headers[idempotency.REPLAYED] = "true"
    if row is not None and not row.ended and d.stopped:
        # Draining: the client will retry elsewhere, so a keyless copy must not run after the
        # restart; a keyed one stays queued for the retry to find.
        if key is None:
            await d.cancel(job_id, who.owner)
        return openai_error(503, "the service is restarting; retry the request",
                            code="shutting_down", headers={**headers, "Retry-After": "1"})
    if row is not None and not row.ended:
        # Nobody can collect a synchronous answer later, and the SDK would upload the file
        # again after its own time-out: the job is cancelled, the answer says where to go.
        await d.cancel(job_id, who.owner)
        return openai_error(
            504, f"the transcription did not finish within {wait_s:.0f} s, this service's "
            "limit for a synchronous /v1 request (under the OpenAI SDK's 600 s time-out); it "
            "was cancelled. Send long audio to POST /transcribe and poll GET /jobs/{id}.",
            code="sync_timeout", headers={**headers, "x-should-retry": "false"})
    if row is None or row.status != "done" or row.result is None:
        return _unfinished(job_id, row, headers)
    result = row.result
    extra = {"logprobs": result.get("logprobs") or []} if logprobs else {}
    if fmt == "json":
        return JSONResponse({"text": result["text"], **extra}, headers=headers)
    if fmt == "verbose_json":
        return JSONResponse({**verbose_json(result, task, "word" in gran), **extra},
                            headers=headers)
    if fmt == "diarized_json":
        return JSONResponse(diarized_json(result), headers=headers)
    return PlainTextResponse(render(result, fmt, cue), media_type=MEDIA_TYPES[fmt], headers=headers)


async def chunking(request: Request, d: Door, raw: str | None) -> dict[str, float] | None:
    """``chunking_strategy`` (a string, or the ``chunking_strategy[...]`` fields the openai
    client sends) as the request's VAD settings; invalid: 400 naming the field."""
    form = await request.form()  # parsed already for the route: Starlette's cached copy
    fields = {k[len("chunking_strategy["):-1]: str(v) for k, v in form.multi_items()
              if k.startswith("chunking_strategy[") and k.endswith("]")}
    return d.chunking(raw, fields)


def wants_logprobs(include: list[str], fmt: str) -> bool:
    """``include[]``: only ``logprobs``, and only where a response has room for them."""
    unknown = sorted(set(include) - {"logprobs"})
    if unknown:
        raise BadRequest(f"include[] takes logprobs only, not {', '.join(unknown)}",
                         field="include[]", headers=NO_RETRY)
    if include and fmt not in ("json", "verbose_json"):
        raise BadRequest("include[]=logprobs needs response_format json or verbose_json",
                         field="include[]", headers=NO_RETRY)
    return bool(include)


SPEED_MARGIN = 0.8  # of the measured speed: the estimate must not promise what it cannot keep


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
        return openai_error(status_of(kind), str(err.get("message", "transcription failed")),
                            code=kind, headers=final)
    gone = "was cancelled" if row is not None else "no longer exists"
    return openai_error(409, f"job {job_id} {gone}", code="cancelled", headers=final)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def unknown(request: Request) -> Response:
    """Unknown /v1 paths (404) and methods (405) answer in OpenAI's shape too."""
    # The methods the OpenAPI description lists for this path, whichever router serves it (the
    # realtime one's client_secrets too): FastAPI 0.165 no longer flattens included routers.
    allowed = {m.upper() for template, ops in request.app.openapi()["paths"].items()
               if compile_path(template)[0].match(request.url.path) for m in ops}
    if allowed:
        return openai_error(405, f"Method {request.method} not allowed for {request.url.path}",
                            code="method_not_allowed", headers={"Allow": ", ".join(sorted(allowed))})
    return openai_error(404, f"Unknown request URL: {request.method} {request.url.path}",
                        code="unknown_url")
