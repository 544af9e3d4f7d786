"""End to end: the official ``openai`` SDK's realtime client against the real service
(``python -m app``, the shared ``server`` fixture: whisper-base, Silero, today's batcher) on
``/v1/realtime?intent=transcription``. One read-speech clip with server VAD, then a manual
turn, then a bad event, on one connection: a few seconds of model time. Then a client secret,
and semantic_vad."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

from app.audio import decode
from app.live.audio import encode_pcm16
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import Server
from tests.wer import wer

pytestmark = pytest.mark.model
BOUND = 60.0
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"


def pcm24(audio16: np.ndarray) -> bytes:
    """16 kHz float32 -> 24 kHz PCM16 (the protocol's default format)."""
    n = int(audio16.size * 1.5)
    return encode_pcm16(np.interp(np.arange(n) / 1.5, np.arange(audio16.size), audio16)
                        .astype(np.float32))


async def events_until(conn: Any, kind: str, seen: list[Any]) -> Any:
    async with asyncio.timeout(BOUND):
        async for event in conn:
            seen.append(event)
            if event.type == kind:
                return event
    raise AssertionError(f"the connection ended before {kind}")


async def test_the_openai_sdk_transcribes_live_on_the_service(server: Server,
                                                             clips: list[Clip]) -> None:
    from openai import AsyncOpenAI

    clip = min((c for c in clips if c.set in READ_SPEECH and c.duration_s >= 4.0),
               key=lambda c: c.duration_s)
    speech = decode(clip.path, 60.0)
    client = AsyncOpenAI(api_key="unused-here", base_url=server.url + "/v1",
                         websocket_base_url=server.url.replace("http://", "ws://") + "/v1")
    seen: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                "transcription": {"model": "whisper-1", "language": "en"},
                                "turn_detection": {"type": "server_vad",
                                                   "silence_duration_ms": 500}}}})
        pcm = pcm24(np.concatenate([np.zeros(4_800, np.float32), speech,
                                    np.zeros(16_000, np.float32)]))
        for k in range(0, len(pcm), 4_800):  # 100 ms appends at ~4x real time
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[k:k + 4_800]).decode())
            await asyncio.sleep(0.025)
        done = await events_until(conn, COMPLETED, seen)
        kinds = [e.type for e in seen]
        for kind in ("session.created", "session.updated", "input_audio_buffer.speech_started",
                     "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", DELTA):
            assert kind in kinds, kinds
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index(COMPLETED)
        deltas = "".join(e.delta for e in seen if e.type == DELTA and e.item_id == done.item_id)
        assert deltas == done.transcript  # what was shown is never contradicted
        assert wer([clip.reference], [done.transcript]) <= 0.25, done.transcript

        # manual turns on the same connection: nothing happens until the commit
        await conn.session.update(session={"type": "transcription",
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated", seen)
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm24(speech)).decode())
        await conn.input_audio_buffer.append(audio="@@@ not base64")
        err = await events_until(conn, "error", seen)
        assert err.error.type == "invalid_request_error"
        await conn.input_audio_buffer.commit()
        manual = await events_until(conn, COMPLETED, seen)
        assert manual.item_id != done.item_id
        assert wer([clip.reference], [manual.transcript]) <= 0.25, manual.transcript


