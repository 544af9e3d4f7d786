"""The live bench's client (loadtest/live.py) and the official SDK's realtime client against a
tiny WebSocket server that runs the real LiveSession (scripted decoder, energy VAD) through
app.live.session.serve: what phase B's route will do, minus the engine."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.live.audio import encode_pcm16
from app.live.session import LiveSession, serve
from loadtest.lib.common import free_port
from loadtest.lib.live_common import (
    Outcome,
    Stream,
    Utterance,
    finalise,
    score,
    turns_over,
    wer_by_set,
    wer_by_turns,
)
from loadtest.live import run_sessions
from tests.live_fakes import EnergyVad, ScriptedDecoder, silence, speech

websockets = pytest.importorskip("websockets")


@pytest.fixture
async def fake_service() -> AsyncIterator[str]:
    """ws://.../v1 of a server speaking the Realtime transcription protocol."""
    from websockets.asyncio.server import ServerConnection
    from websockets.asyncio.server import serve as ws_serve

    async def handler(ws: ServerConnection) -> None:
        if not ws.request or not ws.request.path.startswith(
                "/v1/realtime?intent=transcription"):
            await ws.close(4404, "not found")
            return

        async def receive() -> str | bytes | None:
            try:
                return await ws.recv()
            except websockets.ConnectionClosed:
                return None

        async def send(event: dict[str, Any]) -> None:
            await ws.send(json.dumps(event))

        await serve(LiveSession(ScriptedDecoder(), EnergyVad()), receive, send)

    port = free_port()
    async with ws_serve(handler, "127.0.0.1", port, max_size=None):
        yield f"ws://127.0.0.1:{port}/v1"


def stream(*speech_s: float) -> Stream:
    """Noise 'speech' the scripted decoder reads as two words a second, between pauses."""
    parts, utts, pos = [silence(0.5, 16_000)], [], 8000
    for k, s in enumerate(speech_s):
        a = speech(s, 16_000, seed=k)
        words = " ".join(f"w{i}" for i in range(round(s * 2)))
        utts.append(Utterance(f"u{k}", words, pos / 16_000, (pos + a.size) / 16_000))
        parts += [a, silence(1.5, 16_000)]
        pos += a.size + 24_000
    parts.append(silence(1.0, 16_000))
    return Stream(np.concatenate(parts), utts)


async def test_the_bench_client_measures_turns_against_the_protocol(fake_service: str) -> None:
    url = fake_service + "/realtime?intent=transcription"
    r = await run_sessions(url, [stream(4.5, 2.0), stream(2.5)], drain_s=1.0)
    assert r["errors"] == [] and r["never_finalised"] == 0
    assert r["utterances"] == 3 and r["turn_latency"]["n"] == 3
    # a turn ends 500 ms into the silence; the scripted decode is instant
    assert 0.4 <= r["turn_latency"]["p50_s"] <= 3.0
    assert r["long_turns"] == 1 and r["interim_share"] == 1.0
    assert r["deltas_not_joining"] == 0 and r["items_completed"] == 3
    assert r["wer_percent"] == 0.0
    assert r["texts"][0] == "w0 w1 w2 w3 w4 w5 w6 w7 w8 w0 w1 w2 w3"
    # each utterance held by one turn of its own, whose text is the utterance's
    assert [o.turns for o in r["outcomes"]] == [
        [[("w0 w1 w2 w3 w4 w5 w6 w7 w8", 1)], [("w0 w1 w2 w3", 1)]], [[("w0 w1 w2 w3 w4", 1)]]]


