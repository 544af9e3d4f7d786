"""What a row gives, as a local file; what a row asks for, as the service's job options.

Rows come from NeMo manifests (``audio_filepath``, ``duration``, ``text``, ``lang``) and from
``ray.data.read_*``: ``read_binary_files`` gives ``bytes`` (and ``path`` with
``include_paths=True``), ``read_audio`` gives ``amplitude`` (channels x samples) and
``sample_rate``, a Hugging Face audio column is a dict with ``bytes``, ``path`` or ``array``
and ``sampling_rate``. The first of these found is the row's audio:

* a local path (relative ones against ``base_dir``): read where it is;
* an ``http(s)://`` URL: downloaded (at most ``limits.max_upload_bytes``); ``s3://``: with
  boto3 and the environment's credentials;
* bytes: spooled to a file, as the service spools an upload;
* samples: written as a float32 WAV at their rate (resampled by the same decoder as uploads).

So every row reaches the service's prep (probe, decode, VAD) as a file, as uploads do. The
spooled copies are removed when the row is done.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.config import Settings
from app.windows import JobOptions

PATH_KEYS = ("audio_filepath", "path", "audio_path", "filepath", "file", "audio_url", "url")
BYTES_KEYS = ("bytes", "audio_bytes")
REMOTE = ("http://", "https://", "s3://")
# Columns that hold audio itself: never copied into an output row.
AUDIO_DATA_KEYS = (*BYTES_KEYS, "amplitude", "audio")


class RowError(Exception):
    """This row's audio cannot be had (missing file, failed download, no audio column)."""


@dataclass(frozen=True)
class Request:
    """What every row asks for (the service's form fields), and where per-row values live."""

    language: str | None = None
    task: str = "transcribe"
    beam_size: int | None = None  # None: the service's default (1 in English, 5 otherwise)
    word_timestamps: bool = False
    initial_prompt: str | None = None
    diarize: bool = False
    num_speakers: int | None = None
    min_speakers: int | None = None
    max_speakers: int | None = None
    language_key: str | None = None  # a column with the row's language (e.g. NeMo's "lang")
    prompt_key: str | None = None  # a column with the row's initial prompt

    def options(self, row: Mapping[str, Any], settings: Settings) -> JobOptions:
        """The job options the API would build for this request and row."""
        lang = _str(row.get(self.language_key)) if self.language_key else None
        lang = (lang or self.language or "").strip().lower() or None
        prompt = _str(row.get(self.prompt_key)) if self.prompt_key else None
        beam, other = default_beams(settings, lang, self.beam_size)
        return JobOptions(language=lang, task=self.task,  # type: ignore[arg-type]
                          beam_size=beam, other_beam_size=other,
                          initial_prompt=(prompt or self.initial_prompt or "").strip() or None,
                          word_timestamps=self.word_timestamps, diarize=self.diarize,
                          num_speakers=self.num_speakers, min_speakers=self.min_speakers,
                          max_speakers=self.max_speakers)


def default_beams(settings: Settings, language: str | None,
                  beam_size: int | None) -> tuple[int, int | None]:
    """The API's rule (app/api/uploads.decode_options): the asked beam for all; else the
    English default for English, the other default for the rest, decided now when the language
    is given and per window by the engine when it is detected."""
    if beam_size:
        return beam_size, None
    english, other = settings.default_beam_size, settings.default_beam_size_other
    if language is not None:
        return (english if language == "en" else other), None
    return english, (other if other != english else None)


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v.strip() else None


def audio_source(row: Mapping[str, Any]) -> str | bytes | tuple[np.ndarray, int]:
    """The row's audio: a path or URL, bytes, or (samples, rate); RowError if it has none."""
    audio = row.get("audio")
    if isinstance(audio, Mapping):  # a Hugging Face Audio feature
        if isinstance(audio.get("bytes"), bytes | bytearray) and audio["bytes"]:
            return bytes(audio["bytes"])
        if audio.get("array") is not None and audio.get("sampling_rate"):
            return np.asarray(audio["array"], dtype=np.float32), int(audio["sampling_rate"])
        if _str(audio.get("path")):
            return str(audio["path"])
    if isinstance(audio, bytes | bytearray) and audio:
        return bytes(audio)
    for key in BYTES_KEYS:
        v = row.get(key)
        if isinstance(v, bytes | bytearray) and v:
            return bytes(v)
    if row.get("amplitude") is not None and row.get("sample_rate"):
        return np.asarray(row["amplitude"], dtype=np.float32), int(row["sample_rate"])
    for key in PATH_KEYS:
        if s := _str(row.get(key)):
            return s.strip()
    raise RowError(f"no audio in the row: none of {', '.join(PATH_KEYS + BYTES_KEYS)}, "
                   "amplitude + sample_rate, or an audio dict")


