"""Server VAD turn detection (app/live/turns.py): OpenAI's threshold, prefix padding and silence
duration on Silero's probabilities; turns cut before Whisper's 30 s."""

from __future__ import annotations

import itertools

import numpy as np

from app.audio.spans import CHUNK
from app.live.turns import Edge, SileroTurns, TurnDetector, VadRules
from tests.conftest import corpus_clips


def probs(*runs: tuple[float, int]) -> np.ndarray:
    return np.concatenate([np.full(n, p, dtype=np.float32) for p, n in runs])


def test_start_includes_prefix_padding_and_stop_waits_for_the_silence() -> None:
    d = TurnDetector(VadRules(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500))
    edges = d.feed(probs((0.0, 10), (0.9, 20), (0.0, 30)))
    speech_start, speech_end = 10 * CHUNK, 30 * CHUNK
    stop_at = speech_end + 16 * CHUNK  # the first chunk end >= 500 ms after the speech ended
    assert edges == [Edge("start", speech_start - 4800),
                     Edge("stop", stop_at, speech_end=speech_end)]


def test_hysteresis_between_threshold_and_threshold_minus_015() -> None:
    d = TurnDetector(VadRules(threshold=0.5, silence_duration_ms=500))
    # 0.4 neither starts a silence (>= 0.35) nor ends one; 0.3 starts it; 0.9 ends it
    edges = d.feed(probs((0.9, 5), (0.4, 20), (0.3, 3), (0.4, 4), (0.9, 1), (0.0, 20)))
    stops = [e for e in edges if e.kind == "stop"]
    assert len(stops) == 1 and stops[0].speech_end == 33 * CHUNK  # after the last 0.9
    assert stops[0].at == 49 * CHUNK
    d = TurnDetector(VadRules(threshold=0.5, silence_duration_ms=200))
    short = d.feed(probs((0.9, 5), (0.3, 3), (0.4, 10)))  # a silence that 0.4 does not end
    assert short[-1] == Edge("stop", 12 * CHUNK, speech_end=5 * CHUNK)


def test_a_turn_never_starts_before_the_previous_one_ended() -> None:
    d = TurnDetector(VadRules(prefix_padding_ms=1000, silence_duration_ms=100))
    edges = d.feed(probs((0.9, 10), (0.0, 4), (0.9, 5), (0.0, 10)))
    first_stop = edges[1]
    assert edges[2].kind == "start" and edges[2].at == first_stop.at


def test_a_long_turn_is_cut_at_its_last_pause_before_30_s() -> None:
    d = TurnDetector(VadRules(silence_duration_ms=500, max_turn_s=2.0))
    # 1.28 s of speech, a 224 ms dip (too short to end the turn), then speech on and on
    edges = d.feed(probs((0.9, 40), (0.0, 7), (0.9, 60)))
    assert edges[0] == Edge("start", 0)
    stop, restart = edges[1], edges[2]
    assert stop.forced and stop.at == 40 * CHUNK and restart == Edge("start", 40 * CHUNK)
    # no pause at all: a hard cut at the limit
    d = TurnDetector(VadRules(max_turn_s=1.0))
    hard = d.feed(probs((0.9, 80)))
    assert [e.kind for e in hard][:3] == ["start", "stop", "start"]
    assert hard[1].forced and 16_000 <= hard[1].at - hard[0].at < 16_000 + CHUNK


def test_end_turn_resets_the_detector() -> None:
    d = TurnDetector(VadRules(prefix_padding_ms=300))
    assert d.feed(probs((0.9, 5)))[0].kind == "start"
    d.end_turn(5 * CHUNK)
    assert d.turn_start is None
    again = d.feed(probs((0.9, 1)))
    assert again == [Edge("start", 5 * CHUNK)]  # padding clipped at the committed end


def test_silero_finds_the_speech_of_a_corpus_clip() -> None:
    """A read-speech clip with a second of silence each side, in 100 ms appends, through the
    service's own Silero model: every turn lies where the speech is, and the last one stops
    within a second after it."""
    from app.audio import decode
    from app.audio.vad import SileroVad

    clip = next(c for c in corpus_clips() if c.id.startswith("ljspeech-LJ001-0001"))
    speech = decode(clip.path, 60.0)
    audio = np.concatenate([np.zeros(16_000, np.float32), speech, np.zeros(16_000, np.float32)])
    turns = SileroTurns(SileroVad().probability_stream(), VadRules())
    edges = [e for i in range(0, audio.size, 1600) for e in turns.feed(audio[i:i + 1600])]
    kinds = [e.kind for e in edges]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    assert all(a != b for a, b in itertools.pairwise(kinds))  # alternate
    assert 0.6 * 16_000 <= edges[0].at <= 1.3 * 16_000
    end = 16_000 + speech.size
    assert end + 0.3 * 16_000 <= edges[-1].at <= end + 1.0 * 16_000