async def test_the_official_sdk_runs_a_transcription_session(fake_service: str) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="sk-test", websocket_base_url=fake_service)
    pcm = encode_pcm16(np.concatenate([silence(0.3), speech(2.0), silence(1.0)]))
    seen: list[str] = []
    deltas: dict[str, str] = {}
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                "transcription": {"model": "whisper-1", "language": "en"},
                                "turn_detection": {"type": "server_vad",
                                                   "silence_duration_ms": 500}}}})
        for k in range(0, len(pcm), 4800):
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[k:k + 4800]).decode())
        await conn.input_audio_buffer.append(audio="@@@")  # bad base64: an error, not a drop
        async for event in conn:
            seen.append(event.type)
            if event.type == "conversation.item.input_audio_transcription.delta":
                deltas[event.item_id] = deltas.get(event.item_id, "") + (event.delta or "")
            if event.type == "conversation.item.input_audio_transcription.completed":
                assert event.transcript == deltas[event.item_id] == "w0 w1 w2 w3"
                break
            if len(seen) > 100:
                break
        # manual commit on the same connection
        await conn.session.update(session={"type": "transcription",
                                           "audio": {"input": {"turn_detection": None}}})
        await conn.input_audio_buffer.append(
            audio=base64.b64encode(encode_pcm16(speech(1.0))).decode())
        await conn.input_audio_buffer.commit()
        async for event in conn:
            seen.append(event.type)
            if event.type == "conversation.item.input_audio_transcription.completed":
                assert event.transcript == "w0 w1"
                break
    order = [t for t in seen if t not in ("conversation.item.input_audio_transcription.delta",
                                          "error")]
    assert order[:7] == ["session.created", "session.updated",
                         "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added",
                         "conversation.item.input_audio_transcription.completed"]
    assert "error" in seen and seen[-1].endswith(".completed")
    assert seen.count("input_audio_buffer.committed") == 2


def test_bench_session_config_is_what_the_sdk_sends() -> None:
    from openai.types.realtime.session_update_event_param import SessionUpdateEventParam

    from app.live.protocol import SessionUpdate, parse_client_event
    from loadtest.live import SESSION, session_config

    for session in (SESSION, session_config(eagerness="auto")):
        ev: SessionUpdateEventParam = {"type": "session.update", "session": session}  # type: ignore[typeddict-item]
        assert isinstance(parse_client_event(json.dumps(ev)), SessionUpdate)


def test_wer_of_the_heard_utterances_leaves_out_what_the_vad_missed() -> None:
    """An utterance no turn covered counts its words as deleted in ``wer_percent`` and not at
    all in ``wer_heard_percent``."""
    s = stream(2.0, 2.0)
    out = Outcome(final_at={0: 1.0}, heard={0}, text="w0 w1 w2 w3")
    r = score([s], [out])
    assert r["not_heard"] == 1
    assert r["wer_heard_percent"] == 0.0 and r["wer_percent"] == 50.0


def test_wer_by_turns_compares_live_and_batch_on_the_same_cuts() -> None:
    """Four utterances: one held by a turn of its own, one split by a pause into two turns, one
    no turn covered, and two sharing one turn: each counted in its own class, live against the
    clip's upload text."""
    u = [Utterance(f"c{k}", ref, 3.0 * k, 3.0 * k + 2.0)
         for k, ref in enumerate(["red green blue", "cat dog bird", "apple", "pear", "plum"])]
    spans = [(0.0, 2.1, "red green blue"), (2.9, 4.0, "cat"), (4.0, 5.1, "dig bard"),
             (8.9, 14.0, "pear plum")]
    turns = turns_over(u, spans)
    assert [len(t) for t in turns] == [1, 2, 0, 1, 1]
    out = Outcome(turns=turns)
    batch = {"c0": "red green blue", "c1": "cat dog bird", "c2": "apple", "c3": "pear",
             "c4": "plum"}
    r = wer_by_turns([Stream(np.zeros(1), u)], [out], batch)
    assert r["not_heard"] == 1
    assert r["one_turn"] == {"utterances": 1, "words": 3, "live_wer_percent": 0.0,
                             "batch_wer_percent": 0.0}
    assert r["split"]["utterances"] == 1 and r["split"]["batch_wer_percent"] == 0.0
    assert round(r["split"]["live_wer_percent"]) == 67  # "cat dig bard": two of three wrong
    assert r["merged"]["utterances"] == 2 and r["merged"]["words"] == 2


