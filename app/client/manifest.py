"""Inputs of ``batchscribe dataset``: a NeMo-style JSONL manifest, a folder, or a glob.

A NeMo manifest has one JSON object per line with ``audio_filepath`` (absolute, relative to the
manifest's folder, or an ``http(s)://`` / ``s3://`` URL the service fetches itself), optionally
``duration`` (seconds) and the reference ``text``; every other field is carried to the output
unchanged. A folder (searched recursively) or a glob pattern gives rows of ``audio_filepath`` only.

Rows are identified by their position, so the input's identity (a digest of the manifest's bytes,
or of the sorted file list) is recorded in the checkpoint: ``--resume`` against a changed input
is refused instead of attaching old results to other rows.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm", ".aac",
                              ".mp4", ".wma", ".aiff", ".aif"})
REMOTE_SCHEMES = ("http://", "https://", "s3://")
LANGUAGE_KEYS = ("lang", "language", "source_lang")  # NeMo and NeMo Curator spellings


class ManifestError(ValueError):
    """The input cannot be read as rows (a bad line, no audio, no such path)."""


@dataclass(frozen=True)
class Row:
    index: int
    fields: dict[str, Any]  # the input row as given: carried to the output
    audio: str  # a local path (resolved) or a URL
    duration: float | None
    reference: str | None
    language: str | None  # the reference's language, when the manifest names it

    @property
    def remote(self) -> bool:
        return self.audio.startswith(REMOTE_SCHEMES)


@dataclass(frozen=True)
class Manifest:
    source: str
    digest: str
    rows: list[Row]

    def subtitle_stems(self) -> dict[int, str]:
        """A file name stem per row for its srt/vtt, unique over the whole input (a stem that
        occurs twice gets the row number), so it never depends on which rows ran first."""
        stems = {r.index: PurePosixPath(r.audio.split("?", 1)[0]).stem or f"row{r.index}"
                 for r in self.rows}
        seen = Counter(stems.values())
        return {i: s if seen[s] == 1 else f"{s}-{i}" for i, s in stems.items()}


def load(source: str, text_key: str = "text") -> Manifest:
    path = Path(source)
    if path.is_file():
        return _from_jsonl(path, text_key)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _is_audio(p))
    elif glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True)
                       if Path(p).is_file() and _is_audio(Path(p)))
    else:
        raise ManifestError(f"{source}: no such manifest, folder or glob")
    if not files:
        raise ManifestError(f"{source}: no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})")
    names = [str(p.resolve()) for p in files]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    rows = [Row(i, {"audio_filepath": n}, n, None, None, None) for i, n in enumerate(names)]
    return Manifest(source, digest, rows)


def _is_audio(p: Path) -> bool:
    return p.suffix.lower() in AUDIO_EXTENSIONS


def _from_jsonl(path: Path, text_key: str) -> Manifest:
    raw = path.read_bytes()
    base = path.resolve().parent
    rows: list[Row] = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("audio_filepath"), str) \
                or not fields["audio_filepath"].strip():
            raise ManifestError(f"{path}:{n}: a row needs an audio_filepath string")
        audio = fields["audio_filepath"].strip()
        if not audio.startswith(REMOTE_SCHEMES):
            local = Path(audio).expanduser()
            audio = str(local if local.is_absolute() else (base / local).resolve())
        rows.append(Row(len(rows), fields, audio, _number(fields.get("duration")),
                        _text(fields.get(text_key)), _language(fields)))
    if not rows:
        raise ManifestError(f"{path}: no rows")
    return Manifest(str(path), hashlib.sha256(raw).hexdigest(), rows)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else None


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) and v.strip() else None


def _language(fields: dict[str, Any]) -> str | None:
    for key in LANGUAGE_KEYS:
        v = fields.get(key)
        if isinstance(v, str) and 2 <= len(v.strip()) <= 8:
            return v.strip().lower()
    return None
