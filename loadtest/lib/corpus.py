"""The shared corpora (``../shared/corpus``, ``../shared/corpus-multilingual``): one clip type
and one manifest reader, for the benchmarks and the tests (tests/conftest.py ``corpus_clips``).

Light, like the rest of loadtest.lib: the standard library only.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def shared(name: str) -> Path:
    """``../shared/<name>`` from the repository, or from a worktree a level or two deeper."""
    return next((p / "shared" / name for p in ROOT.parents if (p / "shared" / name).is_dir()),
                ROOT.parent / "shared" / name)


DEFAULT_CORPUS = Path(os.environ.get("BATCHSCRIBE_CORPUS") or shared("corpus"))
ML_CORPUS = Path(os.environ.get("BATCHSCRIBE_MULTILINGUAL_CORPUS")
                 or os.environ.get("BATCHSCRIBE_ML_CORPUS") or shared("corpus-multilingual"))
READ_SPEECH = ("librispeech", "ljspeech", "librivox")  # the sets a published WER compares with
SHORT_CLIP_S = 10.0  # "short clips" of the latency targets: <= 10 s
REPLAY_SEED = 20240603


@dataclass(frozen=True)
class Clip:
    """One clip of a corpus manifest: its audio file, duration and reference transcript."""

    id: str
    path: Path
    duration_s: float
    reference: str
    set: str
    sample_rate: int = 16_000
    channels: int = 1
    language: str | None = None  # the manifest's; the English corpus says "en"
    translation: str | None = None  # the published English translation (multilingual corpus)


def read_manifest(corpus: Path) -> list[Clip]:
    """Every clip of ``corpus/manifest.jsonl``, in the manifest's order (FileNotFoundError
    without one)."""
    out = []
    for line in (corpus / "manifest.jsonl").read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Clip(d["id"], corpus / d["file"], float(d["duration_s"]), d["reference"],
                            d["set"], int(d.get("sample_rate") or 16_000),
                            int(d.get("channels") or 1), d.get("language"),
                            d.get("reference_translation_en")))
    return out


def load_corpus(corpus: Path = DEFAULT_CORPUS) -> list[Clip]:
    """The benchmarks' corpus, by clip id (SystemExit with a hint when it is missing)."""
    if not (corpus / "manifest.jsonl").is_file():
        raise SystemExit(f"corpus not found: {corpus / 'manifest.jsonl'} "
                         "(pass --corpus or set BATCHSCRIBE_CORPUS)")
    return sorted(read_manifest(corpus), key=lambda c: c.id)


def load_ml_corpus(corpus: Path = ML_CORPUS) -> list[Clip]:
    """The multilingual corpus, by language and id. Its README's one reference fix: the stray
    ``.x`` that ends ``fleurs-de-cuttledoc-008`` (inherited from FLoRes) is removed."""
    if not (corpus / "manifest.jsonl").is_file():
        raise SystemExit(f"corpus not found: {corpus / 'manifest.jsonl'} "
                         "(set BATCHSCRIBE_MULTILINGUAL_CORPUS)")
    clips = [replace(c, reference=c.reference[:-1]) if c.reference.endswith(".x") else c
             for c in read_manifest(corpus)]
    return sorted(clips, key=lambda c: (c.language or "", c.id))


def select_clips(clips: Sequence[Clip], limit: int | None = None,
                 sets: Iterable[str] | None = None) -> list[Clip]:
    """A deterministic subset: only ``sets`` if given, then ``limit`` clips spread over all sets."""
    chosen = [c for c in clips if sets is None or c.set in set(sets)]
    if limit is not None and limit < len(chosen):
        by_set = sorted(chosen, key=lambda c: (c.set, c.id))
        step = len(by_set) / limit
        chosen = [by_set[int(i * step)] for i in range(limit)]
    return chosen


def save_clips(clips: Sequence[Clip], path: Path) -> None:
    """The clips as JSON, for a subprocess (:func:`read_clips`)."""
    path.write_text(json.dumps([{**asdict(c), "path": str(c.path)} for c in clips], indent=1))


def read_clips(path: Path) -> list[Clip]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    return [Clip(**{**d, "path": Path(d["path"])}) for d in rows]


def replay_order(clips: Sequence[Clip], seed: int = REPLAY_SEED) -> list[Clip]:
    """The fixed pseudo-random order every phase replays the corpus in (cycled)."""
    order = list(clips)
    random.Random(seed).shuffle(order)
    return order


def audio_total(clips: Iterable[Clip]) -> float:
    return sum(c.duration_s for c in clips)
