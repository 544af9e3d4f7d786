"""Speaker clustering of CAM++ crop embeddings: 3D-Speaker's diarization recipe, with bounds.

3D-Speaker's ``CommonClustering`` as configured in its diarization recipe (``conf/diar.yaml`` and
``speakerlab/bin/infer_diarization.py``), which is how these CAM++ weights are meant to be
clustered; the constants below are that recipe's, not tuned here:

- fewer than 40 embeddings (about 30 s of speech): agglomerative clustering, average linkage
  on cosine similarity, cut at 0.4;
- otherwise spectral clustering: cosine affinity, each row keeping only its most similar
  ``max(6, n - int(0.988 n))`` entries (p-pruning, pval 0.012), symmetrised, unnormalised
  Laplacian, the speaker count from the largest eigengap among the smallest eigenvalues,
  k-means on the eigenvectors;
- then clusters of <= 4 embeddings are folded into the nearest larger one, and clusters whose
  centroids have cosine >= 0.8 are merged;
- (ours, app/speakers/evidence.py) then clusters that the segmentation model heard as one
  voice, and never as two, are merged when their centroids are at least 0.5 similar.

Our changes, measured (``loadtest/diarization.py --excerpts``: 10-30 s excerpts of the shared
recordings and synthetic conversations of corpus speakers): 3D-Speaker's fixed minimum of 5
crops (3.75 s of speech) is made for meetings of an hour. In a 15-30 s excerpt a speaker often
has fewer crops than that, so every cluster was "minor" but the largest, and folding merged
them all into one: 3+ speaker excerpts came back as ONE speaker (6 of 33 excerpts, 2 of 12
synthetic conversations). So:

- a cluster is minor when it is smaller than ``min(5, round(0.1 n))`` crops (pyannote's rule
  for short audio: ``min_cluster_size = min(12, max(1, round(0.1 * n)))``), i.e. unchanged
  from ~34 s of speech on;
- minor clusters are folded one at a time, smallest first, and folding stops at the lowest
  allowed count, instead of all at once or not at all (with ``min_speakers=2`` the old rule
  skipped folding whenever fewer than two clusters were large, and gave five speakers);
- in short audio (the agglomerative branch), the count never goes below the number of voices
  the segmentation model hears at once (``heard``: see ``app.speakers.turns.voices_heard``),
  unless the caller's ``max_speakers`` says otherwise.

Callers' bounds hold (3D-Speaker's short-audio branch ignores an oracle count): ``num_speakers``
fixes the count (cut the dendrogram, or k for k-means) and skips the folding and merging;
otherwise the count found (dendrogram cut, eigengap) is brought into ``[min_speakers,
max_speakers]``, and folding/merging stop at the lower bound. The affinity is built sparse (top
entries per row, computed in row blocks), so an hour of speech (~4800 crops) needs megabytes,
not n^2 floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from app.speakers.evidence import merge_same_voice

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

SHORT = 40  # below this many embeddings: agglomerative (3D-Speaker's cluster_line)
AHC_COS = 0.4  # agglomerative cut: merge while average cosine similarity > 0.4
PVAL = 0.012  # spectral: fraction of each affinity row kept
MIN_PNUM = 6  # ... but at least this many entries
MAX_SPEAKERS = 15  # spectral: eigengap search range (3D-Speaker's max_num_spks)
MINOR = 4  # clusters of <= this many embeddings are folded (fewer in short audio)
MINOR_SHARE = 0.1  # ... and, in short audio, of under this share of the embeddings
MERGE_COS = 0.8  # clusters whose centroids are this similar are merged
DENSE_EIGEN = 1000  # dense eigensolver up to here; beyond, Lanczos (n=3500: 2.5 s against 18 s)


@dataclass(frozen=True)
class SpeakerBounds:
    """Caller's constraints on the number of speakers (None: estimate)."""

    num_speakers: int | None = None
    min_speakers: int | None = None
    max_speakers: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_speakers", "min_speakers", "max_speakers"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if (self.min_speakers is not None and self.max_speakers is not None
                and self.min_speakers > self.max_speakers):
            raise ValueError("min_speakers > max_speakers")

    def range(self, n: int) -> tuple[int, int]:
        """(lowest, highest) allowed count for ``n`` embeddings."""
        if self.num_speakers is not None:
            k = min(self.num_speakers, n)
            return k, k
        lo = min(self.min_speakers or 1, n)
        hi = min(self.max_speakers or n, n)
        return lo, max(lo, hi)


