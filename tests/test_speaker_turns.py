"""Speakers as users see them, without weights (issue 36, item 1): short recordings keep their
speakers, the caller's count holds, segment times come from the turns, the result reports the
turns (JSON, RTTM) and whether the count asked for was met."""

from __future__ import annotations

from typing import Any

import numpy as np

from app.results.formats import to_rttm
from app.speakers import SpeakerBounds, Turn, assign_speakers
from app.speakers.cluster import cluster, min_size
from app.speakers.fit import fit_segments, wordless_segments
from app.speakers.models import FrameGrid
from app.speakers.report import SpeakerTurns, count_report
from app.speakers.turns import compress, reconstruct, voices_heard
from tests.test_speakers_parts import blobs, same_partition


def test_a_short_recordings_speakers_are_not_folded_into_one() -> None:
    """15 crops (~12 s of speech), three speakers of 6, 5 and 4 crops: 3D-Speaker's fixed
    minimum of 5 crops folded the 4 and then everything below 5 into the largest."""
    x, truth = blobs([6, 5, 4], seed=3)
    assert min_size(len(x)) == 2  # pyannote's 10 % rule: only singletons are minor here
    assert same_partition(cluster(x), truth)
    y, truth2 = blobs([8, 6, 5, 1], seed=4)  # a singleton of 20 is still folded
    labels = cluster(y)
    assert labels.max() + 1 == 3 and same_partition(labels[:19], truth2[:19])


def test_folding_stops_at_min_speakers() -> None:
    """One large cluster and small ones: min_speakers=2 folds down to 2 (it used to skip the
    folding altogether and give every small cluster as a speaker)."""
    x, _ = blobs([40, 2, 2, 2, 1], seed=5)
    assert cluster(x).max() + 1 == 1
    assert cluster(x, SpeakerBounds(min_speakers=2)).max() + 1 == 2
    assert cluster(x, SpeakerBounds(min_speakers=3)).max() + 1 == 3


def test_voices_heard_at_once_are_a_floor_for_short_recordings() -> None:
    """Two voices whose crops look alike (cosine ~0.9) merge into one cluster, unless the
    segmentation model heard two voices at once in several windows."""
    rng = np.random.default_rng(0)
    centre = rng.standard_normal(192)
    other = centre + 0.45 * rng.standard_normal(192)
    x = np.concatenate([c + 0.3 * rng.standard_normal((8, 192)) for c in (centre, other)])
    assert cluster(x).max() + 1 == 1
    assert cluster(x, heard=2).max() + 1 == 2
    assert cluster(x, SpeakerBounds(max_speakers=1), heard=2).max() + 1 == 1  # the caller wins
    grid = FrameGrid(duration=0.1, step=0.1, per_window=100)
    two = np.zeros((100, 3), np.uint8)
    two[:40, 0] = 1
    two[50:65, 1] = 1  # 1.5 s of a second voice
    one = two.copy()
    one[:, 1] = 0
    assert voices_heard([one, two, one], grid) == 1  # one window only: not a voice
    assert voices_heard([one, two, two], grid) == 2
    short = two.copy()
    short[58:, 1] = 0  # 0.8 s: too short to count
    assert voices_heard([short, short], grid) == 1


def test_a_cluster_no_local_speaker_matches_is_kept_when_the_count_needs_it() -> None:
    """Crops of speaker 1 inside speaker 0's speech: the window's one local speaker goes to
    speaker 0, and speaker 1 had no turn at all. With num_speakers=2 it keeps its crops' time."""
    grid = FrameGrid(duration=0.1, step=0.1, per_window=20)
    seg = np.zeros((20, 3), np.uint8)
    seg[:, 0] = 1
    count = seg.sum(1).astype(np.uint8)
    spans = compress([(0.0, 1.5), (1.5, 2.0)], [0, 1])
    assert reconstruct([seg], [0], count, spans, 2, grid)[:, 1].sum() == 0
    kept = reconstruct([seg], [0], count, spans, 2, grid, at_least=2)
    assert kept[15:, 1].all() and not kept[15:, 0].any() and kept[:15, 0].all()


def seg(start: float, end: float, speaker: str, text: str = "x") -> dict[str, Any]:
    return {"start": start, "end": end, "speaker": speaker, "text": text}


