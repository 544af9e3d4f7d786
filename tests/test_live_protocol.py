"""The Realtime transcription protocol's shapes (app/live/protocol.py, app/live/events.py)
against the official ``openai`` SDK's types, and bad input answered in OpenAI's codes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from openai.types.realtime.session_update_event_param import SessionUpdateEventParam
from pydantic import TypeAdapter

from app.live.config import LiveLimits, SessionConfig
from app.live.events import (
    Cleared,
    Committed,
    ErrorEvent,
    ItemAdded,
    SessionCreated,
    SpeechStarted,
    SpeechStopped,
    TranscriptionCompleted,
    TranscriptionDelta,
    TranscriptionFailed,
)
from app.live.protocol import (
    Append,
    PcmuFormat,
    ProtocolError,
    ServerVad,
    SessionUpdate,
    parse_client_event,
)

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)


def sdk_parses(event: dict[str, Any]) -> Any:
    """The SDK's own validation of a server event (raises if a field is missing or mistyped)."""
    parsed = SERVER_EVENT.validate_python(event)
    assert parsed.type == event["type"]
    return parsed


def test_every_server_event_is_one_the_sdk_knows() -> None:
    events = [
        SessionCreated(session=SessionConfig().as_session("sess_1", LiveLimits(), 0.0)),
        SpeechStarted(audio_start_ms=120, item_id="item_1"),
        SpeechStopped(audio_end_ms=900, item_id="item_1"),
        Committed(item_id="item_1", previous_item_id=None),
        ItemAdded.user_audio("item_1", None),
        Cleared(),
        TranscriptionDelta(item_id="item_1", delta="Hello"),
        TranscriptionCompleted.of("item_1", "Hello there.", 1.25),
        TranscriptionFailed.of("item_1", "engine failed", "server_error"),
        ErrorEvent.of(ProtocolError("bad", code="invalid_value", param="audio")),
    ]
    for e in events:
        sdk_parses(e.as_dict())
    session = sdk_parses(events[0].as_dict()).session
    assert session.type == "transcription"
    assert session.audio.input.format.type == "audio/pcm" and session.audio.input.format.rate == 24000
    assert session.audio.input.turn_detection.silence_duration_ms == 500


def test_the_sdks_own_session_update_parses() -> None:
    update: SessionUpdateEventParam = {
        "type": "session.update",
        "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcmu"},
            "transcription": {"model": "whisper-1", "language": "en", "prompt": "names"},
            "turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200,
                               "silence_duration_ms": 400},
            "noise_reduction": None}}},
    }
    ev = parse_client_event(json.dumps(update))
    assert isinstance(ev, SessionUpdate)
    inp = ev.session.audio.input if ev.session.audio else None
    assert inp is not None and isinstance(inp.format, PcmuFormat)
    assert isinstance(inp.turn_detection, ServerVad) and inp.turn_detection.threshold == 0.6
    cfg = SessionConfig()
    cfg.apply(ev.session)
    assert cfg.format == PcmuFormat() and cfg.transcription.language == "en"  # type: ignore[union-attr]


def test_an_update_changes_only_what_it_carries() -> None:
    cfg = SessionConfig()
    manual = parse_client_event(json.dumps({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
    assert isinstance(manual, SessionUpdate)
    assert cfg.apply(manual.session) == (False, True) and cfg.turn_detection is None
    lang = parse_client_event(json.dumps({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {"transcription": {"language": "fr"}}}}}))
    assert isinstance(lang, SessionUpdate)
    assert cfg.apply(lang.session) == (False, False)
    assert cfg.turn_detection is None and cfg.transcription.language == "fr"  # type: ignore[union-attr]


def test_append_and_its_event_id() -> None:
    ev = parse_client_event('{"type": "input_audio_buffer.append", "audio": "AAAA", '
                            '"event_id": "e1"}')
    assert isinstance(ev, Append) and ev.audio == "AAAA" and ev.event_id == "e1"


@pytest.mark.parametrize("raw,code,param", [
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_json", None),
    ('{"audio": "AAAA"}', "missing_required_parameter", "type"),
    ('{"type": "response.create"}', "invalid_value", "type"),
    ('{"type": "input_audio_buffer.append"}', "missing_required_parameter", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": 5}', "invalid_type", "audio"),
    ('{"type": "input_audio_buffer.commit", "bogus": 1}', "unknown_parameter", "bogus"),
    ('{"type": "session.update", "session": {"type": "realtime"}}', "invalid_value",
     "session.type"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"format": {"type": "audio/pcm", "rate": 44100}}}}}', "invalid_value",
     "session.audio.input.format.rate"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"format": {"type": "audio/opus"}}}}}', "invalid_value", "session.audio.input.format"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"turn_detection": {"type": "push_to_talk"}}}}}', "invalid_value",
     "session.audio.input.turn_detection"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}}}', "invalid_value",
     "session.audio.input.turn_detection.eagerness"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 200}}}}}',
     "unknown_parameter", "session.audio.input.turn_detection.silence_duration_ms"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"turn_detection": {"type": "server_vad", "threshold": 2}}}}}', "invalid_value",
     "session.audio.input.turn_detection.threshold"),
    ('{"type": "session.update", "session": {"type": "transcription", "audio": {"input": '
     '{"transcription": {"modle": "x"}}}}}', "unknown_parameter",
     "session.audio.input.transcription.modle"),
])
def test_bad_events_get_openai_error_codes(raw: str, code: str, param: str | None) -> None:
    err = parse_client_event(raw)
    assert isinstance(err, ProtocolError), err
    assert (err.type, err.code, err.param) == ("invalid_request_error", code, param), err
    sdk_parses(ErrorEvent.of(err).as_dict())


def test_an_oversized_event_is_refused_unparsed() -> None:
    raw = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 5000})
    err = parse_client_event(raw, max_bytes=4096)
    assert isinstance(err, ProtocolError) and err.code == "event_too_large"
    assert isinstance(parse_client_event(raw, max_bytes=8192), Append)


def test_the_errors_event_id_names_the_client_event() -> None:
    err = parse_client_event('{"type": "input_audio_buffer.clear", "x": 1, "event_id": "c7"}')
    assert isinstance(err, ProtocolError) and err.event_id == "c7"


@pytest.mark.parametrize("event", [
    {"type": "input_audio_buffer.append", "audio": "AAAA"},
    {"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e1"},
    {"type": "input_audio_buffer.append", "audio": "", "event_id": None},
    {"type": "input_audio_buffer.append", "audio": 5},
    {"type": "input_audio_buffer.append", "audio": None},
    {"type": "input_audio_buffer.append", "audio": "AAAA", "extra": 1},
    {"type": "input_audio_buffer.append"},
    {"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "x" * 257},
    {"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": 7},
])
def test_an_append_parses_as_pydantic_reads_it(event: dict[str, Any]) -> None:
    """The append's fast path (no pydantic for a plain one) takes what the model takes, as the
    model would, and leaves every other append to the model's own error."""
    from pydantic import ValidationError

    from app.live.protocol import Append

    got = parse_client_event(json.dumps(event))
    try:
        want: Append | None = Append.model_validate(event)
    except ValidationError:
        want = None
    if want is None:
        assert isinstance(got, ProtocolError) and got.code is not None
    else:
        assert isinstance(got, Append) and got.model_dump() == want.model_dump()