def cluster(x: np.ndarray, bounds: SpeakerBounds | None = None, heard: int = 1,
            voices: Sequence[dict[int, int]] | None = None) -> np.ndarray:
    """Labels 0..k-1 (numbered by first occurrence) for the rows of ``x`` (n, dim). ``heard``:
    voices the segmentation model heard at once (a floor for the estimate in short audio);
    ``voices``: per row, the segmentation model's voice for it per window
    (:func:`app.speakers.evidence.crop_voices`), for merging what it heard as one voice."""
    bounds = bounds or SpeakerBounds()
    n = len(x)
    if n == 0:
        return np.zeros(0, dtype=int)
    if n == 1:
        return np.zeros(1, dtype=int)
    x = np.asarray(x, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    lo, hi = bounds.range(n)
    if n < SHORT and bounds.num_speakers is None:
        lo = max(lo, min(heard, hi))
    labels = _agglomerative(x, lo, hi) if n < SHORT else _spectral(x, lo, hi)
    if bounds.num_speakers is None:
        labels = _fold_minor(x, labels, lo, min_size(n))
        labels = _merge_similar(x, labels, lo)
        if voices is not None:
            labels = merge_same_voice(x, labels, voices, lo)
    return _renumber(labels)


def min_size(n: int) -> int:
    """The fewest embeddings of a cluster that is not folded (pyannote's short-audio rule)."""
    return min(MINOR + 1, max(1, round(MINOR_SHARE * n)))


def _agglomerative(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    from scipy.cluster.hierarchy import fcluster, linkage

    z = linkage(x, method="average", metric="cosine")  # distance = 1 - cosine
    labels = fcluster(z, t=1.0 - AHC_COS, criterion="distance")
    k = len(np.unique(labels))
    if not lo <= k <= hi:
        labels = fcluster(z, t=min(max(k, lo), hi), criterion="maxclust")
    return np.asarray(labels) - 1


def _spectral(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    from sklearn.cluster import k_means

    n = len(x)
    # The count is estimated over 3D-Speaker's range (1-15, or up to a caller's larger bound)
    # and then brought into [lo, hi]: a search cut short at max_speakers would find no gap
    # when there are more speakers than that, and pick arbitrarily.
    top = min(n - 1, max(MAX_SPEAKERS, lo, hi if hi < n else 0))
    values, vectors = _smallest_eigen(_laplacian(x), min(n, max(top, hi if lo == hi else 0) + 1))
    found = int(np.argmax(np.diff(values[: top + 1]))) + 1  # the largest eigengap
    k = lo if lo == hi else min(max(found, lo), hi)
    # Fixed seed and 10 starts (3D-Speaker: one unseeded start): the same input, the same labels.
    _, labels, _ = k_means(vectors[:, :k], k, random_state=0, n_init=10)
    return np.asarray(labels)


def _laplacian(x: np.ndarray, block: int = 1024) -> csr_matrix:
    """3D-Speaker's unnormalised Laplacian D - A of the p-pruned cosine affinity A (each row's
    top entries, symmetrised, zero diagonal; D the row sums of |A|), built sparse."""
    from scipy.sparse import csr_matrix, diags

    n = len(x)
    keep = max(n - min(int((1 - PVAL) * n), n - MIN_PNUM), 1)
    rows, cols, vals = [], [], []
    for b in range(0, n, block):
        sim = x[b: b + block] @ x.T
        top = np.argpartition(-sim, keep - 1, axis=1)[:, :keep]
        rows.append(np.repeat(np.arange(b, b + len(sim)), keep))
        cols.append(top.ravel())
        vals.append(np.take_along_axis(sim, top, axis=1).ravel())
    a = csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(n, n))
    a = (0.5 * (a + a.T)).tolil()
    a.setdiag(0)
    a = a.tocsr()
    degree = np.asarray(abs(a).sum(axis=1)).ravel()
    out: csr_matrix = (diags(degree) - a).tocsr()
    return out


def _smallest_eigen(lap: csr_matrix, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``m`` smallest eigenpairs of a symmetric Laplacian, ascending."""
    from scipy.linalg import eigh
    from scipy.sparse import identity
    from scipy.sparse.linalg import eigsh

    n = lap.shape[0]
    if n <= DENSE_EIGEN:
        values, vectors = eigh(lap.toarray(), subset_by_index=[0, m - 1])
        return values, vectors
    # Lanczos on (c I - L): its largest eigenpairs are L's smallest (c >= L's spectral radius
    # by Gershgorin). A fixed start vector keeps the result reproducible.
    c = 2.0 * float(abs(lap).sum(axis=1).max())
    v0 = np.random.default_rng(0).standard_normal(n)
    values, vectors = eigsh(c * identity(n, format="csr") - lap, k=m, which="LA", v0=v0)
    order = np.argsort(c - values)
    return (c - values)[order], vectors[:, order]


def _centroids(x: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> np.ndarray:
    c = np.stack([x[labels == i].mean(0) for i in ids])
    out: np.ndarray = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
    return out


def _fold_minor(x: np.ndarray, labels: np.ndarray, lo: int, size: int) -> np.ndarray:
    """Clusters of fewer than ``size`` embeddings, smallest first, go embedding by embedding
    to the most similar large cluster (or, with none, the most similar other cluster), until
    ``lo`` clusters are left."""
    out = labels.copy()
    while True:
        ids, sizes = np.unique(out, return_counts=True)
        if len(ids) <= max(lo, 1) or sizes.min() >= size:
            return out
        small = ids[int(np.argmin(sizes))]  # the first of the smallest
        major = ids[sizes >= size]
        targets = major if len(major) else ids[ids != small]
        centers = _centroids(x, out, targets)
        moved = out == small
        out[moved] = targets[np.argmax(x[moved] @ centers.T, axis=1)]


def _merge_similar(x: np.ndarray, labels: np.ndarray, lo: int) -> np.ndarray:
    labels = labels.copy()
    while True:
        ids = np.unique(labels)
        if len(ids) <= max(lo, 1):
            return labels
        c = _centroids(x, labels, ids)
        sim = np.triu(c @ c.T, 1)
        i, j = np.unravel_index(np.argmax(sim), sim.shape)
        if sim[i, j] < MERGE_COS:
            return labels
        labels[labels == ids[j]] = ids[i]


def _renumber(labels: np.ndarray) -> np.ndarray:
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    out: np.ndarray = order[inverse]
    return out