def test_segment_spans_follow_their_speakers_turns() -> None:
    turns = [Turn(0.0, 6.0, "A"), Turn(5.5, 7.0, "B"), Turn(8.0, 9.0, "A"), Turn(12.0, 13.0, "B")]
    segs = [seg(0.4, 2.0, "A"), seg(3.0, 4.6, "A"),  # one turn, two segments: split between
            seg(5.8, 6.5, "B"),  # overlap: B's segment spans B's turn, over A's
            seg(7.5, 8.5, "A"),  # words start in a pause the models heard as silence: trimmed
            seg(10.0, 11.0, "B")]  # no turn of B under its words: word times kept
    fit_segments(segs, turns)
    assert [(s["start"], s["end"]) for s in segs] == [(0.0, 2.5), (2.5, 6.0), (5.5, 7.0),
                                                      (8.0, 9.0), (10.0, 11.0)]
    wordless_segments(segs, turns)  # B's 12-13 s has no words: a segment of its own
    assert [(s["start"], s["end"], s["speaker"], s["text"]) for s in segs][-2:] == [
        (10.0, 11.0, "B", "x"), (12.0, 13.0, "B", "")]
    assert len(segs) == 6
    crumbs = [seg(0.0, 5.7, "A")]  # 0.3 s of A's turn left: too short for a segment
    wordless_segments(crumbs, [Turn(0.0, 6.0, "A")])
    assert len(crumbs) == 1


def test_result_has_turns_renamed_like_segments_and_the_count_report() -> None:
    tr = {"text": "Hi. Yes.", "duration": 4.0, "segments": [
        {"id": 0, "start": 0.2, "end": 0.9, "text": "Hi.", "tokens": []},
        {"id": 1, "start": 1.6, "end": 2.0, "text": "Yes.", "tokens": []}]}
    turns = SpeakerTurns([Turn(0.0, 1.0, "SPEAKER_01"), Turn(1.5, 2.5, "SPEAKER_00"),
                          Turn(3.0, 3.5, "SPEAKER_02")], SpeakerBounds(num_speakers=3), 4, 3.0)
    out = assign_speakers(tr, turns)
    assert [(s["speaker"], s["start"], s["end"], s["text"]) for s in out["segments"]] == [
        ("SPEAKER_00", 0.0, 1.0, "Hi."), ("SPEAKER_01", 1.5, 2.5, "Yes."),
        ("SPEAKER_02", 3.0, 3.5, "")]  # speech without words: a segment without text
    # The speaker with turns but no words comes last.
    assert out["speakers"] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_02"]
    assert out["turns"] == [{"start": 0.0, "end": 1.0, "speaker": "SPEAKER_00"},
                            {"start": 1.5, "end": 2.5, "speaker": "SPEAKER_01"},
                            {"start": 3.0, "end": 3.5, "speaker": "SPEAKER_02"}]
    assert out["diarization"] == {"speakers": 3, "asked": {"num_speakers": 3}, "met": True}
    assert to_rttm(out, "my call") == (
        "SPEAKER my_call 1 0.000 1.000 <NA> <NA> SPEAKER_00 <NA> <NA>\n"
        "SPEAKER my_call 1 1.500 1.000 <NA> <NA> SPEAKER_01 <NA> <NA>\n"
        "SPEAKER my_call 1 3.000 0.500 <NA> <NA> SPEAKER_02 <NA> <NA>\n")


def test_a_count_the_audio_cannot_support_is_reported() -> None:
    short = SpeakerTurns([Turn(0.0, 2.0, "SPEAKER_00"), Turn(2.0, 2.6, "SPEAKER_01")],
                         SpeakerBounds(num_speakers=4), crops=2, speech_s=2.6)
    report = count_report(short)
    assert report["speakers"] == 2 and report["met"] is False
    assert "num_speakers=4" in report["note"] and "2 crop(s)" in report["note"]
    within = SpeakerTurns([Turn(0.0, 2.0, "SPEAKER_00")], SpeakerBounds(max_speakers=2), 3, 2.0)
    assert count_report(within) == {"speakers": 1, "asked": {"max_speakers": 2}, "met": True}
    assert count_report([Turn(0.0, 1.0, "SPEAKER_00")]) == {"speakers": 1}
