"""Client events of OpenAI's Realtime API, transcription sessions (``?intent=transcription``).

The shapes are the GA ones of the official ``openai`` SDK (``openai.types.realtime``:
``SessionUpdateEvent`` with a ``RealtimeTranscriptionSessionCreateRequest``,
``InputAudioBufferAppendEvent``, ``...CommitEvent``, ``...ClearEvent``). Models forbid unknown
fields, as OpenAI's server does (``unknown_parameter``), so a typo is answered, not ignored.

:func:`parse_client_event` never raises: a message that is not JSON, too large, of an unknown
type or with a bad field becomes a :class:`ProtocolError` carrying OpenAI's error ``type``,
``code`` and ``param`` (``invalid_request_error`` / ``invalid_json``, ``unknown_parameter``,
``missing_required_parameter``, ``invalid_value``, ``invalid_type``), which the session sends as an
``error`` event while the socket stays open.

Accepted and honoured beyond OpenAI's list: ``audio/pcm`` at 16 kHz (OpenAI takes only 24 kHz).
Accepted and ignored (no effect on a Whisper transcription): ``noise_reduction``,
``transcription.delay``, ``turn_detection.create_response`` / ``interrupt_response`` (there are no
model responses in a transcription session), ``include`` (no logprobs are sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

MAX_EVENT_BYTES = 15 * 1024 * 1024  # OpenAI's documented bound on one append event


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PcmFormat(_Strict):
    """Little-endian 16-bit mono PCM. OpenAI: 24 kHz only; 16 kHz also accepted here."""

    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000, 16000] = 24000


class PcmuFormat(_Strict):
    """G.711 mu-law, 8 kHz (telephony)."""

    type: Literal["audio/pcmu"] = "audio/pcmu"
    rate: Literal[8000] | None = None


class PcmaFormat(_Strict):
    """G.711 A-law, 8 kHz (telephony)."""

    type: Literal["audio/pcma"] = "audio/pcma"
    rate: Literal[8000] | None = None


AudioFormat = Annotated[PcmFormat | PcmuFormat | PcmaFormat, Field(discriminator="type")]


class Transcription(_Strict):
    """``audio.input.transcription``. ``model`` is recorded, not switched: the service has one
    resident model. ``keywords`` bias the decode (the engine's hotwords)."""

    model: str | None = None
    language: str | None = Field(None, min_length=2, max_length=8)
    prompt: str | None = Field(None, max_length=4000)
    keywords: list[Annotated[str, Field(max_length=200)]] | None = Field(None, max_length=100)
    languages: list[str] | None = None
    delay: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None


class ServerVad(_Strict):
    """``server_vad`` turn detection, with OpenAI's defaults."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=0, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None


class SemanticVad(_Strict):
    """``semantic_vad`` turn detection: a turn ends after a short silence when what was said
    sounds finished, and waits up to ``eagerness``'s timeout (OpenAI's 8 / 4 / 2 s for low /
    medium / high; ``auto`` is medium) when it does not (app/live/turns.py)."""

    type: Literal["semantic_vad"] = "semantic_vad"
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    create_response: bool | None = None
    interrupt_response: bool | None = None


TurnDetection = Annotated[ServerVad | SemanticVad, Field(discriminator="type")]


class NoiseReduction(_Strict):
    type: Literal["near_field", "far_field"] | None = None
    strength: float | None = None


class AudioInput(_Strict):
    format: AudioFormat | None = None
    transcription: Transcription | None = None
    turn_detection: TurnDetection | None = None
    noise_reduction: NoiseReduction | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """A format without ``type`` is PCM (the SDK's ``AudioPCM`` has it optional), turn
        detection without one is ``server_vad`` (OpenAI's default)."""
        if isinstance(data, dict):
            fmt = data.get("format")
            if isinstance(fmt, dict) and "type" not in fmt:
                data = {**data, "format": {**fmt, "type": "audio/pcm"}}
            td = data.get("turn_detection")
            if isinstance(td, dict) and "type" not in td:
                data = {**data, "turn_detection": {**td, "type": "server_vad"}}
        return data


class SessionAudio(_Strict):
    input: AudioInput | None = None


class TranscriptionSession(_Strict):
    type: Literal["transcription"]
    audio: SessionAudio | None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = None


class SessionUpdate(_Strict):
    type: Literal["session.update"]
    session: TranscriptionSession
    event_id: str | None = Field(None, max_length=256)


class Append(_Strict):
    type: Literal["input_audio_buffer.append"]
    audio: str
    event_id: str | None = Field(None, max_length=256)


class Commit(_Strict):
    type: Literal["input_audio_buffer.commit"]
    event_id: str | None = Field(None, max_length=256)


class Clear(_Strict):
    type: Literal["input_audio_buffer.clear"]
    event_id: str | None = Field(None, max_length=256)


ClientEvent = Annotated[SessionUpdate | Append | Commit | Clear, Field(discriminator="type")]
_client_event: TypeAdapter[SessionUpdate | Append | Commit | Clear] = TypeAdapter(ClientEvent)
KNOWN = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
         "input_audio_buffer.clear")


@dataclass(frozen=True)
class ProtocolError:
    """What an ``error`` event says (OpenAI's ``RealtimeError``)."""

    message: str
    code: str | None = None
    param: str | None = None
    event_id: str | None = None
    type: str = "invalid_request_error"

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message,
                "param": self.param, "event_id": self.event_id}


