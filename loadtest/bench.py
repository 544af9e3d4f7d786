"""The benchmark of issue 3, one command, all comparisons in ONE run.

    .venv/bin/python -m loadtest.bench --duration 60 --clients 32 \
        --out loadtest/results/bench.json --readme loadtest/README.md

Phases, never overlapping (each heavy one in its own process, so thread pools and memory never
mix, and tcmalloc is preloaded in each as scripts/env.sh does):

1. baselines (subprocess): faster-whisper one request at a time (a) at the service's decode
   settings, (b) at its defaults, (c) ``num_workers=2`` x 1 thread with two requests in flight;
2. engine limit (one subprocess per workers x threads): the service's own windows, pre-cut with
   app.audio, fed to app.engine.whisper.WhisperEngine offline at each batch size; the best one counts;
3. the service (``python -m app`` on a free port, temp data dir): idle latency of short clips
   (one client), a WER pass (every clip, batched), then ``--rounds`` rounds of: the best engine
   configuration of phase 2 measured again (subprocess, the server idle), and ``--clients``
   closed-loop HTTP clients replaying the corpus for ``--duration`` seconds after ``--warmup``;
   then short clips sent while a >= 10 min file is always in flight; then the speaker phase
   (loadtest/lib/speakers_bench.py): the same multi-speaker workload with and without
   ``diarize=true``, and the ratio.

Service throughput and the engine limit are each the median of the rounds. The sweep of phase 2
only *chooses* the configuration: its best value is the largest of several noisy measurements,
so it is biased up, and a single 60 s round on a shared VM moves by a few %.

Throughput is audio seconds (whole files) per wall second everywhere. Results go to ``--out``
(JSON) and a Markdown table to ``<out>.md``; with ``--readme`` the table replaces the text
between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` if both markers are there.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from loadtest import peer
from loadtest.lib import speakers_bench
from loadtest.lib.common import machine_info, resolve_model
from loadtest.lib.corpus import SHORT_CLIP_S, Clip, load_corpus, save_clips, select_clips
from loadtest.lib.phases import effective_settings, limit_round, run_baselines, run_engine
from loadtest.lib.report import (
    analyse,
    combine_rounds,
    error_kinds,
    log,
    render_markdown,
    replace_readme,
    short_latency,
)
from loadtest.lib.service import Client, Server, all_at_once, closed_loop, sequential, write_long_wav
from loadtest.lib.traffic import beside_long, long_alone, rss_during, write_long_flac


async def _load_round(client: Client, args: argparse.Namespace, clips: list[Clip], pid: int,
                      threads: int, texts: dict[str, str | None]) -> dict[str, Any]:
    load = await closed_loop(client, clips, args.clients, args.warmup, args.duration, pid, threads)
    results, counted = load.pop("_results"), load.pop("_counted")
    compared = [r for r in results if r.ok and r.clip.id in texts]
    load["transcripts_differing_from_wer_pass"] = sum(
        1 for r in compared if (r.text or "").strip() != (texts[r.clip.id] or "").strip())
    load["transcripts_compared"] = len(compared)
    load["_latencies"] = [r.latency for r in counted]
    load["_short"] = [r.latency for r in counted if r.clip.duration_s <= SHORT_CLIP_S]
    await client.wait_idle(pid)
    return load


def _combine(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    loads = [r[key] for r in rounds]
    lat = [x for ld in loads for x in ld.pop("_latencies")]
    short = [x for ld in loads for x in ld.pop("_short")]
    return combine_rounds(loads, lat, short)


async def run_service(args: argparse.Namespace, work: Path, clips: list[Clip],
                      long_file: tuple[Path, float] | None,
                      measure_limit: Callable[[int], dict[str, Any]] | None) -> dict[str, Any]:
    """Idle latency, WER passes, load rounds and the long-upload scenarios on one server.

    Clients send no language (what users send) unless they are the ``language=en`` comparison:
    every load round runs both, back to back, after the engine limit is measured again."""
    env = dict(kv.split("=", 1) for kv in args.server_env)
    env.setdefault("BATCHSCRIBE_MODEL__NAME", args.model)
    settings = effective_settings(env)
    log(f"service: starting python -m app ({settings})")
    server = Server(work / "server", env=env, tcmalloc=not args.no_tcmalloc).start()
    out: dict[str, Any] = {"env": env, "settings": settings, "log": str(server.log_path)}
    short = [c for c in clips if c.duration_s <= SHORT_CLIP_S]
    client = Client(server.url, clips, None)  # no language: detected, as users send
    client_en = Client(server.url, clips, "en")
    assert server.proc is not None
    pid = server.proc.pid
    threads = settings["engines"] * settings["num_workers"]
    skip = set(filter(None, args.skip.split(",")))
    try:
        out["rss_idle_mb"] = server.peak_rss_mb()
        await sequential(client, short, 3)  # warm-up
        log(f"service: idle latency, {args.idle_requests} short clips one at a time, no language")
        idle = await sequential(client, short, args.idle_requests)
        out["idle"] = {"latency_short": short_latency(idle), "errors": error_kinds(idle)}
        log(f"  p50 {out['idle']['latency_short']['p50_s']}s, p95 "
            f"{out['idle']['latency_short']['p95_s']}s")

        texts: dict[str, str | None] = {}
        texts_en: dict[str, str | None] = {}
        if "wer" not in skip:
            for name, c, into in (("wer_pass", client, texts), ("wer_pass_en", client_en, texts_en)):
                log(f"service: {name}, {len(clips)} clips, {args.clients} at a time")
                passed = await all_at_once(c, clips, args.clients)
                into.update({r.clip.id: r.text for r in passed if r.ok})
                out[name] = {"texts": dict(into), "errors": error_kinds(passed),
                             "languages": {r.clip.id: r.language for r in passed if r.ok}}
                await c.wait_idle(pid)

        if "load" not in skip:
            rounds: list[dict[str, Any]] = []
            for k in range(args.rounds):
                # The limit re-measured right before each round (the server idle meanwhile):
                # a drift of the VM's speed then moves both sides of the ratio.
                limit = await asyncio.to_thread(measure_limit, k) if measure_limit else None
                rnd: dict[str, Any] = {"engine_limit": limit}
                pair = [("load_en", client_en, texts_en), ("load", client, texts)]
                # Alternate which goes first, so neither side always follows the idle limit run.
                for key, c, ref in (pair if k % 2 == 0 else pair[::-1]):
                    log(f"service round {k + 1}/{args.rounds} ({key}): {args.clients} clients, "
                        f"{args.warmup:.0f}s warm-up + {args.duration:.0f}s")
                    rnd[key] = await _load_round(c, args, clips, pid, threads, ref)
                    log(f"  {rnd[key]['throughput_x']}x realtime, short p95 "
                        f"{rnd[key]['latency_short']['p95_s']}s, batches "
                        f"{rnd[key]['batch_size']['distribution']}, CPU {rnd[key]['cpu']}")
                out["peak_rss_load_mb"] = server.peak_rss_mb()
                rounds.append(rnd)
            out["load"] = _combine(rounds, "load")
            out["load_en"] = _combine(rounds, "load_en")
            out["rounds"] = [{"engine_limit": r["engine_limit"], "load": r["load"],
                              "load_en": r["load_en"]} for r in rounds]

        if long_file is not None:
            path, audio_s = long_file
            log(f"service: a {audio_s / 60:.0f} min upload alone")
            out["long_alone"] = await long_alone(client, path, audio_s)
            log(f"  {out['long_alone']['throughput_x']}x realtime from its POST")
            await client.wait_idle(pid)
            log(f"service: short clips one at a time from a {audio_s / 60:.0f} min upload's POST, "
                f">= {args.long_min_requests} requests and >= {args.long_duration:.0f}s")
            out["long"] = await beside_long(client, path, audio_s, short,
                                            args.long_min_requests, args.long_duration)
            lat = out["long"]["latency_short"]
            log(f"  n {lat['n']}, p50 {lat['p50_s']}s, p95 {lat['p95_s']}s")
            await client.wait_idle(pid)
        if "diarize" not in skip:
            out["diarize"] = await speakers_bench.phase(args, server.url, clips, pid,
                                                        settings["engines"] * settings["num_workers"])
        out["peak_rss_mb"] = server.peak_rss_mb()
    finally:
        await client.close()
        await client_en.close()
        server.stop()
    return out


async def run_rss(args: argparse.Namespace, work: Path, clips: list[Clip],
                  path: Path, audio_s: float) -> dict[str, Any]:
    """A fresh server: idle peak RSS, then RSS while a multi-hour upload is transcribed."""
    env = dict(kv.split("=", 1) for kv in args.server_env)
    env.setdefault("BATCHSCRIBE_MODEL__NAME", args.model)
    env["BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES"] = str(max(path.stat().st_size * 2, 2**29))
    # The file is the corpus repeated to at least --rss-hours: a little over 4 h by default,
    # past the default max_audio_s (4 h), which answered 413.
    env["BATCHSCRIBE_LIMITS__MAX_AUDIO_S"] = str(int(audio_s) + 600)
    log(f"rss: a fresh server, then a {audio_s / 3600:.1f} h upload ({path.stat().st_size >> 20}"
        " MiB FLAC)")
    server = Server(work / "server-rss", env=env, tcmalloc=not args.no_tcmalloc).start()
    client = Client(server.url, clips, None)
    try:
        short = [c for c in clips if c.duration_s <= SHORT_CLIP_S][:5]
        out = await rss_during(server, client, path, audio_s, short)
    finally:
        await client.close()
        server.stop()
    log(f"  idle peak {out['idle_peak_rss_mb']} MB, peak {out['peak_rss_mb']} MB "
        f"(+{out['growth_mb']} MB), {out['throughput_x']}x realtime")
    return out


def _strip_texts(obj: Any) -> Any:
    """Transcripts are bulky: keep them in ``<out>.texts.json``, not in the results file."""
    if isinstance(obj, dict):
        return {k: _strip_texts(v) for k, v in obj.items() if k != "texts"}
    if isinstance(obj, list):
        return [_strip_texts(v) for v in obj]
    return obj


def _collect_texts(obj: Any, path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "texts":
                out[path or "root"] = v
            else:
                out.update(_collect_texts(v, f"{path}.{k}" if path else k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_collect_texts(v, f"{path}[{i}]"))
    return out


def markdown(res: dict[str, Any]) -> str:
    """The results' Markdown: the README's block between the bench marks."""
    return render_markdown(res) + speakers_bench.markdown(res)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="service load, measured seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="service load, unmeasured seconds first")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3,
                   help="service load rounds, each after the best engine config is measured "
                        "again; the medians count (one 60 s run moves by a few %%)")
    p.add_argument("--baseline-duration", type=float, default=60.0, help="seconds per baseline")
    p.add_argument("--baseline-modes", default="a,b,c")
    p.add_argument("--wer-defaults", action="store_true",
                   help="also score baseline (b) on read speech (~30 s more)")
    p.add_argument("--engine-configs", default="2x1:4,8,16,32;1x2:16,32;2e1x1:8",
                   help="[engines e] workers x threads : batch sizes; ';' between configs")
    p.add_argument("--engine-min-seconds", type=float, default=30.0,
                   help="repeat passes over the windows until this long per batch size (one "
                        "~12 s pass is noisy, and the best of several noisy runs is biased up)")
    p.add_argument("--engine-arrival", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the best engine config on windows in arrival order")
    p.add_argument("--idle-requests", type=int, default=100,
                   help="short clips timed one at a time on the idle server (no language)")
    p.add_argument("--long-minutes", type=float, default=20.0,
                   help="the long upload: alone, then beside short clips counted from its POST")
    p.add_argument("--long-min-requests", type=int, default=100,
                   help="short requests beside the long upload, at least")
    p.add_argument("--long-duration", type=float, default=60.0,
                   help="seconds of short clips beside the long upload, at least")
    p.add_argument("--rss-hours", type=float, default=4.0,
                   help="the upload of the memory phase (a fresh server); 0 skips it")
    speakers_bench.add_arguments(p)
    peer.add_arguments(p)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra service settings, e.g. BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE=8")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--language", default="en",
                   help="the language of the offline phases (baselines, engine limit); the "
                        "service phases send none, plus language=en in every load round")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--clips", type=int, default=None, help="use a spread subset of N clips")
    p.add_argument("--skip", default="",
                   help="comma list of phases to leave out: "
                        "baselines,engine,service,wer,load,long,rss,diarize,peer")
    p.add_argument("--no-tcmalloc", action="store_true", help="every phase on glibc malloc")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/bench.json"))
    p.add_argument("--readme", type=Path, default=None)
    p.add_argument("--render", type=Path, default=None, metavar="RESULTS",
                   help="run nothing: write RESULTS' Markdown (to --readme when given)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target of the issue is missed")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if args.render:
        md = markdown(json.loads(args.render.read_text()))
        print(md)
        if args.readme:
            replace_readme(args.readme, md)
        return 0

    started = time.time()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="batchscribe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    clips = select_clips(load_corpus(args.corpus) if args.corpus else load_corpus(), args.clips)
    save_clips(clips, work / "clips.json")
    model = resolve_model(args.model)
    res: dict[str, Any] = {
        "meta": {"command": "python -m loadtest.bench " + shlex.join(sys.argv[1:] if argv is None
                                                                     else argv),
                 "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                 "machine": machine_info(), "workdir": str(work),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
        "corpus": {"clips": len(clips), "audio_s": round(sum(c.duration_s for c in clips), 3),
                   "short_clips": sum(c.duration_s <= SHORT_CLIP_S for c in clips),
                   "sets": sorted({c.set for c in clips})},
    }
    log(f"workdir {work}; {len(clips)} clips, {res['corpus']['audio_s']:.0f} s of audio")
    try:
        if "baselines" not in skip:
            res["baselines"] = run_baselines(args, work, model)
        if "engine" not in skip:
            res["engine"] = run_engine(args, work, model)
        if "service" not in skip:
            long_file: tuple[Path, float] | None = None
            if "long" not in skip:
                path = work / f"long-{args.long_minutes:g}min.wav"
                long_file = (path, write_long_wav(clips, path, args.long_minutes * 60))
            best = (res.get("engine") or {}).get("best")
            res["service"] = asyncio.run(run_service(
                args, work, clips, long_file,
                partial(limit_round, args, work, model, best) if best else None))
        if "rss" not in skip and args.rss_hours > 0:
            path = work / f"long-{args.rss_hours:g}h.flac"
            seconds = write_long_flac(clips, path, args.rss_hours * 3600)
            res["rss"] = asyncio.run(run_rss(args, work, clips, path, seconds))
        if "peer" not in skip:  # the same closed loop on faster-whisper-server, its own venv
            log("peer: faster-whisper-server side by side (loadtest/peer.py)")
            res.update(asyncio.run(peer.phases(args, work, clips)))
        analyse(res, clips)
    finally:
        res["meta"]["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        res["meta"]["runtime_s"] = round(time.time() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_strip_texts(res), indent=1, ensure_ascii=False))
        args.out.with_suffix(".texts.json").write_text(
            json.dumps(_collect_texts(res), indent=1, ensure_ascii=False))
        if args.workdir is None and "checks" in res:
            shutil.rmtree(work, ignore_errors=True)
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    for c in res["checks"]:
        log(f"{'PASS' if c['ok'] else 'n/a ' if c['ok'] is None else 'FAIL'} {c['check']}: "
            f"{c['value']} (target {c['target']})")
    if args.readme:
        replace_readme(args.readme, md)
    log(f"results: {args.out} ({res['meta']['runtime_s'] / 60:.1f} min)")
    return 1 if args.strict and any(c["ok"] is False for c in res["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
