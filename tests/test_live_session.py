"""The live session's state machine (app/live/session.py) with a scripted decoder and an energy
VAD: event order, interim text, manual turns, bad input, limits, backpressure."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from app.live.config import LiveLimits
from app.live.session import LiveSession
from tests.live_fakes import (
    EnergyVad,
    ScriptedDecoder,
    appends,
    event,
    manual,
    run_script,
    silence,
    speech,
    types,
)
from tests.test_live_protocol import sdk_parses


def joined(events: list[dict], item_id: str) -> str:
    return "".join(e["delta"] for e in events
                   if e["type"].endswith(".delta") and e["item_id"] == item_id)


async def test_server_vad_turn_sends_openai_events_in_order_with_text_while_speaking() -> None:
    audio = np.concatenate([silence(1.0), speech(3.0), silence(1.0)])
    events, session, reason = await run_script(appends(audio))
    for e in events:
        sdk_parses(e)
    seq = types(events)
    assert reason == "disconnected"
    assert seq[0] == "session.created"
    start, stop = seq.index("buf.speech_started"), seq.index("buf.speech_stopped")
    assert seq[stop:stop + 3] == ["buf.speech_stopped", "buf.committed", "conversation.item.added"]
    assert seq[-1] == "tr.completed"
    assert "tr.delta" in seq[start:stop]  # text before the turn ended
    item = events[start]["item_id"]
    assert {e.get("item_id") for e in events[start:]} - {None} == {item}
    assert 650 <= events[start]["audio_start_ms"] <= 740  # 1 s - 300 ms padding (one chunk)
    assert 4500 <= events[stop]["audio_end_ms"] <= 4600  # 4 s + 500 ms of silence
    done = events[-1]
    assert done["transcript"] == "w0 w1 w2 w3 w4 w5" == joined(events, item)
    assert done["usage"] == {"type": "duration", "seconds": pytest.approx(3.8, abs=0.05)}
    assert session.items[0].transcript == done["transcript"] and session.items[0].interim_text


async def test_the_final_decode_starts_at_the_pause() -> None:
    """The turn's final decode starts ``early_final_ms`` (here 200) into the silence, while the VAD
    still waits out its 500 ms: one final decode, of the turn up to the pause, whose text is the
    completed transcript. Off, the one final decode is of the whole turn (3.8 s)."""
    audio = np.concatenate([silence(1.0), speech(3.0), silence(1.0)])
    for early, low, high in ((200, 3.45, 3.65), (0, 3.75, 3.85)):
        dec = ScriptedDecoder()
        events, _, _ = await run_script(appends(audio), LiveLimits(early_final_ms=early), dec)
        finals = [seconds for kind, seconds, _ in dec.calls if kind == "final"]
        assert len(finals) == 1 and low <= finals[0] <= high, (early, finals)
        assert events[-1]["transcript"] == "w0 w1 w2 w3 w4 w5"


async def test_speech_after_a_pause_voids_the_early_final() -> None:
    """A 350 ms gap (a pause, not the 500 ms end): the early decode started there is dropped
    and the turn's final is the decode from its second pause, all the speech in it."""
    audio = np.concatenate([silence(0.5), speech(1.5), silence(0.35), speech(1.5, seed=1),
                            silence(1.0)])
    dec = ScriptedDecoder()
    events, _, _ = await run_script(appends(audio), decoder=dec)
    assert sum(kind == "final" for kind, _, _ in dec.calls) == 2
    done = [e for e in events if e["type"].endswith(".completed")]
    assert len(done) == 1 and done[0]["transcript"] == "w0 w1 w2 w3 w4 w5"