async def test_a_client_secret_minted_by_the_sdk_opens_its_session(server: Server,
                                                                   clips: list[Clip]) -> None:
    """OpenAI's ephemeral-key flow with the SDK: a secret minted for a manual-turn English
    session, then a connection made with that secret as the api_key, which sends no
    ``session.update``: it starts in that session (no server VAD), and a commit transcribes."""
    from openai import AsyncOpenAI

    clip = min((c for c in clips if c.set in READ_SPEECH and c.duration_s >= 4.0),
               key=lambda c: c.duration_s)
    ws_base = server.url.replace("http://", "ws://") + "/v1"
    minter = AsyncOpenAI(api_key="unused-here", base_url=server.url + "/v1")
    secret = await minter.realtime.client_secrets.create(session={
        "type": "transcription",
        "audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"},
                            "turn_detection": None}}})
    assert secret.value.startswith("ek_") and secret.session.type == "transcription"
    assert secret.session.audio is not None and secret.session.audio.input is not None
    assert secret.session.audio.input.turn_detection is None
    browser = AsyncOpenAI(api_key=secret.value, base_url=server.url + "/v1",
                          websocket_base_url=ws_base)
    seen: list[Any] = []
    async with browser.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = await events_until(conn, "session.created", seen)
        assert created.session.audio.input.turn_detection is None
        assert created.session.audio.input.transcription.language == "en"
        await conn.input_audio_buffer.append(
            audio=base64.b64encode(pcm24(decode(clip.path, 60.0))).decode())
        await conn.input_audio_buffer.commit()
        done = await events_until(conn, COMPLETED, seen)
    kinds = [e.type for e in seen]
    assert "input_audio_buffer.speech_started" not in kinds and "error" not in kinds, kinds
    assert wer([clip.reference], [done.transcript]) <= 0.25, done.transcript

def test_keyless_handshakes_answer_only_loopback_host_names(server: Server) -> None:
    """Without keys the Host rule of every route holds on the socket too (DNS rebinding)."""
    import httpx

    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode()}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.get("/v1/realtime?intent=transcription", headers={**upgrade, "Host": "evil.example"})
        assert r.status_code == 421, r.text


async def test_a_refused_handshake_is_a_status_not_an_error_in_the_log(server: Server) -> None:
    """A socket from a foreign page is refused with a 403 denial response. The service's log
    says so at INFO and logs no ERROR: uvicorn's default WebSocket protocol logged "ASGI
    callable returned without completing handshake." for every refusal, so any client could
    fill an error alert (app/__main__.py ``WebSockets``)."""
    import websockets

    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    for _ in range(2):
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(url, additional_headers={
                    "Origin": "https://evil.example"}):
                pass
        assert e.value.response.status_code == 403
    await asyncio.sleep(0.5)  # the log line of the last refusal
    log = server.log_path.read_text(errors="replace") if server.log_path else ""
    assert '/v1/realtime?intent=transcription\\" 403' in log  # the access line, at INFO
    # the shared server's log holds every test's lines: only this one is the refusal's
    assert "without completing handshake" not in log


async def test_the_sdks_semantic_vad_keeps_a_phrase_said_with_a_long_pause_in_one_turn(
        server: Server, clips: list[Clip]) -> None:
    """``semantic_vad`` through the SDK on the real service: MFA's "Montreal forced ... um ...
    forced aligner" has a 2 s pause after "Montreal forced", where server_vad ends a turn
    (tests/test_live_model.py counts them); Whisper leaves that read open, so the turn waits
    (4 s at eagerness auto) and the phrase arrives as one turn."""
    from openai import AsyncOpenAI

    clip = {c.id: c for c in clips}["mfa-mfa_uhum"]
    client = AsyncOpenAI(api_key="unused-here", base_url=server.url + "/v1",
                         websocket_base_url=server.url.replace("http://", "ws://") + "/v1")
    seen: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"},
                                "turn_detection": {"type": "semantic_vad", "eagerness": "auto"}}}})
        updated = await events_until(conn, "session.updated", seen)
        assert updated.session.audio.input.turn_detection.type == "semantic_vad"
        assert updated.session.audio.input.turn_detection.eagerness == "auto"
        pcm = pcm24(np.concatenate([np.zeros(4_800, np.float32), decode(clip.path, 60.0),
                                    np.zeros(80_000, np.float32)]))
        for k in range(0, len(pcm), 4_800):  # 100 ms appends at ~4x real time
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[k:k + 4_800]).decode())
            await asyncio.sleep(0.025)
        done = await events_until(conn, COMPLETED, seen)
    kinds = [e.type for e in seen]
    assert kinds.count("input_audio_buffer.speech_stopped") == 1 and "error" not in kinds, kinds
    text = done.transcript.lower()
    # Words from both sides of the pause in the one turn: "aligner" is read as itself, "a
    # liner" or "forstal liner", depending on the host and the mel's float rounding.
    assert "montreal" in text and ("aligner" in text or "liner" in text), done.transcript