def test_an_utterance_heard_in_part_is_timed_to_the_part_heard() -> None:
    """Utterance 0 (speech 1-2 s and 3-6 s) is covered by a turn up to 3.5 s only; the next
    turn (utterance 1) completes 5 s later. It is final when its own turn completed, timed from
    3.5 s; utterance 1, reached by its turn, is timed from its end as before; a turn ending
    within ``tolerance`` of an utterance's end reaches it."""
    u0 = Utterance("a", "x", 1.0, 6.0, ((1.0, 2.0), (3.0, 6.0)))
    u1 = Utterance("b", "y", 8.0, 9.0, ((8.0, 9.0),))
    s = Stream(np.zeros(16_000 * 10, np.float32), [u0, u1])
    out = Outcome(t0=100.0)
    finalise(out, s, [(0.7, 3.5, 104.2), (7.7, 9.6, 110.0)], tolerance=0.5)
    assert out.heard == {0, 1}
    assert out.final_at == {0: 104.2, 1: 110.0}
    assert out.heard_to == {0: 3.5, 1: 9.0}
    r = score([s], [out])
    assert r["turn_latency"]["n"] == 2 and r["turn_latency"]["max_s"] == 1.0  # 110 - 109
    # each timed turn: when its audio ended (from the stream's start), its latency
    assert r["turn_latencies"] == [[3.5, 0.7], [9.0, 1.0]]
    near = Outcome()
    finalise(near, s, [(0.7, 5.7, 1.0)], tolerance=0.5)
    assert near.final_at == {0: 1.0} and near.heard_to == {0: 6.0}


def test_a_turn_before_an_utterance_never_finalises_it() -> None:
    """A turn that ended just before a short utterance's heard part does not finalise it."""
    u = Utterance("a", "x", 2.0, 4.0, ((2.0, 2.4), (3.5, 4.0)))
    s = Stream(np.zeros(16_000 * 5, np.float32), [u])
    out = Outcome()
    finalise(out, s, [(0.0, 1.9, 1.0), (1.7, 2.6, 2.0)], tolerance=0.5)
    assert out.final_at == {0: 2.0} and out.heard_to == {0: 2.4}


def test_wer_by_set_keeps_read_speech_apart_from_the_hard_cases() -> None:
    """Read-speech utterances (a LibriSpeech and an LJ Speech clip) and an MFA one, each scored
    live (its turns' texts; none: nothing heard) against its clip's upload."""
    u = [Utterance(f"c{k}", ref, 3.0 * k, 3.0 * k + 2.0)
         for k, ref in enumerate(["red green blue", "cat dog", "montreal forced aligner"])]
    turns = turns_over(u, [(0.0, 2.1, "red green blue"), (2.9, 5.1, "cat dig")])
    batch = {"c0": "red green blue", "c1": "cat dog", "c2": "montreal forest aligner"}
    sets = {"c0": "librispeech", "c1": "ljspeech", "c2": "mfa_short_phrases"}
    r = wer_by_set([Stream(np.zeros(1), u)], [Outcome(turns=turns)], batch, sets)
    assert r["read_speech"] == {"utterances": 2, "words": 5, "live_wer_percent": 20.0,
                                "batch_wer_percent": 0.0}
    assert r["other_sets"] == {"utterances": 1, "words": 3, "live_wer_percent": 100.0,
                               "batch_wer_percent": 33.333}  # rounded by wer_percent


def test_the_turns_uploaded_are_cut_and_scored_as_the_live_turns() -> None:
    """Each finalised turn's audio is the stream between its span's ends (an open end: to the
    stream's end), and its upload's text takes the live text's place utterance by utterance."""
    from loadtest.lib.live_common import read_as, turn_audio

    audio = np.arange(16_000 * 6, dtype=np.float32)
    u = [Utterance("a", "red green blue", 0.5, 2.0), Utterance("b", "cat dog", 3.0, 5.0)]
    s = Stream(audio, u)
    spans: list[tuple[float, float | None, str]] = [
        (0.4, 1.2, "red"), (1.3, 2.2, "green blew"), (2.9, None, "cat dig")]
    cut = turn_audio(s, spans)
    assert [(c[0], c.size) for c in cut] == [(6400.0, 12_800), (20_800.0, 14_400),
                                           (46_400.0, 49_600)]
    live = Outcome(heard={0, 1}, spans=spans, turns=turns_over(u, spans))
    read = read_as(s, live, ["red", "green blue", "cat dog"])
    assert read.text == "red green blue cat dog" and read.heard == {0, 1}
    assert read.turns == [[("red", 1), ("green blue", 1)], [("cat dog", 1)]]
    batch = {"a": "red green blue", "b": "cat dog"}
    r = wer_by_turns([s], [live], batch)
    assert r["split"]["live_wer_percent"] == pytest.approx(100 / 3, abs=0.01)
    assert r["one_turn"]["live_wer_percent"] == 50.0
    r = wer_by_turns([s], [read], batch)
    assert r["split"]["live_wer_percent"] == 0.0 and r["one_turn"]["live_wer_percent"] == 0.0
    with pytest.raises(ValueError):
        read_as(s, live, ["red"])  # a text for every turn, or none


