"""``batchscribe``: the command-line client of a running service (``--ray``: of Ray, no service).

    batchscribe transcribe talk.mp3 interview.wav --format srt -o subs/
    batchscribe dataset train.jsonl -o train.pred.jsonl --server http://a:8000 --server http://b:8000
    batchscribe dataset train.jsonl -o train.pred.jsonl --resume      # after an interruption
    batchscribe dataset train.jsonl -o train.pred.jsonl --ray         # no service: Ray actors

Exit status: 0 every file done; 1 some failed (or the time-out came first); 2 bad usage, a bad
manifest or checkpoint, or a refused API key; 130 interrupted (dataset: resume with --resume).

This package speaks HTTP and never imports the service's insides (pyproject's import-linter
contract "client"): ``--ray`` runs the pipeline in this process, so its runner is handed in by
the console script, app/cli.py, which imports it (app/dataset/run.py) only when asked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from app.client import transcribe
from app.client.checkpoint import Checkpoint, CheckpointError
from app.client.dataset import Fatal, Request, Run, Server
from app.client.flow import Flow
from app.client.manifest import Manifest, ManifestError, load
from app.client.progress import Progress, render, summary, write_summary
from app.client.rows import Extras

DEFAULT_URL = os.environ.get("BATCHSCRIBE_URL", "http://127.0.0.1:8000")
RayRunner = Callable[[argparse.Namespace], int]  # ``dataset --ray``: app.dataset.run.run_ray


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchscribe", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transcribe", help="transcribe a few audio files")
    t.add_argument("files", nargs="+", type=Path, metavar="FILE")
    common(t)
    t.add_argument("--format", "-f", choices=("text", "srt", "vtt", "tsv", "json"), default="text")
    t.add_argument("--word-timestamps", action="store_true",
                   help="word times in json (always on for srt/vtt: sentence-sized cues)")
    t.add_argument("--output-dir", "-o", type=Path, help="write <name>.<format> files here")
    d = sub.add_parser("dataset", help="transcribe a manifest, folder or glob: resumable",
                       description="A NeMo-style JSONL manifest (audio_filepath, optional "
                       "duration and reference text, any other fields kept), a folder or a glob, "
                       "through the service; writes a JSONL manifest with pred_text, language, "
                       "duration, rtf and, with a reference, per-utterance wer (cer for "
                       "zh/ja/ko) and the normaliser; a checkpoint (OUT.checkpoint) and a "
                       "summary (OUT.summary.json) beside it.")
    d.add_argument("input", metavar="MANIFEST", help="manifest.jsonl, a folder, or a quoted glob")
    d.add_argument("--output", "-o", type=Path, required=True, metavar="OUT.jsonl")
    common(d)
    d.add_argument("--resume", action="store_true",
                   help="continue the run recorded in OUT.checkpoint (a fresh run if none)")
    d.add_argument("--overwrite", action="store_true", help="start over, discarding OUT")
    d.add_argument("--retry-failed", action="store_true", help="with --resume: retry failed rows")
    d.add_argument("--text-key", default="text", help="the reference's field (default: text)")
    d.add_argument("--pred-key", default="pred_text", help="the transcript's field")
    d.add_argument("--segments", action="store_true", help="add segments (start, end, text)")
    d.add_argument("--words", action="store_true", help="add word timestamps")
    d.add_argument("--subtitles", default="", metavar="srt,vtt",
                   help="also write subtitle files under OUT.subs/ (named in the row)")
    d.add_argument("--max-in-flight", type=int, default=256,
                   help="files in flight per server, at most (flow control sizes it below that)")
    d.add_argument("--initial-in-flight", type=int, default=4)
    d.add_argument("--queue-seconds", type=float, default=20.0,
                   help="seconds of the service's work to keep queued on each server")
    d.add_argument("--uploads", type=int, default=4, help="concurrent uploads per server")
    d.add_argument("--log-every", type=float, default=30.0,
                   help="without a terminal: a progress line every this many seconds (0: none)")
    r = d.add_argument_group("Ray (no service: the model in Ray actors, app/dataset; needs "
                             "`pip install 'batchscribe[ray]'`)")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run through Ray Data instead of --server: a local Ray without ADDRESS, "
                   "else ray.init's address (auto, ray://head:10001)")
    r.add_argument("--actors", type=int, default=None,
                   help="with --ray: actors (default: one per GPU, else one per node)")
    r.add_argument("--batch-rows", type=int, default=None,
                   help="with --ray: rows per batch and per part file (default: 16 CPU, 32 GPU)")
    return p.parse_args(argv)


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", default=None, metavar="URL",
                   help=f"service URL, repeatable (default: env BATCHSCRIBE_URL or {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("BATCHSCRIBE_API_KEY"),
                   help="bearer key, when the service requires one (env BATCHSCRIBE_API_KEY)")
    p.add_argument("--language", help="ISO 639-1 code; detected when absent")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", action="store_true", default=None,
                     help="always show progress bars (default: when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--timeout", type=float, default=7 * 24 * 3600, help="give up after this long (s)")


def servers(args: argparse.Namespace) -> list[str]:
    urls = [u.strip().rstrip("/") for arg in (args.server or [DEFAULT_URL]) for u in arg.split(",")]
    return list(dict.fromkeys(u for u in urls if u))


def run_dataset(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    subtitles = tuple(f for f in (x.strip() for x in args.subtitles.split(",")) if f)
    if set(subtitles) - {"srt", "vtt"}:
        raise ManifestError(f"--subtitles takes srt and/or vtt, not {args.subtitles!r}")
    manifest: Manifest = load(args.input, args.text_key)
    out: Path = args.output
    extras = Extras(args.pred_key, args.segments, args.words, subtitles,
                    out.with_name(out.name + ".subs") if subtitles else None)
    request = Request(args.language, args.task, bool(args.words or subtitles))
    header = {"input": manifest.source, "input_digest": manifest.digest,
              "rows": len(manifest.rows), "language": request.language, "task": request.task,
              "word_timestamps": request.word_timestamps}
    ckpt = Checkpoint.open(out.with_name(out.name + ".checkpoint"), out, header,
                           args.resume, args.overwrite)
    state = ckpt.state
    durations = [r.duration for r in manifest.rows]
    final_failed = 0 if args.retry_failed else len(state.failed)
    progress = Progress(len(manifest.rows),
                        None if None in durations else sum(d or 0.0 for d in durations),
                        files_done=len(state.done), failed=final_failed,
                        audio_done_s=sum(float(d.get("audio_s") or 0.0) for d in state.done.values()),
                        show=sys.stderr.isatty() if args.progress is None else args.progress,
                        log_every_s=args.log_every if args.progress is not False else 0.0)
    flows = [Server(u, Flow(args.initial_in_flight, args.max_in_flight, args.queue_seconds),
                    uploads=asyncio.Semaphore(args.uploads)) for u in servers(args)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    run = Run(manifest, ckpt, flows, request, extras, progress, headers, args.retry_failed)
    started = time.monotonic()
    complete = interrupted = False
    try:
        complete = asyncio.run(run.main(args.timeout, transport))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
        ckpt.close()
        s = summary(state, {r.index: r.fields["audio_filepath"] for r in manifest.rows},
                    time.monotonic() - started, progress.run_audio_s, progress.run_files, out,
                    interrupted or not complete)
        write_summary(out.with_suffix(".summary.json"), s)
        print(render(s), file=sys.stderr)
    if interrupted:
        print("interrupted: the jobs in flight keep running; --resume follows them", file=sys.stderr)
        return 130
    if not complete:
        print(f"gave up after --timeout {args.timeout:.0f} s; --resume continues", file=sys.stderr)
    return 0 if complete and not state.failed else 1


def main(argv: list[str] | None = None, ray: RayRunner | None = None) -> int:
    """Run the command line ``argv``; ``ray`` runs ``dataset --ray`` (None: refused, exit 2)."""
    args = parse_args(argv)
    if args.command == "transcribe":
        args.server = servers(args)[0]
        try:
            return transcribe.run_transcribe(args)
        except KeyboardInterrupt:  # the jobs keep running on the server; ids are in its /jobs list
            print("interrupted", file=sys.stderr)
            return 130
    try:
        if args.ray is not None:
            if ray is None:
                raise Fatal("--ray runs through the batchscribe command (app/cli.py)")
            return ray(args)
        return run_dataset(args)
    except (ManifestError, CheckpointError, Fatal) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
