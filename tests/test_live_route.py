"""The ``/v1/realtime`` route on the whole app in process (middleware, door, store, Silero) over
a fake engine: keys on the handshake, client secrets (subprotocol and query), session limits,
bad events answered, the transcript kept as a job, the live metrics. One app for the module:
its start is the cost (the model's fake, Silero's load)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.live.audio import encode_pcm16
from tests.helpers import fake_service, fake_settings, samples, sha
from tests.test_webhooks import SECRET, Receiver, signature_ok

websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402

KEY, OTHER = "live-key-1", "live-key-2"
BOUND = 20.0


@pytest.fixture(scope="module")
def hooks() -> Iterator[Receiver]:
    rx = Receiver().start()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, hooks: Receiver) -> Iterator[str]:
    with fake_service(
            tmp_path_factory.mktemp("live-route"),
            webhooks={"secret": SECRET}, outbound={"allow_private": True},
            security={"api_key_sha256": [sha(KEY), sha(OTHER)]},
            live={"max_sessions_per_key": 2, "max_sessions": 3, "idle_timeout_s": 2.0,
                  "max_event_bytes": 64 * 1024}) as u:
        yield u


def wait_released(url: str) -> None:
    """Until no session holds a slot, within BOUND: a leaked slot fails. A client's close returns
    once the server's protocol answers the close frame, a moment before the session's handler
    ends and gives its slot back; a session opened at once on the same key could find the
    per-key limit still full on a loaded machine (CI, stop 46)."""
    open_now = -1.0
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        open_now = samples(httpx.get(url + "/metrics").text)["batchscribe_live_sessions_open"][0][1]
        if open_now == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{open_now} live sessions still hold a slot {BOUND} s on")


@pytest.fixture(autouse=True)
def released(url: str) -> Iterator[None]:
    """Each test starts with every slot free and gives back every slot it took."""
    wait_released(url)
    yield
    wait_released(url)


def ws_url(url: str, **query: str) -> str:
    q = "&".join(f"{k}={v}" for k, v in {"intent": "transcription", **query}.items())
    return url.replace("http://", "ws://") + "/v1/realtime?" + q


def audio_event(seconds: float) -> str:
    pcm = encode_pcm16(np.zeros(int(seconds * 24_000), np.float32))  # the default: 24 kHz PCM16
    return json.dumps({"type": "input_audio_buffer.append",
                       "audio": base64.b64encode(pcm).decode()})


async def until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    """Events up to and including the first of ``kind``."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(BOUND):
        while not seen or seen[-1]["type"] != kind:
            seen.append(json.loads(await ws.recv()))
    return seen


MANUAL = json.dumps({"type": "session.update", "session": {
    "type": "transcription", "audio": {"input": {"turn_detection": None}}}})


async def test_a_keyed_session_is_kept_as_a_job_with_its_formats_and_webhook(
        url: str, hooks: Receiver) -> None:
    async with connect(ws_url(url, callback_url=hooks.url),
                       additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.response is not None
        job_id = ws.response.headers["x-batchscribe-job"]
        await until(ws, "session.created")
        await ws.send(MANUAL)
        await until(ws, "session.updated")
        await ws.send(audio_event(0.5))
        await ws.send("{not json")  # bad events: an error each, the session goes on
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}))
        await ws.send(json.dumps({"type": "no.such.event"}))
        await ws.send(audio_event(2.0))  # 128 KB of base64: past max_event_bytes (64 KiB here)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        seen = await until(ws, "conversation.item.input_audio_transcription.completed")
        codes = [e["error"]["code"] for e in seen if e["type"] == "error"]
        assert len(codes) == 4 and codes[-1] == "event_too_large", codes
        assert seen[-1]["transcript"] == "w0"
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                            timeout=BOUND) as c:
        for _ in range(100):  # the row is written as the session winds down after the close
            r = await c.get(f"/jobs/{job_id}")
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200 and r.json()["status"] == "done", r.text
        assert (await c.get(f"/jobs/{job_id}/result", params={"format": "text"})).text.strip() == "w0"
        srt = (await c.get(f"/jobs/{job_id}/result", params={"format": "srt"})).text
        assert srt.startswith("1\n00:00:00,000 --> 00:00:00,4") and "w0" in srt  # 0.5 s turn
        assert (await c.get(f"/jobs/{job_id}", headers={"Authorization": f"Bearer {OTHER}"})
                ).status_code == 404  # another key's session is not found
        metrics = samples((await c.get("/metrics")).text)
        key_secret = (await c.get("/webhooks/secret")).json()["secret"]  # signed for this key
        for _ in range(200):  # the webhook goes out as any finished job's
            if hooks.for_job(job_id):
                break
            await asyncio.sleep(0.05)
    [hit] = hooks.for_job(job_id)
    assert not signature_ok(hit)  # the server's own secret does not verify a keyed delivery
    assert signature_ok(hit, key_secret) and json.loads(hit.body)["status"] == "done"
    assert metrics["batchscribe_live_turn_latency_seconds_count"][0][1] >= 1
    assert metrics["batchscribe_live_sessions_open"][0][1] == 0
    assert "batchscribe_live_interim_decodes_total" in metrics
    assert "batchscribe_live_stream_lag_seconds_count" in metrics


