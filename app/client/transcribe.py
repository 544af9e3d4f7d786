"""``batchscribe transcribe FILE...``: a few files, each followed with a progress bar.

    batchscribe transcribe talk.mp3 interview.wav --server http://host:8000 --format srt -o subs/

Every file is submitted first (so the server batches them together), then each job is followed
over its Server-Sent Events stream with a progress bar, and its result is fetched in the asked
format: to stdout, or to ``<output-dir>/<name>.<format>``. 429 answers are retried after their
Retry-After; a dropped event stream is resumed. Exit status: 0 all done, 1 any job failed.
Only needs httpx and tqdm (no server-side code is imported). For many files (a dataset, a
manifest) use ``batchscribe dataset``: it keeps a bounded number in flight and can resume.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

FINAL = ("done", "failed", "cancelled")
MAX_429_RETRIES = 20


class CliError(Exception):
    pass


def submit(client: httpx.Client, path: Path, args: argparse.Namespace) -> str:
    data = {"task": args.task,
            "word_timestamps": str(args.word_timestamps or args.format in ("srt", "vtt", "tsv")).lower()}
    if args.language:
        data["language"] = args.language
    for _ in range(MAX_429_RETRIES):
        with path.open("rb") as f:
            r = client.post("/transcribe", files={"file": (path.name, f)}, data=data)
        if r.status_code != 429:
            break
        wait = float(r.headers.get("Retry-After", "5"))
        print(f"{path}: service busy, retrying in {wait:.0f} s", file=sys.stderr)
        time.sleep(wait)
    if r.status_code >= 400:
        raise CliError(f"{path}: {_message(r)}")
    return str(r.json()["id"])


def _message(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
        return f"{err.get('message')} ({r.status_code} {err.get('type')})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs from an event stream's lines; comments and retry hints skipped."""
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


def follow(client: httpx.Client, job_id: str, label: str, show: bool, deadline: float) -> str:
    """Follow a job's events to its end, drawing a bar; returns the final status."""
    with tqdm(total=None, desc=label, unit="win", disable=not show, file=sys.stderr,
              dynamic_ncols=True, leave=True) as bar:
        while time.monotonic() < deadline:
            try:
                with client.stream("GET", f"/jobs/{job_id}/events") as r:
                    if r.status_code >= 400:
                        r.read()
                        raise CliError(f"{label}: {_message(r)}")
                    for event, data in sse_events(r.iter_lines()):
                        if data.get("windows_total") and bar.total != data["windows_total"]:
                            bar.total = data["windows_total"]
                            bar.refresh()
                        done = int(data.get("progress", {}).get("windows_done", 0)
                                   if event in FINAL else data.get("windows_done", 0))
                        bar.update(max(0, done - bar.n))
                        bar.set_postfix_str(str(data.get("status", event)))
                        if event in FINAL:
                            return event
            except httpx.TransportError:  # server restarting or a proxy cut: resume the stream
                pass
            status = str(client.get(f"/jobs/{job_id}").json().get("status"))
            if status in FINAL:
                return status
            time.sleep(1.0)
    raise CliError(f"{label}: gave up waiting after the --timeout")


def run_transcribe(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    show = sys.stderr.isatty() if args.progress is None else args.progress
    deadline = time.monotonic() + args.timeout
    failures = 0
    timeout = httpx.Timeout(60.0, connect=10.0, write=300.0)  # events keep-alive every 15 s
    with httpx.Client(base_url=args.server.rstrip("/"), headers=headers, timeout=timeout) as client:
        jobs: list[tuple[Path, str]] = []
        for path in args.files:
            try:
                if not path.is_file():
                    raise CliError(f"{path}: no such file")
                jobs.append((path, submit(client, path, args)))
            except (CliError, httpx.HTTPError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                failures += 1
        for path, job_id in jobs:
            try:
                status = follow(client, job_id, path.name, show, deadline)
                if status != "done":
                    job = client.get(f"/jobs/{job_id}").json()
                    raise CliError(f"{path}: job {job_id} {status}: "
                                   f"{(job.get('error') or {}).get('message', '')}")
                r = client.get(f"/jobs/{job_id}/result", params={"format": args.format})
                if r.status_code >= 400:
                    raise CliError(f"{path}: {_message(r)}")
                write(path, r.text, args)
            except (CliError, httpx.HTTPError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                failures += 1
    return 1 if failures else 0


def write(src: Path, text: str, args: argparse.Namespace) -> None:
    if args.output_dir is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    ext = "txt" if args.format == "text" else args.format
    out = args.output_dir / f"{src.stem}.{ext}"
    out.write_text(text, encoding="utf-8")
    print(f"{src} -> {out}", file=sys.stderr)
