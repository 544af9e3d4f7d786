"""An output row of ``batchscribe dataset``: the input row plus what the service found.

Fields added (the input's own fields are never changed):

* ``pred_text`` (``--pred-key``): the transcript;
* ``language``: the language transcribed in (given or detected); ``pred_language`` instead when
  the input already has a ``language`` field;
* ``duration``: the decoded audio's length, when the input gives none;
* ``rtf``: the job's real-time factor (audio seconds / processing seconds);
* with a reference (``text``, or ``--text-key``): ``wer`` in percent (``cer`` for zh/ja/ko/yue,
  whose text has no word spaces) and ``normaliser``, the one both sides went through
  (app/client/scoring.py, the project's scorer);
* optional ``segments`` (start, end, text), ``words`` (word, start, end, probability), and
  ``srt_filepath`` / ``vtt_filepath`` for subtitle files written under ``OUT.subs/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.client import scoring
from app.client.manifest import Row


@dataclass(frozen=True)
class Extras:
    pred_key: str = "pred_text"
    segments: bool = False
    words: bool = False
    subtitles: tuple[str, ...] = ()  # "srt", "vtt"
    subs_dir: Path | None = None


def output_row(row: Row, job: dict[str, Any], extras: Extras,
               stem: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The output row, and the facts the summary needs (audio seconds; the score's metric,
    errors, units and normaliser), kept in the checkpoint's done record."""
    result = job.get("result") or {}
    text = str(result.get("text") or "").strip()
    out = dict(row.fields)
    out[extras.pred_key] = text
    lang = result.get("language")
    out["pred_language" if "language" in row.fields else "language"] = lang
    audio_s = round(float(result.get("duration") or job.get("audio_seconds") or 0.0), 3)
    if row.duration is None:
        out["duration"] = audio_s
    out["rtf"] = job.get("rtf")
    facts: dict[str, Any] = {"audio_s": audio_s}
    if row.reference is not None:
        s = scoring.score(row.reference, text, row.language or lang)
        if s is not None:
            out[s.metric] = s.percent
            out["normaliser"] = s.normaliser
            facts["score"] = [s.metric, s.errors, s.units, s.normaliser]
    if extras.segments:
        out["segments"] = [{"start": s["start"], "end": s["end"], "text": str(s["text"]).strip()}
                           for s in result.get("segments") or []]
    if extras.words:
        out["words"] = result.get("words") or []
    for fmt in extras.subtitles:
        assert extras.subs_dir is not None
        out[f"{fmt}_filepath"] = str(write_subtitles(result, fmt, extras.subs_dir / f"{stem}.{fmt}"))
    return out, facts


def write_subtitles(result: dict[str, Any], fmt: str, path: Path) -> Path:
    """srt/vtt from the job's segments, rendered as the service renders them (app.results.formats).
    Written before the row is recorded: a rerun rewrites the same file."""
    from app.results.formats import render  # srt only; nothing of the service's engine

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(render(result, fmt), encoding="utf-8")  # type: ignore[arg-type]
    tmp.replace(path)
    return path

