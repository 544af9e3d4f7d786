"""The segmentation-evidence merge (app/speakers/evidence.py) on hand-made windows and
embeddings: crops heard as one voice, and never as two, are merged when their groups'
voices are alike; two voices the model told apart, or unlike voices, stay apart; the caller's
lower bound holds. No model needed."""

from __future__ import annotations

import numpy as np

from app.speakers.cluster import SpeakerBounds, cluster
from app.speakers.evidence import crop_voices, merge_same_voice
from app.speakers.models import FrameGrid

GRID = FrameGrid(duration=0.0619375, step=0.016875, per_window=589)


def window(first_frame: int, spans: list[tuple[float, float, int]]) -> tuple[np.ndarray, int]:
    """A (589, 3) local-speaker activity starting at ``first_frame``; spans in seconds."""
    w = np.zeros((GRID.per_window, 3), dtype=np.uint8)
    for s, e, k in spans:
        a = int(np.rint(s / GRID.step)) - first_frame
        b = int(np.rint(e / GRID.step)) - first_frame
        w[max(a, 0): max(min(b, len(w)), 0), k] = 1
    return w, first_frame


def noise(rng: np.random.Generator, scale: float) -> np.ndarray:
    """A random vector of norm ~``scale``."""
    out: np.ndarray = rng.standard_normal(192) * scale / np.sqrt(192)
    return out


def unit(v: np.ndarray) -> np.ndarray:
    out: np.ndarray = v / np.linalg.norm(v, axis=-1, keepdims=True)
    return out


def test_crop_voices_reads_the_local_speaker_of_each_covering_window() -> None:
    w0, f0 = window(0, [(0.0, 3.0, 0), (3.0, 6.0, 1)])
    w1, f1 = window(59, [(1.0, 3.0, 2), (3.0, 6.0, 0)])  # starts at ~1 s, its own numbering
    crops = [(1.2, 2.7), (4.0, 5.5), (2.5, 4.0), (0.2, 1.7)]  # A, B, across the change, A early
    voices = crop_voices([w0, w1], [f0, f1], crops, GRID)
    assert voices[0] == {0: 0, 1: 2}
    assert voices[1] == {0: 1, 1: 0}
    assert voices[2] == {}  # a crop across a speaker change is evidence of nothing
    assert voices[3] == {0: 0}  # the second window starts after this crop: it says nothing


def test_one_voice_split_in_two_groups_is_merged() -> None:
    rng = np.random.default_rng(0)
    a, b = unit(rng.standard_normal(192)), unit(rng.standard_normal(192))
    x = unit(np.stack([a + 0.6 * b + noise(rng, 0.3) for _ in range(4)]
                      + [a + noise(rng, 0.3) for _ in range(4)]))
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    same = [{3: 0}] * 4 + [{3: 0}] * 4  # one window heard all eight as its local speaker 0
    assert np.unique(merge_same_voice(x, labels, same, 1)).size == 1
    told_apart = [{3: 0}] * 4 + [{3: 1}] * 4  # ... heard as two voices: kept apart
    assert np.unique(merge_same_voice(x, labels, told_apart, 1)).size == 2
    assert np.unique(merge_same_voice(x, labels, same, 2)).size == 2  # the lower bound holds
    assert np.unique(merge_same_voice(x, labels, [{}] * 8, 1)).size == 2  # no evidence


def test_unlike_voices_are_not_merged_on_the_models_word_alone() -> None:
    rng = np.random.default_rng(1)
    a, b = unit(rng.standard_normal(192)), unit(rng.standard_normal(192))
    x = unit(np.stack([a + noise(rng, 0.2) for _ in range(5)]
                      + [b + noise(rng, 0.2) for _ in range(5)]))
    labels = np.array([0] * 5 + [1] * 5)
    assert np.unique(merge_same_voice(x, labels, [{0: 0}] * 10, 1)).size == 2


def test_cluster_takes_the_evidence_but_a_fixed_count_wins() -> None:
    rng = np.random.default_rng(2)
    a = unit(rng.standard_normal(192))
    x = unit(np.stack([a + noise(rng, 1.2) for _ in range(12)]))  # one noisy voice
    voices = [{0: 0}] * 12
    assert cluster(x).max() + 1 > 1  # the embeddings alone split it ...
    assert cluster(x, voices=voices).max() + 1 == 1  # ... the model heard one voice
    assert cluster(x, SpeakerBounds(num_speakers=3), voices=voices).max() + 1 == 3
    assert cluster(x, SpeakerBounds(min_speakers=2), voices=voices).max() + 1 >= 2