def test_pause_and_resume_edges_for_an_early_final() -> None:
    """With ``early_final_ms`` a silence that long inside a turn gives one ``pause`` edge;
    speech coming back gives ``resume``; the stop follows its own pause. Off by default."""
    d = TurnDetector(VadRules(silence_duration_ms=500, early_final_ms=200))
    edges = d.feed(probs((0.9, 10), (0.0, 8), (0.9, 5), (0.0, 20)))
    assert [e.kind for e in edges] == ["start", "pause", "resume", "pause", "stop"]
    first, resume, second, stop = edges[1:]
    assert first.speech_end == 10 * CHUNK and 3200 <= first.at - first.speech_end < 3200 + CHUNK
    assert resume.at == 18 * CHUNK
    assert second.speech_end == stop.speech_end == 23 * CHUNK and second.at < stop.at
    plain = TurnDetector(VadRules(silence_duration_ms=500))
    assert [e.kind for e in plain.feed(probs((0.9, 10), (0.0, 8), (0.9, 5), (0.0, 20)))] \
        == ["start", "stop"]


def test_a_restart_reads_the_last_chunks_again_from_a_fresh_state() -> None:
    """``restart(k)`` after a feed gives what a stream fed up to those k chunks, reset, then fed
    the rest, gives: the reset lands on the chunk where a turn stopped, whatever the appends."""
    from app.audio.vad import SileroVad

    vad = SileroVad()
    audio = np.random.default_rng(1).standard_normal(CHUNK * 12).astype(np.float32) * 0.1
    whole = vad.probability_stream()
    first = whole.feed(audio)
    again = whole.restart(5)
    split = vad.probability_stream()
    head = split.feed(audio[:7 * CHUNK])
    split.restart()
    tail = split.feed(audio[7 * CHUNK:])
    np.testing.assert_allclose(first[:7], head, atol=1e-6)
    np.testing.assert_allclose(again, tail, atol=1e-6)
    assert not np.allclose(first[7:], tail, atol=1e-3)  # the state did matter


def test_a_whisper_after_a_loud_turn_opens_a_turn() -> None:
    """A loud read clip, 1.5 s of silence, then the corpus's whispered clip, in 100 ms appends:
    with Silero's state reset where the loud turn stopped, the whisper opens a turn of its own.
    Carried on, the state kept every probability of the whisper under 0.5 (at most 0.21 in
    the live bench's stream), and no turn heard it."""
    from app.audio import decode
    from app.audio.vad import SileroVad

    clips = {c.id: c for c in corpus_clips()}
    loud = decode(clips["ljspeech-LJ001-0001"].path, 60.0)
    quiet = decode(clips["mfa-whisper"].path, 60.0)
    gap = np.zeros(24_000, np.float32)
    audio = np.concatenate([gap, loud, gap, quiet, gap])
    turns = SileroTurns(SileroVad().probability_stream(), VadRules())
    edges = [e for i in range(0, audio.size, 1600) for e in turns.feed(audio[i:i + 1600])]
    starts = [e.at for e in edges if e.kind == "start"]
    whisper_from = gap.size * 2 + loud.size
    assert any(whisper_from - 4800 <= at < whisper_from + quiet.size for at in starts), edges


def test_semantic_vad_ends_a_finished_turn_early_and_waits_out_an_open_one() -> None:
    """``done_silence_ms``: a pause whose read sounded finished (``mark_done``) ends the turn
    after the short silence; an unmarked one only after ``silence_duration_ms`` (eagerness's
    timeout); a mark outlives neither the silence it was for nor the turn."""
    rules = VadRules(silence_duration_ms=4000, early_final_ms=200, done_silence_ms=500)
    d = TurnDetector(rules)
    edges = d.feed(probs((0.9, 10), (0.0, 10)))  # 320 ms quiet: past the 200 ms pause edge
    pause = edges[-1]
    assert [e.kind for e in edges] == ["start", "pause"] and pause.at == 17 * CHUNK
    d.mark_done(pause.at)
    stop = d.feed(probs((0.0, 6)))[-1]  # ends at the first chunk 500 ms into the quiet
    assert stop == Edge("stop", 26 * CHUNK, speech_end=10 * CHUNK)

    d = TurnDetector(rules)
    first = d.feed(probs((0.9, 10), (0.0, 10)))[-1]
    d.mark_done(first.at)
    assert [e.kind for e in d.feed(probs((0.9, 5)))] == ["resume"]  # the mark is stale now
    quiet = d.feed(probs((0.0, 30)))  # 960 ms: a new pause, unmarked, and no stop
    assert [e.kind for e in quiet] == ["pause"]
    stops = [e for e in d.feed(probs((0.0, 100))) if e.kind == "stop"]
    assert stops == [Edge("stop", (25 + 125) * CHUNK, speech_end=25 * CHUNK)]  # after 4 s

    d = TurnDetector(VadRules(silence_duration_ms=1000, early_final_ms=200))
    plain = d.feed(probs((0.9, 10), (0.0, 10)))[-1]
    d.mark_done(plain.at)  # without done_silence_ms (server_vad) the mark changes nothing
    assert [e.at for e in d.feed(probs((0.0, 6))) if e.kind == "stop"] == []


def test_sounds_finished_reads_whispers_punctuation() -> None:
    from app.live.turns import sounds_finished

    for text in (" Ask not what your country can do for you.", "Really?", "Stop! ", "好的。"):
        assert sounds_finished(text), text
    for text in (" And so my fellow Americans", " MFA is like,", " Montreal or...", "well…", ""):
        assert not sounds_finished(text), text
