"""What ``batchscribe dataset`` tells people: one progress bar, then a summary (also as JSON).

The bar counts files and audio hours done (earlier runs of a resumed dataset included), the
speed in x realtime (this run's audio over its wall time), an ETA from the audio still to do at
that speed (from the files' rate when the manifest has no durations), failures and files in
flight. Without a terminal (a batch job's log) it prints the same facts as a line every
``log_every_s`` instead of redrawing a bar.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.client import scoring
from app.client.checkpoint import State


def hms(seconds: float | None) -> str:
    return "?" if seconds is None else str(dt.timedelta(seconds=round(max(0.0, seconds))))


@dataclass
class Progress:
    total_files: int
    total_audio_s: float | None  # known when every row has a duration
    files_done: int = 0  # in the output (all runs)
    audio_done_s: float = 0.0  # all runs
    run_audio_s: float = 0.0  # this run
    run_files: int = 0
    failed: int = 0
    in_flight: int = 0
    show: bool = True
    log_every_s: float = 30.0
    started: float = field(default_factory=time.monotonic)
    _bar: Any = None
    _logged: float = 0.0

    def __post_init__(self) -> None:
        if self.show:
            self._bar = tqdm(total=self.total_files, initial=self.files_done, unit="file",
                             desc="dataset", file=sys.stderr, dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "files [{elapsed}{postfix}]")
            self._bar.set_postfix_str(self.facts(), refresh=True)

    def speed(self) -> float | None:
        wall = time.monotonic() - self.started
        return self.run_audio_s / wall if wall > 0 and self.run_files else None

    def eta(self) -> float | None:
        left = self.total_files - self.files_done - self.failed
        if left <= 0:
            return 0.0
        speed = self.speed()
        if self.total_audio_s is not None and speed:
            return max(0.0, self.total_audio_s - self.audio_done_s) / speed
        wall = time.monotonic() - self.started
        return left * wall / self.run_files if self.run_files else None

    def facts(self) -> str:
        hours = f"{self.audio_done_s / 3600:.2f}"
        if self.total_audio_s is not None:
            hours += f"/{self.total_audio_s / 3600:.2f}"
        speed = self.speed()
        return (f"{hours} h audio, {f'{speed:.1f}x' if speed else '-'} realtime, "
                f"ETA {hms(self.eta())}, {self.failed} failed, {self.in_flight} in flight")

    def update(self, files: int = 0, audio_s: float = 0.0, failed: int = 0) -> None:
        self.files_done += files
        self.run_files += files
        self.audio_done_s += audio_s
        self.run_audio_s += audio_s
        self.failed += failed
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(files)
            self._bar.set_postfix_str(self.facts(), refresh=False)
        elif self.log_every_s > 0 and now - self._logged >= self.log_every_s:
            self._logged = now
            print(f"dataset: {self.files_done}/{self.total_files} files, {self.facts()}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self.facts(), refresh=True)
            self._bar.close()


def summary(state: State, rows: dict[int, str], wall_s: float, run_audio_s: float,
            run_files: int, out: Path, interrupted: bool = False) -> dict[str, Any]:
    """The run's summary from its checkpoint: every run of this dataset for the totals, this
    one for the speed. ``rows``: row -> audio_filepath, to name the failures."""
    scores = [scoring.Score(*d["score"]) for d in state.done.values() if d.get("score")]
    audio = sum(float(d.get("audio_s") or 0.0) for d in state.done.values())
    totals = [t.as_dict() for t in scoring.total(scores)]
    return {
        "output": str(out), "rows": len(rows), "done": len(state.done),
        "failed": len(state.failed), "pending": len(rows) - len(state.done) - len(state.failed),
        "interrupted": interrupted,
        "audio_hours": round(audio / 3600, 4),
        "this_run": {"files": run_files, "audio_hours": round(run_audio_s / 3600, 4),
                     "wall_s": round(wall_s, 1),
                     "x_realtime": round(run_audio_s / wall_s, 2) if wall_s > 0 else None},
        "scores": totals,  # corpus-level WER (CER) over the rows with a reference
        "failures": [{"row": r, "audio_filepath": rows.get(r), "attempt": a, "error": e}
                     for r, (a, e) in sorted(state.failed.items())],
    }


def write_summary(path: Path, s: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(s, indent=1, ensure_ascii=False))
    tmp.replace(path)


def render(s: dict[str, Any]) -> str:
    run = s["this_run"]
    lines = [f"{s['done']}/{s['rows']} rows done, {s['failed']} failed, {s['pending']} pending"
             f"{' (interrupted)' if s['interrupted'] else ''}: {s['audio_hours']:.3f} h of audio",
             f"this run: {run['files']} files, {run['audio_hours']:.3f} h in {hms(run['wall_s'])}"
             f" ({run['x_realtime'] or 0:.1f}x realtime)"]
    for t in s["scores"]:
        lines.append(f"{t['metric'].upper()} {t['percent']}% over {t['utterances']} references "
                     f"({t['errors']} errors / {t['units']} {'words' if t['metric'] == 'wer' else 'chars'}"
                     f", {t['normaliser']})")
    for f in s["failures"][:20]:
        lines.append(f"failed: row {f['row']} {f['audio_filepath']}: {f['error']}")
    if len(s["failures"]) > 20:
        lines.append(f"... {len(s['failures']) - 20} more failures in the summary file")
    lines.append(f"output: {s['output']}")
    return "\n".join(lines)
