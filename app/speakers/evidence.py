"""What the segmentation model says about the clusters: which crops it heard as one voice.

Inside one 10 s window, pyannote's segmentation model keeps each voice on one of its (up to
three) local speakers: a local speaker is one voice for the whole window. So when a crop of
cluster A and a crop of cluster B are each heard as the *same* local speaker of one window,
the model says A and B are one voice there; when as *different* local speakers, two voices.
The crop embeddings (CAM++ on 1.5 s) are far noisier than that: in short recordings the
agglomerative clustering splits one speaker into two groups (measured on the tuning split of
``tests/data/diarization``: ES2003a, 2 speakers, came back as 3 groups of 19/4/11 crops whose
crops shared a local speaker in 15 windows and never differed; DER 18.2 %).

:func:`merge_same_voice` therefore merges two clusters when the model heard them as one voice
in at least one window and as different voices in none, and their centroids are at least
``SAME_VOICE_COS`` similar (the clusters are one speaker by both the model's and the
embeddings' account), most similar pair first, never below the caller's lower bound.
Measured on the tuning split (0.25 s collar, overlap scored): ES2003a 18.2 -> 12.1 %, the
other seven recordings unchanged; total 11.88 -> 11.20 %. With the centroid condition at
0.3 or 0.4 instead of 0.5, ES2003b (whose two speakers the model never told apart) was
merged into one or mismatched (40.1 / 51.1 % against 45.6 %): 0.5 is the value that leaves
a pair the model cannot separate to the embeddings.

A crop's voice in a window is the local speaker active over >= ``PURE`` of its frames while
no other local speaker is active over more than 1 - ``PURE`` of them; crops across a speaker
change or in overlap give no evidence in that window.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from app.speakers.models import FrameGrid

PURE = 0.9
SAME_VOICE_COS = 0.5


def crop_voices(windows: Sequence[np.ndarray], window_frames: Sequence[int],
                crops: Sequence[tuple[float, float]], grid: FrameGrid) -> list[dict[int, int]]:
    """Per crop: {window index: local speaker} for every window that covers the crop and in
    which one local speaker is the crop's only voice (see the module docstring)."""
    starts = list(window_frames)
    out: list[dict[int, int]] = []
    for s, e in crops:
        a = int(np.rint(s / grid.step))
        b = max(int(np.rint(e / grid.step)), a + 1)
        voices: dict[int, int] = {}
        for i in range(bisect_right(starts, a) - 1, -1, -1):
            w, f0 = windows[i], starts[i]
            if f0 + len(w) < a:
                break  # earlier windows end before the crop (windows are in start order)
            if f0 + len(w) < b:
                continue
            act = np.asarray(w[a - f0: b - f0], dtype=np.float32).mean(0)
            k = int(np.argmax(act))
            others = np.delete(act, k)
            if act[k] >= PURE and (others.size == 0 or float(others.max()) <= 1 - PURE):
                voices[i] = k
        out.append(voices)
    return out


def _votes(labels: np.ndarray, voices: Sequence[dict[int, int]]
           ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """Cluster pairs (a < b) heard as one voice in some window, and as two in some window."""
    per_window: dict[int, dict[int, set[int]]] = {}
    for label, heard in zip(labels.tolist(), voices, strict=True):
        for w, k in heard.items():
            per_window.setdefault(w, {}).setdefault(k, set()).add(label)
    same: set[tuple[int, int]] = set()
    diff: set[tuple[int, int]] = set()
    for by_voice in per_window.values():
        groups = list(by_voice.values())
        for g in groups:
            same.update((a, b) for a in g for b in g if a < b)
        for i, g in enumerate(groups):
            for h in groups[i + 1:]:
                diff.update((min(a, b), max(a, b)) for a in g for b in h if a != b)
    return same, diff


def merge_same_voice(x: np.ndarray, labels: np.ndarray, voices: Sequence[dict[int, int]],
                     lo: int) -> np.ndarray:
    """Labels with the clusters the segmentation model heard as one voice merged (``x``:
    unit-norm embeddings; ``lo``: the fewest clusters to keep)."""
    out = labels.copy()
    while len(ids := np.unique(out)) > max(lo, 1):
        same, diff = _votes(out, voices)
        c = np.stack([x[out == i].mean(0) for i in ids])
        c /= np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
        pos = {int(k): j for j, k in enumerate(ids)}
        pairs = [(float(c[pos[a]] @ c[pos[b]]), a, b) for a, b in same - diff]
        pairs = [p for p in pairs if p[0] >= SAME_VOICE_COS]
        if not pairs:
            return out
        _, a, b = max(pairs)
        out[out == b] = a
    return out