async def test_handshakes_need_a_key_or_a_client_secret(url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(websockets.InvalidStatus) as e:
            async with connect(ws_url(url), additional_headers=headers):
                pass
        assert e.value.response.status_code == 401
    async with httpx.AsyncClient(base_url=url, timeout=BOUND) as c:
        assert (await c.post("/v1/realtime/client_secrets")).status_code == 401
        r = await c.post("/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {KEY}"},
                   json={"expires_after": {"anchor": "created_at", "seconds": 60},
                         "session": {"type": "transcription"}})
    assert r.status_code == 200, r.text
    secret = r.json()
    assert secret["value"].startswith("ek_") and secret["session"]["type"] == "transcription"
    # a browser's way: the subprotocol (the server answers "realtime"), then the query fallback
    async with connect(ws_url(url), subprotocols=[
            "realtime", f"openai-insecure-api-key.{secret['value']}"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "realtime"
        assert (await until(ws, "session.created"))[-1]["session"]["type"] == "transcription"
    async with connect(ws_url(url, client_secret=secret["value"])) as ws:
        await until(ws, "session.created")
    tampered = secret["value"][:-2] + ("AA" if not secret["value"].endswith("AA") else "BB")
    with pytest.raises(websockets.InvalidStatus):
        async with connect(ws_url(url, client_secret=tampered)):
            pass
    with pytest.raises(websockets.InvalidStatus):  # a real key never rides a query string
        async with connect(ws_url(url, client_secret=KEY)):
            pass
    # issue 38: a page on another site may not open a socket, even with a valid client secret
    # (the cross-site guard answers the handshake 403); the same handshake without Origin works
    for origin in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        with pytest.raises(websockets.InvalidStatus) as e:
            async with connect(ws_url(url, client_secret=secret["value"]),
                               additional_headers=origin):
                pass
        assert e.value.response.status_code == 403


async def test_a_client_secrets_session_is_where_its_socket_starts(url: str) -> None:
    """As on OpenAI's API: the ``session`` a client secret is minted for is checked at once
    (400 naming the field) and is the session a socket opened with that secret starts as, so a
    page need not send it again; ``session.update`` still changes it, and a socket opened with
    the API key itself starts at the defaults."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def session(**audio_input: Any) -> dict[str, Any]:
        return {"session": {"type": "transcription", "audio": {"input": audio_input}}}

    german = session(format={"type": "audio/pcm", "rate": 16000}, turn_detection=None,
                     transcription={"language": "de", "prompt": "Guten Tag."})
    async with httpx.AsyncClient(base_url=url, timeout=BOUND, headers=auth) as c:
        refused = [await c.post("/v1/realtime/client_secrets", json=body) for body in (
            session(format={"type": "audio/pcm", "rate": 44100}),
            session(turn_detectoin=None),
            {"session": {"type": "realtime"}},
            session(transcription={"prompt": "x" * 3999, "keywords": ["y" * 199] * 20}))]
        r = await c.post("/v1/realtime/client_secrets", json=german)
    assert [x.status_code for x in refused] == [400] * 4, [x.text for x in refused]
    assert [x.json()["error"]["param"] for x in refused] == [
        "session.audio.input.format.rate", "session.audio.input.turn_detectoin", "session.type",
        "session"]
    assert r.status_code == 200, r.text
    secret = r.json()
    opened = secret["session"]["audio"]["input"]
    assert opened["turn_detection"] is None and opened["format"] == {"type": "audio/pcm",
                                                                     "rate": 16000}
    assert opened["transcription"]["language"] == "de"
    async with connect(ws_url(url), subprotocols=[
            "realtime", f"openai-insecure-api-key.{secret['value']}"]) as ws:  # type: ignore[list-item]
        created = (await until(ws, "session.created"))[-1]["session"]
        assert created["audio"]["input"] == opened
        pcm = encode_pcm16(np.zeros(8_000, np.float32))  # 0.5 s at 16 kHz: manual turns
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(pcm).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        seen = await until(ws, "conversation.item.input_audio_transcription.completed")
        assert "input_audio_buffer.speech_started" not in [e["type"] for e in seen]
        await ws.send(json.dumps({"type": "session.update",
                                  **session(turn_detection={"type": "server_vad"})}))
        updated = (await until(ws, "session.updated"))[-1]["session"]["audio"]["input"]
        assert updated["turn_detection"]["type"] == "server_vad"
        assert updated["transcription"]["language"] == "de"  # what the update left out stays
    await asyncio.to_thread(wait_released, url)  # three sessions in turn on one key (limit 2)
    async with connect(ws_url(url, client_secret=secret["value"])) as ws:  # the query's way
        assert (await until(ws, "session.created"))[-1]["session"]["audio"]["input"] == opened
    await asyncio.to_thread(wait_released, url)
    async with connect(ws_url(url), additional_headers=auth) as ws:
        plain = (await until(ws, "session.created"))[-1]["session"]["audio"]["input"]
        assert plain["turn_detection"]["type"] == "server_vad" and plain["format"]["rate"] == 24000


async def test_sessions_past_the_key_limit_get_an_error_then_a_close(url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with connect(ws_url(url), additional_headers=auth) as a, \
            connect(ws_url(url), additional_headers=auth) as b:
        await until(a, "session.created")
        await until(b, "session.created")
        async with connect(ws_url(url), additional_headers=auth) as c:
            error = (await until(c, "error"))[-1]
            assert error["error"]["code"] == "session_limit"
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(c.recv(), BOUND)
            assert c.close_code == 1013
        async with connect(ws_url(url), additional_headers={  # another key still gets one
                "Authorization": f"Bearer {OTHER}"}) as d:
            await until(d, "session.created")


async def test_idle_sessions_and_wrong_intents_are_closed_with_a_reason(url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with connect(ws_url(url), additional_headers=auth) as ws:
        error = (await until(ws, "error"))[-1]  # idle_timeout_s = 2 in this module
        assert error["error"]["code"] == "idle_timeout"
    async with connect(ws_url(url).replace("transcription", "conversation"),
                       additional_headers=auth) as ws:
        assert (await until(ws, "error"))[-1]["error"]["code"] == "invalid_intent"


def test_live_settings_have_defaults(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    assert s.live.max_sessions >= 1 and s.live.max_sessions_per_key >= 1
    assert s.live.idle_timeout_s > 0 and s.live.max_session_s > 0 and s.live.max_buffer_s > 0


async def test_a_deflate_offer_is_declined_unless_the_operator_accepts_it(
        url: str, tmp_path: Path) -> None:
    """websockets' client offers permessage-deflate (as the OpenAI SDK's does); the service
    declines it by default (``live.per_message_deflate``: inflating every append cost the event
    loop ~12 %), and serves the session uncompressed. Accepting it is uvicorn's own setting,
    which the service's config sets from ``live.per_message_deflate``."""
    from app.__main__ import server_config

    auth = {"Authorization": f"Bearer {KEY}"}
    await asyncio.to_thread(wait_released, url)
    async with connect(ws_url(url), additional_headers=auth) as ws:
        assert ws.request is not None and "permessage-deflate" in \
            ws.request.headers.get("Sec-WebSocket-Extensions", "")  # offered
        assert ws.protocol.extensions == []  # declined
        await until(ws, "session.created")
    on = fake_settings(tmp_path, live={"per_message_deflate": True})
    assert server_config(None, on).ws_per_message_deflate is True
    assert server_config(None, fake_settings(tmp_path)).ws_per_message_deflate is False
