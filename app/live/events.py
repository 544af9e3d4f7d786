"""Server events of a transcription session, in the shapes of ``openai.types.realtime``.

Every event here validates against the SDK's ``RealtimeServerEvent`` union
(``tests/test_live_protocol.py`` checks each one the session emits), so the official client parses
them into its typed events. The order the session sends them in, per item (one user turn):

    input_audio_buffer.speech_started        server VAD: speech began (audio_start_ms includes
                                             prefix_padding_ms)
    conversation.item.input_audio_transcription.delta   * interim text while the turn is open
    input_audio_buffer.speech_stopped        server VAD: silence_duration_ms of silence
    input_audio_buffer.committed             (manual mode: the client's commit)
    conversation.item.added                  the user item, transcript still null
    conversation.item.input_audio_transcription.delta   the rest of the final text
    conversation.item.input_audio_transcription.completed  transcript == the joined deltas
      (or ...transcription.failed)
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.live.protocol import ProtocolError


def new_id(prefix: str) -> str:
    """OpenAI-style ids: ``event_...``, ``item_...``, ``sess_...`` (22 URL-safe characters)."""
    return f"{prefix}_{secrets.token_urlsafe(16)[:22]}"


class ServerEvent(BaseModel):
    event_id: str = Field(default_factory=lambda: new_id("event"))

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SessionCreated(ServerEvent):
    type: Literal["session.created"] = "session.created"
    session: dict[str, Any]


class SessionUpdated(ServerEvent):
    type: Literal["session.updated"] = "session.updated"
    session: dict[str, Any]


class SpeechStarted(ServerEvent):
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


class SpeechStopped(ServerEvent):
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class Committed(ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None


class Cleared(ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class ItemAdded(ServerEvent):
    """The committed audio as a user message item (transcript filled in by ``completed``)."""

    type: Literal["conversation.item.added"] = "conversation.item.added"
    item: dict[str, Any]
    previous_item_id: str | None = None

    @classmethod
    def user_audio(cls, item_id: str, previous_item_id: str | None) -> ItemAdded:
        return cls(previous_item_id=previous_item_id, item={
            "id": item_id, "object": "realtime.item", "type": "message", "role": "user",
            "status": "completed", "content": [{"type": "input_audio", "transcript": None}]})


class TranscriptionDelta(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.delta"] = (
        "conversation.item.input_audio_transcription.delta")
    item_id: str
    content_index: int = 0
    delta: str


class TranscriptionCompleted(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed")
    item_id: str
    content_index: int = 0
    transcript: str
    usage: dict[str, Any]

    @classmethod
    def of(cls, item_id: str, transcript: str, seconds: float) -> TranscriptionCompleted:
        return cls(item_id=item_id, transcript=transcript,
                   usage={"type": "duration", "seconds": round(seconds, 3)})


class TranscriptionFailed(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.failed"] = (
        "conversation.item.input_audio_transcription.failed")
    item_id: str
    content_index: int = 0
    error: dict[str, Any]

    @classmethod
    def of(cls, item_id: str, message: str, code: str) -> TranscriptionFailed:
        return cls(item_id=item_id, error={"type": "server_error", "code": code,
                                           "message": message, "param": None})


class ErrorEvent(ServerEvent):
    type: Literal["error"] = "error"
    error: dict[str, Any]

    @classmethod
    def of(cls, err: ProtocolError) -> ErrorEvent:
        return cls(error=err.as_dict())
