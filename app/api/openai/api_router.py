"""The OpenAI family's routes (the family itself: app/api/openai/__init__.py): each parses its
form into a :class:`TranscriptionRequest` and hands it to serving.py. Every error, those of the
form's validation included, goes out in OpenAI's shape (:class:`OpenAIRoute`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response
from starlette.routing import compile_path

from app.api import idempotency
from app.api.deps import Caller, caller, cue_form, door, ready_door
from app.api.errors import OpenAIRoute, openai_reply
from app.api.openai import serving
from app.api.openai.protocol import (
    AUDIO_RESPONSES,
    CHUNKING_HELP,
    FileField,
    FormatField,
    Granularity,
    ModelField,
    PromptField,
    TemperatureField,
    TranscriptionRequest,
    errors,
    wants_logprobs,
)
from app.api.uploads import HOTWORDS_HELP
from app.errors import BadRequest
from app.jobs.door import Door
from app.results.formats import CueOptions
from app.results.openai import ModelCard, ModelList
from app.speakers.limits import PART_BYTES

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


@router.get("/models", response_model=ModelList)
async def list_models(d: Door = Depends(door)) -> ModelList:
    return ModelList(data=[serving.card(d)])


@router.get("/models/{model}", response_model=ModelCard, responses=errors(404, 422))
async def get_model(model: str, d: Door = Depends(door)) -> ModelCard:
    serving.check_model(d, model)
    return serving.card(d)


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
    # issue 21: Server-Sent Events as windows finish (stream.py), and hotwords.
    stream: Annotated[bool, Form(description="Server-Sent Events: transcript.text.delta as "
                                 "windows finish, then transcript.text.done (json/text).")] = False,
    hotwords: Annotated[str | None, Form(max_length=1000, description=HOTWORDS_HELP)] = None,
    # OpenAI's diarization fields (gpt-4o-transcribe-diarize).
    chunking_strategy: Annotated[str | None, Form(max_length=300, description=CHUNKING_HELP)] = None,
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
    gran = frozenset(granularities or []) | frozenset(granularities_plain or [])
    logprobs = wants_logprobs([*(include or []), *(include_plain or [])], response_format)
    vad = await serving.chunking(request, d, chunking_strategy)
    known = None
    if known_names or known_refs:
        if response_format != "diarized_json":
            raise BadRequest("known speakers name diarized speakers: they need "
                             "response_format=diarized_json", field="known_speaker_names[]",
                             no_retry=True)
        serving.check_model(d, model)
        known = await d.known_speakers(known_names or [], known_refs or [],
                                       "known_speaker_names[]", "known_speaker_references[]",
                                       who.owner)
    return await serving.transcribe(request, d, who, TranscriptionRequest(
        file, model, "transcribe", language, prompt, response_format, temperature, gran, cue,
        stream, hotwords, idempotency.parse_key(idempotency_key), known, logprobs, vad))


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
                         no_retry=True)
    return await serving.transcribe(request, d, who, TranscriptionRequest(
        file, model, "translate", None, prompt, response_format, temperature, frozenset(), cue,
        idempotency_key=idempotency.parse_key(idempotency_key)))


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def unknown(request: Request) -> Response:
    """Unknown /v1 paths (404) and methods (405) answer in OpenAI's shape too."""
    # The methods the OpenAPI description lists for this path, whichever router serves it (the
    # realtime one's client_secrets too): FastAPI 0.165 no longer flattens included routers.
    allowed = {m.upper() for template, ops in request.app.openapi()["paths"].items()
               if compile_path(template)[0].match(request.url.path) for m in ops}
    if allowed:
        return openai_reply(405, f"Method {request.method} not allowed for {request.url.path}",
                            code="method_not_allowed", headers={"Allow": ", ".join(sorted(allowed))})
    return openai_reply(404, f"Unknown request URL: {request.method} {request.url.path}",
                        code="unknown_url")