async def test_an_early_decode_that_speech_resumed_after_is_interim_text() -> None:
    """Two pauses inside one turn, every interim decode shed: the two early decodes started at
    the pauses read the turn so far, and stand as its interims, so the words they agree on are
    sent while the turn is still open (they used to be thrown away)."""
    audio = np.concatenate([silence(0.5), speech(1.5), silence(0.35), speech(1.5, seed=1),
                            silence(0.35), speech(1.5, seed=2), silence(1.0)])
    dec = ScriptedDecoder()
    dec.shed = True
    events, _, _ = await run_script(appends(audio), decoder=dec)
    seq = types(events)
    stopped = seq.index("buf.speech_stopped")
    assert "tr.delta" in seq[:stopped]  # text while the turn was open
    assert sum(kind == "final" for kind, _, _ in dec.calls) == 3
    assert dec.demoted == 2  # the batcher was told: they wait behind true finals now
    done = [e for e in events if e["type"].endswith(".completed")]
    assert len(done) == 1 and done[0]["transcript"] == " ".join(f"w{k}" for k in range(9))
    assert done[0]["transcript"] == joined(events, done[0]["item_id"])


async def test_two_turns_complete_in_order_and_chain_their_items() -> None:
    audio = np.concatenate([speech(1.5), silence(1.0), speech(2.0, seed=1), silence(1.0)])
    events, _, _ = await run_script(appends(audio))
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert [c["item_id"] for c in completed] == [c["item_id"] for c in committed]
    assert committed[0]["previous_item_id"] is None
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    for c in completed:
        assert c["transcript"] == joined(events, c["item_id"])


async def test_the_vads_state_restarts_wherever_a_turn_ends() -> None:
    """Server VAD on: two turns that stop on their silence, then one the client commits and a
    buffer it clears; each restarts the session's probability stream once (Silero's state,
    app/live/turns.py SileroTurns)."""
    audio = np.concatenate([speech(1.5), silence(1.0), speech(2.0, seed=1), silence(1.0)])
    msgs = [*appends(audio), *appends(speech(1.0, seed=2)), event("input_audio_buffer.commit"),
            *appends(speech(0.5, seed=3)), event("input_audio_buffer.clear")]
    events, session, _ = await run_script(msgs)
    assert types(events).count("buf.speech_stopped") == 2
    assert types(events).count("buf.committed") == 3 and "buf.cleared" in types(events)
    turns = session._turns
    assert turns is not None
    assert turns._probs.restarts == 4  # type: ignore[attr-defined]


def finals(dec: ScriptedDecoder) -> list[tuple[float, str | None]]:
    return [(round(seconds, 1), o.prefix) for kind, seconds, o in dec.calls if kind == "final"]


async def test_a_turn_after_a_short_pause_is_read_on_from_the_turn_before() -> None:
    """800 ms of silence ends the first turn (500 ms) and the second's 300 ms of padding reaches
    back to it (they touch: ``context_gap_ms`` 0): the second turn's final reads both turns'
    audio and continues the first's text (the fake numbers the words it hears on from the
    prefix's). Its transcript is its own."""
    audio = np.concatenate([silence(0.5), speech(1.5), silence(0.8), speech(1.0, seed=1),
                            silence(1.0)])
    dec = ScriptedDecoder()
    events, _, _ = await run_script(appends(audio), decoder=dec)
    done = [e["transcript"] for e in events if e["type"].endswith(".completed")]
    assert done == ["w0 w1 w2", "w3 w4"], done
    (first, none), (both, prefix) = finals(dec)
    assert none is None and prefix == "w0 w1 w2"
    # From the first turn's padding (0.3 s) to the second's pause (200 ms into its silence):
    assert first == pytest.approx(0.3 + 1.5 + 0.2, abs=0.15)
    assert both == pytest.approx(0.3 + 1.5 + 0.8 + 1.0 + 0.2, abs=0.15)
    # A longer pause (0.7 s between the turns) with context_gap_ms to cover it: the same.
    paused = np.concatenate([silence(0.5), speech(1.5), silence(1.5), speech(1.0, seed=1),
                             silence(1.0)])
    dec = ScriptedDecoder()
    events, _, _ = await run_script(appends(paused), LiveLimits(context_gap_ms=1000), dec)
    done = [e["transcript"] for e in events if e["type"].endswith(".completed")]
    assert done == ["w0 w1 w2", "w3 w4"] and finals(dec)[1][1] == "w0 w1 w2", done