MAX_ECHO = 256  # characters of a client's own id, name or value an error event repeats


def short(text: str, limit: int = MAX_ECHO) -> str:
    """What an error may echo of a client's string. Issue 51: 30 events with a 1 MB
    ``event_id`` each, sent in 0.5 s by a client that never read, left ~57 MB of error events
    queued inside the service; echoed, they are cut to ``MAX_ECHO`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def parse_client_event(raw: str | bytes, max_bytes: int = MAX_EVENT_BYTES
                       ) -> SessionUpdate | Append | Commit | Clear | ProtocolError:
    """One WebSocket message as a client event, or the error to answer it with (which echoes
    at most ``MAX_ECHO`` characters of anything the client sent)."""
    if len(raw) > max_bytes:
        return ProtocolError(f"Event of {len(raw)} bytes exceeds the maximum of {max_bytes} bytes.",
                             code="event_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return ProtocolError(f"The event is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        return ProtocolError("An event must be a JSON object.", code="invalid_json")
    event_id = short(data["event_id"]) if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    if not isinstance(kind, str):
        return ProtocolError("Missing required parameter: 'type'.",
                             code="missing_required_parameter", param="type", event_id=event_id)
    if kind not in KNOWN:
        return ProtocolError(f"Invalid value: '{short(kind, 100)}'. Supported values are: "
                             + ", ".join(f"'{k}'" for k in KNOWN) + ".",
                             code="invalid_value", param="type", event_id=event_id)
    if kind == "input_audio_buffer.append" and _plain_append(data):
        # Nine in ten client events, ten a second per session: pydantic's validation of one
        # was ~5 % of the event loop's time at 32 sessions (py-spy), for what these checks say.
        return Append.model_construct(type="input_audio_buffer.append", audio=data["audio"],
                                      event_id=data.get("event_id"))
    try:
        return _client_event.validate_python(data)
    except ValidationError as exc:
        return _from_validation(exc, kind, event_id)


def _plain_append(data: dict[str, Any]) -> bool:
    """An append :class:`Append` would take as it is: its fields only, ``audio`` a string,
    ``event_id`` absent, null or a string within its bound (anything else: pydantic says why)."""
    if type(data.get("audio")) is not str or not data.keys() <= _APPEND_FIELDS:
        return False
    eid = data.get("event_id")
    return eid is None or (type(eid) is str and len(eid) <= 256)


_APPEND_FIELDS = frozenset(Append.model_fields)
MAX_SECRET_SESSION_BYTES = 4096  # a client secret rides a subprotocol header or a query string


def parse_session(data: Any) -> TranscriptionSession | ProtocolError:
    """The ``session`` of ``POST /v1/realtime/client_secrets``, checked as a ``session.update``'s
    would be: the session a socket opened with that secret starts with (OpenAI's rule)."""
    try:
        session = TranscriptionSession.model_validate(data)
    except ValidationError as exc:
        err = _from_validation(exc, "", None)
        param = f"session.{err.param}" if err.param else "session"
        return ProtocolError(err.message.replace(f"'{err.param}'", f"'{param}'"),
                             code=err.code, param=param)
    size = len(session.model_dump_json(exclude_unset=True))
    if size > MAX_SECRET_SESSION_BYTES:
        return ProtocolError(f"The session is {size} bytes as JSON, over the {MAX_SECRET_SESSION_BYTES}"
                             " a client secret carries; send the long fields (prompt, keywords) in"
                             " a session.update once connected.", code="invalid_value",
                             param="session")
    return session


def _from_validation(exc: ValidationError, kind: str, event_id: str | None) -> ProtocolError:
    """The first problem pydantic found, in OpenAI's words and codes."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not (kind and str(p) == kind)]
    # Discriminated unions put the tag in the path (format -> 'audio/pcm' -> rate): drop it.
    loc = [p for p in loc if not p.startswith("audio/") and p not in ("server_vad", "semantic_vad")]
    param = short(".".join(loc)) or None
    etype = err["type"]
    if etype == "extra_forbidden":
        return ProtocolError(f"Unknown parameter: '{param}'.", code="unknown_parameter",
                             param=param, event_id=event_id)
    if etype == "missing":
        return ProtocolError(f"Missing required parameter: '{param}'.",
                             code="missing_required_parameter", param=param, event_id=event_id)
    if etype.endswith("_type") or etype in ("model_type", "dict_type", "list_type"):
        return ProtocolError(f"Invalid type for '{param}': {err['msg']}.", code="invalid_type",
                             param=param, event_id=event_id)
    value = err.get("input")
    shown = (short(value, 100) if isinstance(value, str) else value
             if isinstance(value, (int, float, bool)) or value is None else "...")
    return ProtocolError(f"Invalid value for '{param}': {shown!r}. {err['msg']}.",
                         code="invalid_value", param=param, event_id=event_id)
