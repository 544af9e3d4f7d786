"""The checkpoint of a ``batchscribe dataset`` run: what was submitted where, and which output
rows are final. Exactly once, whenever the client is killed.

A JSON-lines file beside the output (``OUT.checkpoint``), appended and fsync'ed:

* ``header``: the run id (part of every Idempotency-Key), the input's digest, the options;
* ``submitted``: row, attempt, server, job id: a resumed run follows that job, it does not
  submit the row again;
* ``done``: row, the output file's length once its line was written and fsync'ed, and what the
  summary needs (audio seconds, the score's errors and units): a resumed run sums all runs';
* ``failed``: row, attempt, error.

The output holds exactly the rows whose ``done`` record exists: on resume it is cut back to the
last recorded length, which drops a line written by a client killed before it recorded it (and a
half-written one); that row is written again from its job, whose result the service keeps.
A row submitted but not recorded (killed between the POST and the record) is posted again with
the same Idempotency-Key, which names the job the first POST made: no second transcription.
A half-written last checkpoint line is dropped the same way.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint and the command line (or the output file) disagree."""


@dataclass
class Submission:
    attempt: int
    server: str
    job: str


@dataclass
class State:
    header: dict[str, Any]
    submitted: dict[int, Submission] = field(default_factory=dict)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)  # row -> its done record
    failed: dict[int, tuple[int, str]] = field(default_factory=dict)  # row -> (attempt, error)
    out_bytes: int = 0  # the output's length after the last recorded row

    def attempt(self, row: int) -> int:
        """The attempt a new submission of ``row`` makes (a failed one is retried as the next)."""
        if row in self.failed:
            return self.failed[row][0] + 1
        sub = self.submitted.get(row)
        return sub.attempt if sub else 0


class Checkpoint:
    def __init__(self, path: Path, out: Path, state: State, handle: IO[str], out_handle: IO[bytes]):
        self.path, self.out, self.state = path, out, state
        self._f, self._out = handle, out_handle

    @property
    def run_id(self) -> str:
        return str(self.state.header["run_id"])

    def idempotency_key(self, row: int, attempt: int) -> str:
        return f"{self.run_id}-{row}-{attempt}"

    @classmethod
    def open(cls, path: Path, out: Path, header: dict[str, Any], resume: bool,
             overwrite: bool) -> Checkpoint:
        """Start a run (new checkpoint, empty output) or, with ``resume``, continue one."""
        if path.exists() and resume:
            state, keep = _replay(path)
            _check(state.header, header)
            size = out.stat().st_size if out.exists() else 0
            if size < state.out_bytes:
                raise CheckpointError(f"{out} is shorter ({size} bytes) than its checkpoint "
                                      f"records ({state.out_bytes}): it was changed outside this tool")
            with path.open("r+b") as f:
                f.truncate(keep)  # a half-written last record
            with out.open("a+b") as f:
                f.truncate(state.out_bytes)  # lines written but never recorded
        else:
            if not overwrite and (path.exists() or (out.exists() and out.stat().st_size)):
                raise CheckpointError(
                    f"{out if not path.exists() else path} exists: pass --resume to continue "
                    "that run, or --overwrite to start over")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"")
            state = State({**header, "type": "header", "version": VERSION,
                           "run_id": uuid.uuid4().hex, "created": round(time.time(), 3)})
            path.write_text(json.dumps(state.header) + "\n")
            _fsync_path(path)
        return cls(path, out, state, path.open("a", encoding="utf-8"), out.open("ab"))

    def submitted(self, row: int, attempt: int, server: str, job: str) -> None:
        self.state.submitted[row] = Submission(attempt, server, job)
        self.state.failed.pop(row, None)
        self._append([{"type": "submitted", "row": row, "attempt": attempt, "server": server,
                       "job": job}])

    def finish(self, rows: list[tuple[int, dict[str, Any], dict[str, Any]]]) -> None:
        """Write output rows, make them durable, then record them (in that order), each with
        its ``facts`` (JSON: kept in its done record for the summary)."""
        if not rows:
            return
        ends = []
        for _, out_row, _ in rows:
            self._out.write((json.dumps(out_row, ensure_ascii=False) + "\n").encode("utf-8"))
            ends.append(self._out.tell())
        self._out.flush()
        os.fsync(self._out.fileno())
        now = round(time.time(), 3)
        records = []
        for (row, _, facts), end in zip(rows, ends, strict=True):
            rec = {"type": "done", "row": row, "out_bytes": end, "t": now, **facts}
            self.state.done[row] = rec
            self.state.out_bytes = end
            records.append(rec)
        self._append(records)

    def fail(self, row: int, attempt: int, error: str) -> None:
        self.state.failed[row] = (attempt, error)
        self.state.submitted.pop(row, None)
        self._append([{"type": "failed", "row": row, "attempt": attempt, "error": error[:2000]}])

    def close(self) -> None:
        self._f.close()
        self._out.close()

    def _append(self, records: list[dict[str, Any]]) -> None:
        self._f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._f.flush()
        os.fsync(self._f.fileno())


def _replay(path: Path) -> tuple[State, int]:
    """The state a checkpoint records, and the byte length of its complete records."""
    raw = path.read_bytes()
    keep = 0
    state: State | None = None
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # killed mid-write
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        keep += len(line)
        kind, row = rec.get("type"), rec.get("row")
        if kind == "header":
            state = State(rec)
        elif state is None:
            raise CheckpointError(f"{path}: no header line")
        elif kind == "submitted":
            state.submitted[row] = Submission(rec["attempt"], rec["server"], rec["job"])
            state.failed.pop(row, None)
        elif kind == "done":
            state.done[row] = rec
            state.out_bytes = rec["out_bytes"]
        elif kind == "failed":
            state.failed[row] = (rec["attempt"], rec.get("error", ""))
            state.submitted.pop(row, None)
    if state is None:
        raise CheckpointError(f"{path}: not a batchscribe dataset checkpoint")
    return state, keep


# What must not change between a run and its resumption: the input and what is asked of the model.
PINNED = ("input_digest", "language", "task", "word_timestamps")


def _check(recorded: dict[str, Any], now: dict[str, Any]) -> None:
    if recorded.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version {recorded.get('version')} (this client: {VERSION})")
    changed = [k for k in PINNED if recorded.get(k) != now.get(k)]
    if changed:
        what = ", ".join(f"{k}: {recorded.get(k)!r} then, {now.get(k)!r} now" for k in changed)
        raise CheckpointError(f"--resume with a different input or options ({what}); "
                              "use the original ones, or --overwrite to start over")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
