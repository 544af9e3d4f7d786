"""Output written per block, named by the row ids it holds: exactly once under retries and reruns.

Each block's rows (done or failed) are one JSON-lines file, ``part-<digest of its sorted row
ids>.jsonl``, written under a temporary name, fsync'ed, then renamed into place (atomic on one
file system). What follows:

* an actor killed mid-block: Ray restarts it and runs the same task on the same input block
  (``max_restarts`` and ``max_task_retries`` are -1 for Ray Data's actors), so the block's rows
  are transcribed again and written under the same name: the rename replaces the file, never
  adds a second. Nothing is lost (the rows are in the input block) and nothing is written
  twice (one name per set of ids);
* killed mid-write: only a temporary file is left (ignored; removed by the next run);
* a rerun reads the ids in the parts and leaves those rows out of its input;
* one id in two parts can only come from ``--retry-failed`` (a row that failed in one run and
  was done in a later one): the done record wins.

The final output (``OUT``, the rows as ``batchscribe dataset`` writes them) is assembled from
the parts at the end of a run, in input order, and replaced atomically: the parts are the
record, the output is derived from them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.client.checkpoint import CheckpointError

HEADER = "_run.json"
VERSION = 1
# What must not change between a run and the rerun that completes it (as app.client.checkpoint).
PINNED = ("input_digest", "language", "task", "word_timestamps", "diarize")


class PartsError(CheckpointError):
    """The parts folder and the command line disagree (the CLI reports it as it reports a
    checkpoint that disagrees: exit status 2)."""


def key(row_id: Any) -> str:
    """A row id as a dict key and sort key, whatever its JSON type."""
    return json.dumps(row_id, sort_keys=True)


def part_name(ids: Iterable[Any]) -> str:
    digest = hashlib.sha256("\n".join(sorted(key(i) for i in ids)).encode()).hexdigest()
    return f"part-{digest[:24]}.jsonl"


@dataclass
class Scan:
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # key(id) -> its record
    parts: int = 0
    seen: Counter[str] = field(default_factory=Counter)  # key(id) -> parts holding it

    @property
    def done(self) -> dict[str, dict[str, Any]]:
        return {k: r for k, r in self.records.items() if r.get("error") is None}

    @property
    def failed(self) -> dict[str, dict[str, Any]]:
        return {k: r for k, r in self.records.items() if r.get("error") is not None}

    def duplicates(self) -> dict[str, int]:
        return {k: n for k, n in self.seen.items() if n > 1}


class PartStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # ---- a run --------------------------------------------------------------------------------
    def start(self, header: dict[str, Any], resume: bool, overwrite: bool) -> None:
        """A fresh run (an empty folder), or with ``resume`` the continuation of the one it
        holds (refused if the input or the options changed)."""
        path = self.root / HEADER
        if path.exists() and resume:
            recorded = json.loads(path.read_text())
            changed = [k for k in PINNED if recorded.get(k) != header.get(k)]
            if recorded.get("version") != VERSION or changed:
                what = ", ".join(f"{k}: {recorded.get(k)!r} then, {header.get(k)!r} now"
                                 for k in changed) or f"version {recorded.get('version')}"
                raise PartsError(f"--resume with a different input or options ({what}); use "
                                 "the original ones, or --overwrite to start over")
            self._clean_tmp()
            return
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise PartsError(f"{self.root} exists: pass --resume to continue that run, or "
                                 "--overwrite to start over")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{HEADER}.tmp"
        tmp.write_text(json.dumps({**header, "version": VERSION}))
        tmp.replace(path)

    def _clean_tmp(self) -> None:
        for p in self.root.glob(".part-*.tmp"):
            p.unlink(missing_ok=True)

    # ---- a block ------------------------------------------------------------------------------
    def write(self, records: Sequence[dict[str, Any]]) -> str:
        """Write one block's records durably under the block's name. A record: ``id``, ``out``
        (the output row, None if it failed), ``error``, ``facts`` (audio seconds, the score),
        ``t`` (when its transcript was done, wall clock)."""
        name = part_name(r["id"] for r in records)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.{uuid.uuid4().hex}.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.root / name)
        fsync_dir(self.root)
        return name

    # ---- reading ------------------------------------------------------------------------------
    def scan(self) -> Scan:
        """Every record in the parts (a done record wins over a failed one of the same id)."""
        out = Scan()
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.glob("part-*.jsonl")):
            out.parts += 1
            for line in path.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                k = key(rec["id"])
                out.seen[k] += 1
                old = out.records.get(k)
                if old is None or old.get("error") is not None:
                    out.records[k] = rec
        return out

    def assemble(self, out: Path, order: Sequence[Any], scan: Scan | None = None) -> int:
        """``out`` from the done records, in ``order`` (the input's ids); atomically. Rows."""
        scan = scan or self.scan()
        done = scan.done
        tmp = out.with_name(f".{out.name}.tmp")
        out.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with tmp.open("w", encoding="utf-8") as f:
            for row_id in order:
                rec = done.get(key(row_id))
                if rec is not None:
                    f.write(json.dumps(rec["out"], ensure_ascii=False) + "\n")
                    n += 1
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
        return n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