def describe(source: str | bytes | tuple[np.ndarray, int]) -> str:
    """What the row's audio was, for its output row and errors (never the data itself)."""
    if isinstance(source, str):
        return source
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    return f"<{source[0].shape[-1]} samples at {source[1]} Hz>"


class Spool:
    """Local files for rows that are not local files; each removed once its row is done. The
    folder goes with :meth:`close`, or when the spool is collected or its process exits: a Ray
    actor is torn down without ``close``, and each left an empty folder in ``/tmp``."""

    def __init__(self, settings: Settings, base_dir: Path | None = None) -> None:
        self.settings = settings
        self.base_dir = base_dir
        self.dir = Path(tempfile.mkdtemp(prefix="batchscribe-rows-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    def local(self, source: str | bytes | tuple[np.ndarray, int]) -> tuple[Path, bool]:
        """(a local file with the row's audio, whether it is a spooled copy to remove).
        Blocking (downloads, writes): call it off the event loop."""
        if isinstance(source, bytes):
            return self._write(source), True
        if isinstance(source, tuple):
            return self._write(wav_bytes(*source), ".wav"), True
        if source.startswith(("http://", "https://")):
            return self._download(source), True
        if source.startswith("s3://"):
            return self._s3(source), True
        path = Path(source).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        try:
            with path.open("rb"):  # today's dataset mode reports an unreadable file so
                pass
        except OSError as exc:
            raise RowError(f"{type(exc).__name__}: {exc}") from exc
        return path, False

    def release(self, path: Path, spooled: bool) -> None:
        if spooled:
            path.unlink(missing_ok=True)

    def _write(self, data: bytes, suffix: str = "") -> Path:
        path = self.dir / f"{uuid.uuid4().hex}{suffix}"
        path.write_bytes(data)
        return path

    def _download(self, url: str) -> Path:
        import httpx

        limit = self.settings.limits.max_upload_bytes
        path = self.dir / uuid.uuid4().hex
        timeout = httpx.Timeout(self.settings.outbound.fetch_timeout_s, connect=10.0)
        try:
            with httpx.stream("GET", url, follow_redirects=True, timeout=timeout) as r, \
                    path.open("wb") as f:
                r.raise_for_status()
                size = 0
                for block in r.iter_bytes(1 << 20):
                    size += len(block)
                    if size > limit:
                        raise RowError(f"{url}: larger than {limit} bytes (limits.max_upload_bytes)")
                    f.write(block)
        except httpx.HTTPError as exc:
            path.unlink(missing_ok=True)
            raise RowError(f"{url}: {type(exc).__name__}: {exc}") from exc
        except RowError:
            path.unlink(missing_ok=True)
            raise
        return path

    def _s3(self, url: str) -> Path:
        try:
            import boto3
        except ImportError as exc:
            raise RowError(f"{url}: s3:// needs boto3 (pip install boto3)") from exc
        bucket, _, key = url[len("s3://"):].partition("/")
        path = self.dir / uuid.uuid4().hex
        endpoint = self.settings.storage.s3_endpoint_url or None
        try:
            boto3.client("s3", endpoint_url=endpoint).download_file(bucket, key, str(path))
        except Exception as exc:
            path.unlink(missing_ok=True)
            raise RowError(f"{url}: {type(exc).__name__}: {exc}") from exc
        return path

    def close(self) -> None:
        self._remove()


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A float32 WAV of (channels x samples) or (samples,) audio: decoded by the same PyAV
    path as uploads (resampled to 16 kHz mono there)."""
    a = np.asarray(samples, dtype="<f4")
    if a.ndim == 1:
        a = a[None, :]
    channels = a.shape[0]
    data = np.ascontiguousarray(a.T).tobytes()  # interleaved
    block = 4 * channels
    header = b"".join([
        b"RIFF", (36 + len(data)).to_bytes(4, "little"), b"WAVE",
        b"fmt ", (16).to_bytes(4, "little"), (3).to_bytes(2, "little"),  # IEEE float
        channels.to_bytes(2, "little"), int(rate).to_bytes(4, "little"),
        (int(rate) * block).to_bytes(4, "little"), block.to_bytes(2, "little"),
        (32).to_bytes(2, "little"), b"data", len(data).to_bytes(4, "little")])
    return header + data


def plain(v: Any) -> Any:
    """A value from a Ray batch as JSON would have it (numpy scalars and arrays, pandas' NaN
    for a missing value)."""
    if isinstance(v, np.ndarray):
        return [plain(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    return v