async def test_turns_far_apart_or_with_context_off_are_read_alone() -> None:
    audio = np.concatenate([silence(0.5), speech(1.5), silence(3.0), speech(1.0, seed=1),
                            silence(1.0)])
    near = np.concatenate([silence(0.5), speech(1.5), silence(0.8), speech(1.0, seed=1),
                           silence(1.0)])
    paused = np.concatenate([silence(0.5), speech(1.5), silence(1.5), speech(1.0, seed=1),
                             silence(1.0)])  # 0.7 s between the first's end and the second's
    for sound, limits in ((audio, None), (paused, None), (near, LiveLimits(context_max_s=0)),
                          (near, LiveLimits(context_max_s=2.0)),
                          (paused, LiveLimits(context_gap_ms=500))):
        dec = ScriptedDecoder()
        events, _, _ = await run_script(appends(sound), limits, dec)
        done = [e["transcript"] for e in events if e["type"].endswith(".completed")]
        assert done == ["w0 w1 w2", "w0 w1"] and all(p is None for _, p in finals(dec)), done


async def test_a_doubtful_continued_read_falls_back_to_the_turn_alone() -> None:
    """The engine runs no fallback on a decode that continues a prefix; one that loops or is
    unsure comes back ``doubtful``, and the session reads the turn's own audio instead."""
    audio = np.concatenate([silence(0.5), speech(1.5), silence(0.8), speech(1.0, seed=1),
                            silence(1.0)])
    dec = ScriptedDecoder()
    dec.doubtful = True
    events, session, _ = await run_script(appends(audio), decoder=dec)
    done = [e["transcript"] for e in events if e["type"].endswith(".completed")]
    assert done == ["w0 w1 w2", "w0 w1"], done
    assert [p for _, p in finals(dec)] == [None, "w0 w1 w2", None]
    assert session.counts["final"] == 3


async def test_manual_mode_commits_what_was_appended() -> None:
    msgs = [manual(), *appends(speech(2.0)), event("input_audio_buffer.commit")]
    events, session, _ = await run_script(msgs)
    seq = types(events)
    assert seq[:2] == ["session.created", "session.updated"]
    assert events[1]["session"]["audio"]["input"]["turn_detection"] is None
    assert "buf.speech_started" not in seq and "buf.speech_stopped" not in seq
    assert seq[-3:] in (["buf.committed", "conversation.item.added", "tr.completed"],
                        ["conversation.item.added", "tr.delta", "tr.completed"])
    assert events[-1]["transcript"] == "w0 w1 w2 w3" == joined(events, events[-1]["item_id"])
    assert len(session.items) == 1


async def test_commit_of_an_empty_buffer_and_clear() -> None:
    msgs = [manual(), event("input_audio_buffer.commit", event_id="c1"),
            *appends(speech(1.0)), event("input_audio_buffer.clear"),
            event("input_audio_buffer.commit")]
    events, session, _ = await run_script(msgs)
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["input_audio_buffer_commit_empty"] * 2
    assert errors[0]["event_id"] == "c1" and "0.00ms" in errors[0]["message"]
    assert "buf.cleared" in types(events) and session.items == []


