"""Which speakers are reported (issue 49, speaker counts that hold): a speaker left with a
sliver of speech by the reconstruction is no speaker, unless the caller's count needs it, and
its frames stay speech. Without weights (app/speakers/turns.py, step 5)."""

from __future__ import annotations

import numpy as np

from app.speakers.models import FrameGrid
from app.speakers.turns import compress, reconstruct

GRID = FrameGrid(duration=0.1, step=0.1, per_window=40)
Spans = list[tuple[float, float, int]]


def two_speakers_and_a_sliver() -> tuple[np.ndarray, np.ndarray, Spans]:
    """One 4 s window: local speaker 0 speaks 0-2 s, local speaker 1 2-4 s, and the model
    also hears a third voice for 0.2 s at the change; the crops were clustered into three
    speakers, the third a sliver at 1.9-2.1 s (its local speaker is matched to it)."""
    seg = np.zeros((40, 3), np.uint8)
    seg[:20, 0] = 1
    seg[20:, 1] = 1
    seg[19:21, 2] = 1
    count = np.minimum(seg.sum(1), 2).astype(np.uint8)
    return seg, count, compress([(0.0, 1.9), (1.9, 2.1), (2.1, 4.0)], [0, 2, 1])


def test_a_speaker_with_a_sliver_of_speech_is_not_reported() -> None:
    seg, count, spans = two_speakers_and_a_sliver()
    kept = reconstruct([seg], [0], count, spans, 3, GRID)
    assert kept[:, 2].sum() == 2  # 0.2 s: a speaker of its own without the rule
    dropped = reconstruct([seg], [0], count, spans, 3, GRID, min_frames=3)
    assert dropped[:, 2].sum() == 0
    assert dropped[:20, 0].all() and dropped[20:, 1].all()  # its frames stay speech
    assert (dropped.sum(1) >= 1).all()


def test_the_sliver_stays_when_the_caller_asked_for_that_many() -> None:
    seg, count, spans = two_speakers_and_a_sliver()
    kept = reconstruct([seg], [0], count, spans, 3, GRID, at_least=3, min_frames=3)
    assert kept[:, 2].sum() > 0 and (kept.sum(0) > 0).all()
    alone = seg[:, :1].copy()
    one = reconstruct([alone], [0], alone.sum(1).astype(np.uint8), compress([(0.0, 2.0)], [0]),
                      1, GRID, min_frames=100)
    assert one[:20, 0].all()  # the last speaker is never dropped, however little it says
