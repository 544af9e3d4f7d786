"""Voices: the normalised mean of a speaker's CAM++ embeddings, and named speakers' reference
voices (app/speakers/named.py) matched to a recording's speakers.

At the end of the job every speaker's voice is the normalised mean of its crops' embeddings,
and references are matched to speakers one to one (Hungarian assignment on cosine similarity)
when the similarity is at least ``MATCH_COS``; a matched speaker is called by its name, the
others keep their labels (``SPEAKER_00``..., or OpenAI's letters), and the result lists every
reference with its best similarity and whether it matched: how sure each name is.

``MATCH_COS`` = 0.5, measured here with these models (reference of the first 2.5/5/10 s of a
corpus speaker against the voice of 12 s from the middle of a recording; 5 speakers of
../shared/corpus, different sources): the same speaker scored 0.52-0.98 with references of
5-10 s (0.37-0.94 at 2.5 s), different speakers -0.1-0.47 (median 0.06). In the same meeting
(AMI, one channel for all) different speakers come closer, so short references (2-3 s) of
similar voices may miss the threshold: the similarity is in the result to act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from app.speakers.report import NameMatch

MATCH_COS = 0.5


def unit_mean(x: np.ndarray) -> np.ndarray:
    """The normalised mean of the rows, each normalised first (a voice from its crops)."""
    x = np.asarray(x, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    m = x.mean(0)
    out: np.ndarray = m / max(float(np.linalg.norm(m)), 1e-12)
    return out


def match(voices: dict[int, np.ndarray], known: Sequence[dict[str, Any]]
          ) -> tuple[dict[int, str], list[NameMatch]]:
    """Speakers (cluster index -> voice) named after the references they match, one to one,
    at cosine >= MATCH_COS; and every reference's outcome. ``NameMatch.speaker`` is filled in
    with the name itself when matched (the turns carry names, not labels)."""
    from scipy.optimize import linear_sum_assignment

    if not known:
        return {}, []
    ids = sorted(voices)
    refs = np.array([k["voice"] for k in known], dtype=np.float64)
    refs /= np.maximum(np.linalg.norm(refs, axis=1, keepdims=True), 1e-12)
    sim = refs @ np.stack([voices[i] for i in ids]).T if ids else np.zeros((len(known), 0))
    names: dict[int, str] = {}
    if ids:
        for r, c in zip(*linear_sum_assignment(-sim), strict=True):
            if sim[r, c] >= MATCH_COS:
                names[ids[c]] = str(known[r]["name"])
    matched = set(names.values())
    report = [NameMatch(str(k["name"]), str(k["name"]) if k["name"] in matched else None,
                        float(sim[r].max()) if ids else -1.0, MATCH_COS)
              for r, k in enumerate(known)]
    return names, report