async def test_bad_input_is_answered_and_the_session_goes_on() -> None:
    msgs = [manual(), "{oops", event("input_audio_buffer.append", audio="@@not-b64@@",
                                     event_id="a1"),
            event("session.update", session={"type": "transcription", "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 44100}}}}),
            event("response.create"), json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": "A" * 9000}),
            *appends(speech(1.0)), event("input_audio_buffer.commit")]
    events, _, reason = await run_script(msgs, LiveLimits(max_event_bytes=8192))
    codes = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert codes == ["invalid_json", "invalid_value", "invalid_value", "invalid_value",
                     "event_too_large"]
    bad_audio = [e["error"] for e in events if e["type"] == "error"][1]
    assert bad_audio["param"] == "audio" and bad_audio["event_id"] == "a1"
    assert events[-1]["type"].endswith(".completed") and events[-1]["transcript"] == "w0 w1"
    assert reason == "disconnected"


async def test_telephony_mu_law_at_8k() -> None:
    import audioop

    def ulaw(x: np.ndarray) -> bytes:
        return audioop.lin2ulaw((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes(), 2)

    update = event("session.update", session={"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcmu"}}}})
    audio = np.concatenate([silence(0.5, 8000), speech(2.0, 8000), silence(1.0, 8000)])
    events, _, _ = await run_script([update, *appends(audio, rate=8000, encode=ulaw)])
    assert events[1]["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert events[-1]["type"].endswith(".completed")
    assert events[-1]["transcript"] == "w0 w1 w2 w3"


async def test_manual_buffer_is_bounded() -> None:
    msgs = [manual(), *appends(speech(3.0)), event("input_audio_buffer.commit")]
    events, session, _ = await run_script(msgs, LiveLimits(max_buffer_s=2.0))
    full = [e for e in events if e["type"] == "error"]
    assert full and all(e["error"]["code"] == "input_audio_buffer_full" for e in full)
    assert session.items[0].end_ms - session.items[0].start_ms <= 2000


async def test_idle_and_total_limits_end_the_session_with_an_error() -> None:
    events, _, reason = await run_script([], LiveLimits(idle_timeout_s=0.05), leave=False)
    assert reason == "idle_timeout" and events[-1]["error"]["code"] == "idle_timeout"
    events, _, reason = await run_script([], LiveLimits(idle_timeout_s=60, max_session_s=0.05),
                                         leave=False)
    assert reason == "session_expired" and events[-1]["error"]["code"] == "session_expired"


async def test_an_open_turn_is_finished_when_the_client_leaves() -> None:
    events, session, _ = await run_script(appends(np.concatenate([silence(0.5), speech(1.5)])))
    assert types(events)[-1] == "tr.completed"
    assert session.items[0].transcript == "w0 w1 w2"


async def test_a_failed_final_decode_is_reported_for_its_item() -> None:
    dec = ScriptedDecoder()
    dec.fail = {"final"}
    events, session, _ = await run_script([manual(), *appends(speech(1.0)),
                                           event("input_audio_buffer.commit")], decoder=dec)
    failed = [e for e in events if e["type"].endswith(".failed")]
    assert len(failed) == 1 and failed[0]["error"]["type"] == "server_error"
    assert "fell over" not in json.dumps(failed[0])  # issue 38: the exception's text stays in the log
    sdk_parses(failed[0])
    assert session.items[0].error and session.items[0].transcript is None


async def test_shed_interim_decodes_send_nothing_and_the_final_still_comes() -> None:
    dec = ScriptedDecoder()
    dec.shed = True
    events, session, _ = await run_script(appends(np.concatenate([speech(3.0), silence(1.0)])),
                                          decoder=dec)
    deltas = [e for e in events if e["type"].endswith(".delta")]
    assert len(deltas) == 1 and deltas[0]["delta"] == events[-1]["transcript"]
    assert session.counts["interim_shed"] >= 2


async def test_interims_back_off_while_shed_and_recover() -> None:
    """Shed interims double the interval (1, 2, 4, 8 s of new audio): 12 s of speech asks for
    about 11 interims when each is answered, and only a few while each is shed."""
    answered = ScriptedDecoder()
    await run_script(appends(np.concatenate([speech(12.0), silence(1.0)])), decoder=answered)
    shed = ScriptedDecoder()
    shed.shed = True
    await run_script(appends(np.concatenate([speech(12.0), silence(1.0)])), decoder=shed)
    asked = [sum(k == "interim" for k, _, _ in d.calls) for d in (answered, shed)]
    assert asked[0] >= 10 and asked[1] <= 4, asked


async def test_transcription_options_reach_the_decoder() -> None:
    dec = ScriptedDecoder()
    update = event("session.update", session={"type": "transcription", "audio": {"input": {
        "transcription": {"language": "de", "prompt": "Namen", "keywords": ["Kiel", "Ulm"]},
        "turn_detection": None}}})
    await run_script([update, *appends(speech(0.5)), event("input_audio_buffer.commit")],
                     decoder=dec)
    opts = dec.calls[-1][2]
    assert (opts.language, opts.prompt, opts.hotwords) == ("de", "Namen", "Kiel Ulm")


async def test_a_client_faster_than_real_time_is_slowed_not_buffered() -> None:
    """With every decode held, a session with max_pending_finals=1 takes no append once one
    turn is waiting for its final: the append (and so the socket) waits."""
    dec = ScriptedDecoder()
    dec.gate.clear()
    session = LiveSession(dec, EnergyVad(), LiveLimits(max_pending_finals=1,
                                                       interim_interval_ms=0))
    blocked = None
    for m in appends(np.concatenate([speech(1.0), silence(2.0)])):
        task = asyncio.create_task(session.handle(m))
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done:  # this append waits for the turn's final decode
            blocked = task
            break
    assert blocked is not None, "every append was taken while a final was pending"
    assert [k for k, *_ in dec.calls] == ["final"] and dec.in_flight == 1
    dec.gate.set()
    await asyncio.wait_for(blocked, 5)
    outbox = [session.outbox.get_nowait() for _ in range(session.outbox.qsize())]
    assert outbox[-1] is not None and outbox[-1]["type"].endswith(".completed")


def test_pcm16_event_from_the_sdk_helper_shape() -> None:
    """What the SDK's ``input_audio_buffer.append(audio=...)`` sends is what appends() sends."""
    raw = json.loads(appends(speech(0.1))[0])
    assert set(raw) == {"type", "audio"} and base64.b64decode(raw["audio"])


async def test_each_interim_tells_the_agreement_how_much_audio_it_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An interim read of the turn so far, then the early final started at the pause, which
    speech resumed after: each reaches the agreement with the seconds it read (the early one:
    from the turn's start to the pause), so two reads of nearly the same audio do not confirm
    each other (app/live/agreement.py)."""
    from app.live.agreement import Agreement

    heard: list[float | None] = []
    interim = Agreement.interim

    def recording(self: Agreement, hypothesis: str, heard_s: float | None = None) -> str:
        heard.append(heard_s)
        return interim(self, hypothesis, heard_s)

    monkeypatch.setattr(Agreement, "interim", recording)
    audio = np.concatenate([silence(0.5), speech(0.9), silence(0.35), speech(1.5, seed=1),
                            silence(1.0)])
    dec = ScriptedDecoder()
    events, _, _ = await run_script(appends(audio), decoder=dec)
    reads = [s for kind, s, _ in dec.calls if kind == "interim"]
    assert reads and heard[0] == pytest.approx(reads[0])  # the first interim's read
    early = next(s for kind, s, _ in dec.calls if kind == "final")
    assert len(heard) >= 2 and heard[0] is not None
    assert heard[1] == pytest.approx(early) and early > heard[0]
    done = [e for e in events if e["type"].endswith(".completed")]
    assert done[0]["transcript"] == joined(events, done[0]["item_id"])


async def test_semantic_vad_holds_a_turn_over_a_pause_unless_it_sounds_finished() -> None:
    """semantic_vad (eagerness auto: 500 ms if finished, else 4 s): a 1 s pause after words
    the read leaves open does not end the turn, so both phrases are one turn read whole; the
    same pause after a read that ends a sentence ends it after 500 ms, as server_vad would."""
    semantic = event("session.update", session={"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad"}}}})
    audio = np.concatenate([silence(0.5), speech(1.5), silence(1.0), speech(1.5, seed=1),
                            silence(5.0)])
    for ending, turns in (("", 1), (".", 2)):
        dec = ScriptedDecoder()
        dec.ending = ending
        events, _, _ = await run_script([semantic, *appends(audio)], decoder=dec)
        updated = next(e for e in events if e["type"] == "session.updated")
        assert updated["session"]["audio"]["input"]["turn_detection"] == {
            "type": "semantic_vad", "eagerness": "auto"}
        stops = [e["audio_end_ms"] for e in events if e["type"].endswith("speech_stopped")]
        done = [e["transcript"] for e in events if e["type"].endswith(".completed")]
        assert len(stops) == len(done) == turns, (ending, stops, done)
        if turns == 1:
            assert done == ["w0 w1 w2 w3 w4 w5"]
            assert 8500 <= stops[0] <= 8600  # 4 s after the speech: eagerness auto's timeout
        else:
            assert done == ["w0 w1 w2.", "w0 w1 w2."]  # each phrase read alone (1 s apart)
            assert 2500 <= stops[0] <= 2700 and 5000 <= stops[1] <= 5200  # 500 ms each