def test_runs_of_the_live_bench_pool_by_words() -> None:
    """Per N, each run's WERs weighted by its reference words; runs without the turns' uploads
    (older files) and other N are kept apart."""
    from loadtest.live_report import pooled

    def row(n: int, live: float, turns: float, words: int) -> dict[str, Any]:
        return {"streams": n, "wer_percent": live, "turns_uploaded": {"wer_percent": turns},
                "batch_wer_percent": 5.0, "batch_stream_wer_percent": 9.0,
                "wer_by_set": {"read_speech": {"words": words - 10}, "other_sets": {"words": 10}}}

    runs = [{"results": [row(4, 10.0, 8.0, 100), row(16, 20.0, 22.0, 400)]},
            {"results": [row(4, 4.0, 5.0, 300)]},
            {"results": [{"streams": 4, "wer_percent": 99.0}]}]
    got = pooled(runs)
    assert got[4] == {"live": 5.5, "turns_uploaded": 5.8, "clips": 5.0, "streams": 9.0,
                      "words": 400, "runs": 2}
    assert got[16]["live"] == 20.0 and got[16]["runs"] == 1


def test_runs_of_the_live_bench_pool_their_turn_latencies() -> None:
    """Per N, the percentiles of every timed turn of every run; rows without the per-turn list
    (older files) are left out."""
    from loadtest.live_report import pooled_latency

    runs = [{"results": [{"streams": 16, "turn_latencies": [[1.0, 0.5], [2.0, 2.0]]}]},
            {"results": [{"streams": 16, "turn_latencies": [[1.0, 1.0]]},
                         {"streams": 4, "turn_latency": {"n": 3}}]}]
    got = pooled_latency(runs)
    assert list(got) == [16]
    assert got[16]["n"] == 3 and got[16]["max_s"] == 2.0 and got[16]["p50_s"] == 1.0
    assert got[16]["runs"] == 2


async def test_the_capacity_bench_counts_the_services_cpu_per_second_of_session_audio(
        fake_service: str) -> None:
    """loadtest/live_capacity.py's row: the sessions' outcome as the live bench scores it, and
    the service's CPU over them per second of the audio sent (speech, pauses and the drain)."""
    from loadtest.live_capacity import one

    class Measured:
        url = fake_service.replace("ws://", "http://", 1).removesuffix("/v1")

        def __init__(self) -> None:
            self.readings = iter([{"service": 10.0, "children": 1.0},
                                  {"service": 12.5, "children": 1.0}])

        def cpu_s(self) -> dict[str, float]:
            return next(self.readings)

    streams = [stream(4.5, 2.0), stream(2.5)]
    row = await one(Measured(), streams, 1.0)
    audio_s = sum(s.audio.size / 16_000 + 1.0 for s in streams)
    assert row["streams"] == 2 and row["session_audio_s"] == round(audio_s, 1)
    assert row["service_cpu_s"] == 2.5 and row["prep_processes_cpu_s"] == 0.0
    assert row["service_cpu_ms_per_audio_s"] == round(2500 / audio_s, 2)
    assert row["wall_s"] > 0 and abs(row["service_cores"] - 2.5 / row["wall_s"]) < 0.01
    assert row["utterances"] == 3 and row["turn_latency"]["n"] == 3
    assert row["never_finalised"] == row["not_heard"] == row["errors"] == 0


def test_the_transport_floor_bench_counts_every_append_both_ways(tmp_path: Path) -> None:
    """loadtest/ws_floor.py: both servers (deflate declined and accepted, through the service's
    own uvicorn config) take every append sent, and the report has the server's CPU per one."""
    from loadtest import ws_floor

    out = tmp_path / "floor.json"
    assert ws_floor.main(["--clients", "2", "--seconds", "0.5", "--runs", "1",
                          "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["deflate"] for r in report["runs"]] == [False, True]
    for r in report["runs"]:
        assert r["messages"] == 2 * 5 and r["server_cpu_s"] >= 0
        assert r["us_per_message"] == round(r["server_cpu_s"] / r["messages"] * 1e6, 1)
    assert report["plain"]["min_us"] == report["runs"][0]["us_per_message"]
