"""OpenAI's audio API as this service reads it: the request's fields, their parsing, and what
/docs shows of the answers.

The fields are declared once here (:data:`FileField` ...), with the checks that OpenAI's API
makes of them before any audio is read: ``include[]`` (:func:`wants_logprobs`), the
``chunking_strategy`` of a transcription (:func:`parse_chunking`, or its
``chunking_strategy[...]`` form fields: :func:`chunking_fields`), and the combinations the
formats allow (:meth:`TranscriptionRequest.check`). serving.py runs a parsed request; the
routes are api_router.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import File, Form, UploadFile
from starlette.datastructures import FormData

from app.errors import BadRequest, InvalidChunking
from app.results.formats import MEDIA_TYPES, CueOptions
from app.results.openai import OpenAIDiarized, OpenAIError, OpenAITranscription

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt", "diarized_json"]
Granularity = Literal["word", "segment"]
# What OpenAI clients send: served by the loaded model (diarized_json adds the speaker models).
ALIASES = ("whisper-1", "gpt-4o-transcribe-diarize")

FileField = Annotated[UploadFile, File(description="Audio: wav, flac, mp3, ogg, m4a, webm.")]
ModelField = Annotated[str, Form(description="whisper-1, or the id from GET /v1/models.")]
PromptField = Annotated[str | None, Form(max_length=1000)]
FormatField = Annotated[ResponseFormat, Form()]
TemperatureField = Annotated[float, Form(ge=0, le=1)]
CHUNKING_HELP = ('"auto" (the service\'s VAD settings) or a server_vad object: threshold 0-1, '
                 "prefix_padding_ms 0-5000, silence_duration_ms 0-10000 (also as "
                 "chunking_strategy[...] fields, as the openai client sends it).")


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": OpenAIError} for c in codes}


SUBTITLES = {"content": {MEDIA_TYPES[f]: {"schema": {"type": "string"}} for f in ("text", "srt", "vtt")}
             | {"text/event-stream": {"schema": {"type": "string"}}}}  # issue 21: stream=true
AUDIO_RESPONSES = {200: {"model": OpenAITranscription | OpenAIDiarized, **SUBTITLES},
                   **errors(400, 404, 409, 413, 415, 422, 429, 500, 502, 503, 504)}


@dataclass(frozen=True)
class TranscriptionRequest:
    """A ``/v1/audio/transcriptions`` or ``/translations`` request, its fields parsed."""

    file: UploadFile
    model: str
    task: str  # transcribe, translate
    language: str | None
    prompt: str | None
    fmt: str  # response_format
    temperature: float
    granularities: frozenset[str]
    cue: CueOptions | None = None
    stream: bool = False
    hotwords: str | None = None
    idempotency_key: str | None = None  # parsed
    known: list[dict[str, Any]] | None = None  # known speakers' voices (the door's)
    logprobs: bool = False
    vad: dict[str, float] | None = None  # chunking_strategy's server_vad settings

    def check(self) -> None:
        """400 for what the formats cannot give."""
        if "word" in self.granularities and self.fmt != "verbose_json":
            raise BadRequest("timestamp_granularities word needs response_format=verbose_json",
                             field="timestamp_granularities[]")
        if self.stream and self.fmt not in ("json", "text"):  # issue 21: deltas are text
            raise BadRequest("stream=true needs response_format json or text", field="stream")

    @property
    def aligned(self) -> bool:
        """Decoded with word alignment: sentence-sized segments, or logprobs (the align pass's)."""
        return self.fmt in ("verbose_json", "srt", "vtt") or self.logprobs


def wants_logprobs(include: list[str], fmt: str) -> bool:
    """``include[]``: only ``logprobs``, and only where a response has room for them."""
    unknown = sorted(set(include) - {"logprobs"})
    if unknown:
        raise BadRequest(f"include[] takes logprobs only, not {', '.join(unknown)}",
                         field="include[]", no_retry=True)
    if include and fmt not in ("json", "verbose_json"):
        raise BadRequest("include[]=logprobs needs response_format json or verbose_json",
                         field="include[]", no_retry=True)
    return bool(include)


# ---- chunking_strategy (app/audio/server_vad.py: what its settings do) ---------------------------
LIMITS = {"threshold": (0.0, 1.0), "prefix_padding_ms": (0, 5000),
          "silence_duration_ms": (0, 10_000)}


def chunking_fields(form: FormData) -> dict[str, str]:
    """The form's ``chunking_strategy[...]`` fields (what the openai client sends for the
    object), by their inner name."""
    return {k[len("chunking_strategy["):-1]: str(v) for k, v in form.multi_items()
            if k.startswith("chunking_strategy[") and k.endswith("]")}


def parse_chunking(raw: str | None, fields: Mapping[str, str]) -> dict[str, float] | None:
    """The request's ``server_vad`` settings (only those given), or None for ``auto``/absent.
    ``fields``: the form's ``chunking_strategy[...]`` fields, by their inner name."""
    obj: dict[str, Any]
    if fields:
        if raw is not None:
            raise InvalidChunking("give chunking_strategy as a string or as fields, not both")
        obj = dict(fields)
    elif raw is None or raw.strip() == "auto":
        return None
    else:
        try:
            loaded = json.loads(raw)
        except ValueError as exc:
            raise InvalidChunking('chunking_strategy is "auto" or a server_vad object') from exc
        if not isinstance(loaded, dict):
            raise InvalidChunking('chunking_strategy is "auto" or a server_vad object')
        obj = loaded
    if obj.get("type") != "server_vad":
        raise InvalidChunking(f"chunking_strategy type must be server_vad, not {obj.get('type')!r}")
    unknown = sorted(set(obj) - {"type", *LIMITS})
    if unknown:
        raise InvalidChunking(f"unknown chunking_strategy field(s): {', '.join(unknown)}")
    out: dict[str, float] = {}
    for name, (lo, hi) in LIMITS.items():
        if name not in obj:
            continue
        value = _number(obj[name], name, integer=isinstance(lo, int))
        if not lo <= value <= hi:
            raise InvalidChunking(f"chunking_strategy {name} must be {lo}-{hi}, got {value}")
        out[name] = value
    return out


def _number(v: Any, name: str, integer: bool) -> float:
    try:
        f = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        f = math.nan
    if not math.isfinite(f) or (integer and f != int(f)):
        kind = "an integer" if integer else "a number"
        raise InvalidChunking(f"chunking_strategy {name} must be {kind}, got {v!r}")
    return int(f) if integer else f
