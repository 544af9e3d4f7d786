"""The benchmark of issue 3, one command, all comparisons in ONE run.

    .venv/bin/python -m loadtest.bench --duration 60 --clients 32 \
        --out loadtest/results/bench.json --readme README.md

Phases, never overlapping (each heavy one in its own process, so thread pools and memory never
mix, and tcmalloc is preloaded in each as scripts/env.sh does):

1. baselines (subprocess): faster-whisper one request at a time (a) at the service's decode
   settings, (b) at its defaults, (c) ``num_workers=2`` x 1 thread with two requests in flight;
2. engine limit (one subprocess per workers x threads): the service's own windows, pre-cut with
   app.audio, fed to app.engine.WhisperEngine offline at each batch size; the best one counts;
3. the service (``python -m app`` on a free port, temp data dir): idle latency of short clips
   (one client), a WER pass (every clip, batched), ``--clients`` closed-loop HTTP clients
   replaying the corpus for ``--duration`` seconds after ``--warmup``, then short clips sent
   while a >= 10 min file is always in flight.

Throughput is audio seconds (whole files) per wall second everywhere. Results go to ``--out``
(JSON) and a Markdown table to ``<out>.md``; with ``--readme`` the table replaces the text
between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` if both markers are there.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.common import (
    READ_SPEECH,
    SHORT_CLIP_S,
    Clip,
    child_env,
    cpu_count,
    layout_name,
    load_corpus,
    machine_info,
    normaliser_name,
    parse_layout,
    resolve_model,
    run_json_subprocess,
    save_clips,
    select_clips,
    wer_by_group,
)
from loadtest.service import (
    Client,
    Server,
    all_at_once,
    closed_loop,
    long_file_scenario,
    sequential,
    write_long_wav,
)

START_MARK, END_MARK = "<!-- bench:start -->", "<!-- bench:end -->"
TARGETS = {"a": 2.0, "b": 3.5, "c": 1.4, "engine": 0.9, "long_p95": 3.0, "wer_points": 0.3}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_engine_configs(spec: str) -> list[tuple[int, int, int, list[int]]]:
    """``"2x1:4,8,16;2e1x1:8"`` -> [(engines, workers, threads, batches), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        layout, batches = part.split(":")
        out.append((*parse_layout(layout), [int(b) for b in batches.split(",")]))
    return out


def effective_settings(env: dict[str, str]) -> dict[str, Any]:
    """The service settings the server subprocess will see with ``env``."""
    from app.config import Settings

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        s = Settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"max_batch_size": s.batcher.max_batch_size, "max_wait_ms": s.batcher.max_wait_ms,
            "duration_bucket_s": s.batcher.duration_bucket_s,
            "engines": getattr(s.model, "engines", 0) or 1,
            "num_workers": s.model.num_workers or cpu_count(), "cpu_threads": s.model.cpu_threads,
            "torch_threads": s.model.torch_threads, "prep_workers": s.prep_workers,
            "default_beam_size": s.default_beam_size, "model": s.model.name}


# ---- phases -----------------------------------------------------------------------------------
def run_baselines(args: argparse.Namespace, work: Path, model: str) -> dict[str, Any]:
    log(f"baselines: {args.baseline_modes} x {args.baseline_duration:.0f}s (subprocess)")
    cmd = ["loadtest.offline", "baselines", "--clips", str(work / "clips.json"), "--model", model,
           "--language", args.language, "--duration", str(args.baseline_duration),
           "--modes", args.baseline_modes]
    if args.wer_defaults:
        cmd.append("--wer-defaults")
    res = run_json_subprocess(cmd, child_env(not args.no_tcmalloc), work / "baselines.json",
                              work / "offline.log", timeout=3600)
    for k, m in res["modes"].items():
        log(f"  ({k}) {m['throughput_x']}x realtime, {m['requests']} requests, "
            f"peak RSS {m['peak_rss_mb']} MB")
    return res


def offline_engine(args: argparse.Namespace, work: Path, model: str, e: int, w: int, t: int,
                   batches: list[int], out: str, *extra: str) -> dict[str, Any]:
    """One ``loadtest.offline engine`` subprocess: this layout at these batch sizes."""
    return run_json_subprocess(
        ["loadtest.offline", "engine", "--clips", str(work / "clips.json"), "--model", model,
         "--language", args.language, "--engines", str(e), "--workers", str(w),
         "--threads", str(t), "--batches", ",".join(map(str, batches)),
         "--min-seconds", str(args.engine_min_seconds), "--cache", str(work), *extra],
        child_env(not args.no_tcmalloc), work / out, work / "offline.log", timeout=3600)


def run_engine(args: argparse.Namespace, work: Path, model: str) -> dict[str, Any]:
    configs = []
    sequential = None
    for i, (e, w, t, batches) in enumerate(parse_engine_configs(args.engine_configs)):
        log(f"engine limit: {layout_name(e, w, t)}, batches {batches} (subprocess)")
        res = offline_engine(args, work, model, e, w, t, batches, f"engine-{e}e{w}x{t}.json",
                             "--texts", *(["--sequential-texts"] if i == 0 else []))
        for r in res["runs"]:
            log(f"  b{r['batch']}: {r['throughput_x']}x realtime, peak RSS {r['peak_rss_mb']} MB")
            configs.append({"engines": e, "workers": w, "threads": t, "order": res["order"],
                            "windows": res["windows"], **r})
        sequential = sequential or res.get("sequential")
    best = max(configs, key=lambda c: c["throughput_x"]) if configs else None
    arrival = None
    if best and args.engine_arrival:
        # The same best layout and batch, windows batched in corpus order instead of sorted by
        # length: what an engine gets with no queue to group lengths from (context for the
        # ratio; the check stays against the sorted best).
        e, w, t, b = best["engines"], best["workers"], best["threads"], best["batch"]
        log(f"engine limit in arrival order: {layout_name(e, w, t)}, batch {b} (subprocess)")
        res = offline_engine(args, work, model, e, w, t, [b], "engine-arrival.json",
                             "--order", "corpus")
        arrival = {"engines": e, "workers": w, "threads": t, "order": res["order"],
                   "windows": res["windows"], **res["runs"][0]}
        log(f"  b{b}: {arrival['throughput_x']}x realtime")
    return {"configs": configs, "best": best, "arrival": arrival, "sequential": sequential}


async def run_service(args: argparse.Namespace, work: Path, clips: list[Clip],
                      long_files: list[tuple[Path, float]]) -> dict[str, Any]:
    env = dict(kv.split("=", 1) for kv in args.server_env)
    env.setdefault("BATCHSCRIBE_MODEL__NAME", args.model)
    settings = effective_settings(env)
    log(f"service: starting python -m app ({settings})")
    server = Server(work / "server", env=env, tcmalloc=not args.no_tcmalloc).start()
    out: dict[str, Any] = {"env": env, "settings": settings, "log": str(server.log_path)}
    short = [c for c in clips if c.duration_s <= SHORT_CLIP_S]
    client = Client(server.url, clips, args.language or None)
    assert server.proc is not None
    pid = server.proc.pid
    try:
        out["rss_idle_mb"] = server.peak_rss_mb()
        await sequential(client, short, 3)  # warm-up
        log(f"service: idle latency, {args.idle_requests} short clips one at a time")
        idle = await sequential(client, short, args.idle_requests)
        out["idle"] = {"latency_short": _lat(idle), "errors": _errors(idle)}
        log(f"  p50 {out['idle']['latency_short']['p50_s']}s, p95 "
            f"{out['idle']['latency_short']['p95_s']}s")

        skip = set(filter(None, args.skip.split(",")))
        texts: dict[str, str | None] = {}
        if "wer" not in skip:
            log(f"service: WER pass, {len(clips)} clips, {args.clients} at a time")
            wer_pass = await all_at_once(client, clips, args.clients)
            texts = {r.clip.id: r.text for r in wer_pass if r.ok}
            out["wer_pass"] = {"texts": texts, "errors": _errors(wer_pass)}
            await client.wait_idle(pid)

        if "load" not in skip:
            log(f"service: {args.clients} clients, {args.warmup:.0f}s warm-up + "
                f"{args.duration:.0f}s")
            load = await closed_loop(client, clips, args.clients, args.warmup, args.duration,
                                     pid, settings["engines"] * settings["num_workers"])
            results = load.pop("_results")
            out["peak_rss_load_mb"] = server.peak_rss_mb()
            compared = [r for r in results if r.ok and r.clip.id in texts]
            load["transcripts_differing_from_wer_pass"] = sum(
                1 for r in compared if (r.text or "").strip() != (texts[r.clip.id] or "").strip())
            load["transcripts_compared"] = len(compared)
            out["load"] = load
            log(f"  {load['throughput_x']}x realtime, short p95 {load['latency_short']['p95_s']}s,"
                f" batches {load['batch_size']['distribution']}, CPU {load['cpu']}")
            await client.wait_idle(pid)

        for k, (long_path, long_audio_s) in enumerate(long_files):
            log(f"service: short clips beside a {long_audio_s / 60:.1f} min file, "
                f">= {args.long_duration:.0f}s")
            scenario = await long_file_scenario(
                client, long_path, long_audio_s, short, args.idle_requests, args.long_duration,
                args.long_short_clients)
            # The first length is the scenario (the check); others are extra rows.
            if k == 0:
                out["long"] = scenario
            else:
                out.setdefault("long_extra", []).append(scenario)
            lat = scenario["latency_short"]
            log(f"  short clips beside it: n {lat['n']}, p50 {lat['p50_s']}s, p95 {lat['p95_s']}s, "
                f"batches {scenario['batch_size']['distribution']}")
            await client.wait_idle(pid)
        out["peak_rss_mb"] = server.peak_rss_mb()
    finally:
        await client.close()
        server.stop()
    return out


def _lat(results: list[Any]) -> dict[str, Any]:
    from loadtest.common import latency_summary

    return latency_summary([r.latency for r in results if r.ok])


def _errors(results: list[Any]) -> list[str]:
    return sorted({r.error or "" for r in results if not r.ok})[:5]


# ---- analysis ---------------------------------------------------------------------------------
def analyse(res: dict[str, Any], clips: list[Clip]) -> None:
    """Ratios, WER and the pass/fail checks of the issue, added to ``res`` in place."""
    svc = res.get("service", {})
    tput = svc.get("load", {}).get("throughput_x")
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    ratios: dict[str, float | None] = {}
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, target: float, higher: bool = True) -> None:
        ok = None if value is None else (value >= target if higher else value <= target)
        checks.append({"check": name, "value": value, "target": ("≥ " if higher else "≤ ")
                       + str(target), "ok": ok})

    for k in ("a", "b", "c"):
        b = base.get(k, {}).get("throughput_x")
        ratios[f"service/{k}"] = round(tput / b, 3) if tput and b else None
        check(f"service / baseline ({k})", ratios[f"service/{k}"], TARGETS[k])
    ratios["service/engine_limit"] = (round(tput / best["throughput_x"], 3)
                                      if tput and best else None)
    check("service / engine limit", ratios["service/engine_limit"], TARGETS["engine"])
    arrival = (res.get("engine") or {}).get("arrival")
    ratios["service/engine_arrival_order"] = (round(tput / arrival["throughput_x"], 3)
                                              if tput and arrival else None)

    idle_p95 = svc.get("idle", {}).get("latency_short", {}).get("p95_s")
    long_p95 = svc.get("long", {}).get("latency_short", {}).get("p95_s")
    ratios["long_p95/idle_p95"] = round(long_p95 / idle_p95, 3) if idle_p95 and long_p95 else None
    check("short p95 beside a long file / idle p95", ratios["long_p95/idle_p95"],
          TARGETS["long_p95"], higher=False)

    wer: dict[str, Any] = {"normaliser": normaliser_name()}
    if "a" in base and "texts" in base["a"]:
        wer["sequential_a"] = wer_by_group(clips, base["a"]["texts"])
    if "b" in base and "texts" in base["b"]:
        wer["defaults_b"] = wer_by_group(clips, base["b"]["texts"])
    if best and "texts" in best:
        wer["engine_limit"] = wer_by_group(clips, best["texts"])
    if ((res.get("engine") or {}).get("sequential") or {}).get("texts"):
        wer["engine_b1"] = wer_by_group(clips, res["engine"]["sequential"]["texts"])
    if "wer_pass" in svc:
        wer["service"] = wer_by_group(clips, {k: v or "" for k, v in svc["wer_pass"]["texts"].items()})
    seq = (wer.get("sequential_a") or {}).get("read_speech", {}).get("wer_percent")
    srv = (wer.get("service") or {}).get("read_speech", {}).get("wer_percent")
    delta = round(srv - seq, 3) if seq is not None and srv is not None else None
    wer["service_minus_sequential_points"] = delta
    check("WER service − sequential (a), read speech, points", delta, TARGETS["wer_points"],
          higher=False)
    same = (wer.get("engine_b1") or {}).get("read_speech", {}).get("wer_percent")
    delta_same = round(srv - same, 3) if same is not None and srv is not None else None
    wer["service_minus_same_windows_b1_points"] = delta_same
    check("WER service − same windows one at a time, read speech, points", delta_same,
          TARGETS["wer_points"], higher=False)
    seq_texts = ((res.get("engine") or {}).get("sequential") or {}).get("texts")
    if seq_texts and best and "texts" in best:
        wer["engine_best_transcripts_changed_vs_b1"] = sum(
            1 for k, v in best["texts"].items() if v.strip() != seq_texts.get(k, "").strip())
        wer["engine_transcripts_compared"] = len(best["texts"])
    res["ratios"], res["wer"], res["checks"] = ratios, wer, checks


def _x(v: float | None, suffix: str = "x") -> str:
    return "–" if v is None else f"{v:.1f}{suffix}" if v >= 10 else f"{v:.2f}{suffix}"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def _ok(c: dict[str, Any] | None) -> str:
    return "" if c is None or c["ok"] is None else ("pass" if c["ok"] else "**FAIL**")


def render_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    mach = m["machine"]
    v = mach["versions"]
    svc = res.get("service", {})
    st = svc.get("settings", {})
    load = svc.get("load", {})
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    checks = {c["check"]: c for c in res.get("checks", [])}
    r = res.get("ratios", {})
    lines = [
        f"Last run {m['finished']} on {mach['cpu']}, {mach['cores']} cores, {mach['memory_gb']} GB "
        f"(load average at start {mach['load_average_at_start'][0]}), Linux {mach['kernel']}, "
        f"Python {mach['python']}, CTranslate2 {v['ctranslate2']}, faster-whisper "
        f"{v['faster-whisper']}, whisperx {v['whisperx']}, commit {mach['git']}, "
        f"allocator {'glibc' if m['args']['no_tcmalloc'] else 'tcmalloc'}, model {st.get('model')} "
        f"int8, {res['corpus']['clips']} corpus clips ({res['corpus']['audio_s']:.0f} s) replayed.",
        "",
        f"Command: `{m['command']}` ({m['runtime_s'] / 60:.1f} min)",
        "",
        "| set-up | throughput (audio s / wall s) | service ÷ set-up | target | |",
        "| --- | --- | --- | --- | --- |",
        f"| **service**, {load.get('clients')} HTTP clients (cap {st.get('max_batch_size')}, "
        f"{layout_name(st.get('engines', 1), st.get('num_workers', 1), st.get('cpu_threads', 1))}, "
        f"max_wait {st.get('max_wait_ms')} ms) | **{_x(load.get('throughput_x'))}** | | | |",
    ]
    for k in ("a", "b", "c"):
        if k in base:
            c = checks.get(f"service / baseline ({k})")
            lines.append(f"| ({k}) {base[k]['label']} | {_x(base[k]['throughput_x'])} | "
                         f"{_x(r.get(f'service/{k}'))} | ≥ {TARGETS[k]}x | {_ok(c)} |")
    if best:
        c = checks.get("service / engine limit")
        lines.append(f"| engine limit: same windows offline, best of {len(res['engine']['configs'])}"
                     f" configs = {layout_name(best['engines'], best['workers'], best['threads'])}, batch "
                     f"{best['batch']} | {_x(best['throughput_x'])} | "
                     f"{_x(r.get('service/engine_limit'))} | ≥ {TARGETS['engine']}x | {_ok(c)} |")
    arrival = (res.get("engine") or {}).get("arrival")
    if arrival:
        lines.append(f"| engine, same config, windows batched in arrival order (not sorted) | "
                     f"{_x(arrival['throughput_x'])} | {_x(r.get('service/engine_arrival_order'))}"
                     f" | | context |")
    cpu = load.get("cpu")
    if cpu:
        lines += ["", f"Server CPU under load: {cpu['process_cores']} cores, of which its "
                  f"{cpu['engine_threads']} busiest threads (CTranslate2's workers) "
                  f"{cpu['engine_thread_cores']} and everything else (HTTP, job store, decode, "
                  f"VAD, mel, batching) {cpu['other_cores']}."]
    idle = svc.get("idle", {}).get("latency_short", {})
    lat_load = load.get("latency_short", {})
    lng = svc.get("long", {})
    lat_long = lng.get("latency_short", {})
    c = checks.get("short p95 beside a long file / idle p95")
    idle_p95 = idle.get("p95_s")
    extra = []
    for x in svc.get("long_extra", []):
        lx = x["latency_short"]
        ratio = lx["p95_s"] / idle_p95 if lx.get("p95_s") and idle_p95 else None
        extra.append(f"| one client while a {x['long_audio_s'] / 60:.0f} min file is in flight | "
                     f"{lx.get('n', '–')} | {_s(lx.get('p50_s'))} | {_s(lx.get('p95_s'))} | "
                     f"p95 {_x(ratio)} idle |")
    lines += [
        "",
        f"| latency of clips ≤ {SHORT_CLIP_S:.0f} s (upload to transcript) | n | p50 | p95 | |",
        "| --- | --- | --- | --- | --- |",
        f"| idle server, one client | {idle.get('n', '–')} | {_s(idle.get('p50_s'))} | "
        f"{_s(idle.get('p95_s'))} | |",
        *([f"| {load.get('clients')} clients replaying the corpus | {lat_load.get('n', '–')} | "
           f"{_s(lat_load.get('p50_s'))} | {_s(lat_load.get('p95_s'))} | |"] if load else []),
        f"| one client while a {lng.get('long_audio_s', 0) / 60:.0f} min file is in flight | "
        f"{lat_long.get('n', '–')} | {_s(lat_long.get('p50_s'))} | {_s(lat_long.get('p95_s'))} | "
        f"p95 {_x(r.get('long_p95/idle_p95'))} idle (target ≤ {TARGETS['long_p95']}x) {_ok(c)} |",
        *extra,
    ]
    wer = res.get("wer", {})

    def w(key: str, group: str = "read_speech") -> str:
        val = (wer.get(key) or {}).get(group, {}).get("wer_percent")
        return "–" if val is None else f"{val:.2f}"

    c = checks.get("WER service − sequential (a), read speech, points")
    lines += [
        "",
        f"| WER % ({wer.get('normaliser')}) | read speech ({'+'.join(READ_SPEECH)}) | other sets |",
        "| --- | --- | --- |",
        f"| (a) sequential, service settings | {w('sequential_a')} | {w('sequential_a', 'other_sets')} |",
    ]
    if "defaults_b" in wer:
        lines.append(f"| (b) faster-whisper defaults | {w('defaults_b')} | – |")
    if "engine_b1" in wer:
        lines.append(f"| engine, same windows, batch 1 | {w('engine_b1')} | "
                     f"{w('engine_b1', 'other_sets')} |")
    lines += [
        f"| engine limit config | {w('engine_limit')} | {w('engine_limit', 'other_sets')} |",
        f"| service (batched) | {w('service')} | {w('service', 'other_sets')} |",
        "",
        f"WER service − sequential (a): {wer.get('service_minus_sequential_points')} points "
        f"(target ≤ {TARGETS['wer_points']}) {_ok(c)}; service − same windows one at a time: "
        f"{wer.get('service_minus_same_windows_b1_points')} points "
        f"{_ok(checks.get('WER service − same windows one at a time, read speech, points'))}. "
        f"Transcripts changed by batching (engine limit config vs batch 1): "
        f"{wer.get('engine_best_transcripts_changed_vs_b1', '–')} of "
        f"{wer.get('engine_transcripts_compared', '–')}; load-phase transcripts differing from the "
        f"WER pass: {load.get('transcripts_differing_from_wer_pass')} of "
        f"{load.get('transcripts_compared')}.",
        "",
        f"Server peak RSS {svc.get('peak_rss_mb')} MB (after the load phase "
        f"{svc.get('peak_rss_load_mb')} MB); baselines peak RSS "
        + ", ".join(f"({k}) {base[k]['peak_rss_mb']} MB" for k in base)
        + (f"; engine limit config {best['peak_rss_mb']} MB" if best else "") + ".",
        "",
        f"Batch sizes under load (windows: batches): {load.get('batch_size', {}).get('distribution')}"
        f", mean {load.get('batch_size', {}).get('mean')}; mean batch fill (speech / 30 s "
        f"padding) {load.get('batch_fill', {}).get('mean')}.",
    ]
    return "\n".join(lines) + "\n"


def replace_readme(readme: Path, md: str) -> bool:
    if not readme.is_file():
        log(f"{readme} not found; README not updated")
        return False
    text = readme.read_text()
    a, b = text.find(START_MARK), text.find(END_MARK)
    if a < 0 or b < a:
        log(f"{readme} has no {START_MARK} ... {END_MARK} section; README not updated")
        return False
    readme.write_text(text[:a + len(START_MARK)] + "\n" + md + text[b:])
    log(f"{readme}: benchmark section replaced")
    return True


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="service load, measured seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="service load, unmeasured seconds first")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--baseline-duration", type=float, default=60.0, help="seconds per baseline")
    p.add_argument("--baseline-modes", default="a,b,c")
    p.add_argument("--wer-defaults", action="store_true",
                   help="also score baseline (b) on read speech (~30 s more)")
    p.add_argument("--engine-configs", default="2x1:4,8,16;1x2:16,32;2e1x1:8",
                   help="[engines e] workers x threads : batch sizes; ';' between configs")
    p.add_argument("--engine-min-seconds", type=float, default=30.0,
                   help="repeat passes over the windows until this long per batch size (one "
                        "~12 s pass is noisy, and the best of several noisy runs is biased up)")
    p.add_argument("--engine-arrival", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the best engine config on windows in arrival order")
    p.add_argument("--idle-requests", type=int, default=30,
                   help="short clips timed on the idle server (and at least as many beside the "
                        "long file)")
    p.add_argument("--long-minutes", default="10",
                   help="length of the long file; a comma list runs one scenario per length "
                        "(the first is the issue's check), e.g. 10,30")
    p.add_argument("--long-duration", type=float, default=60.0,
                   help="seconds of short clips beside the long file")
    p.add_argument("--long-short-clients", type=int, default=1)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra service settings, e.g. BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE=8")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--language", default="en", help="sent with every request; '' to detect")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--clips", type=int, default=None, help="use a spread subset of N clips")
    p.add_argument("--skip", default="",
                   help="comma list of phases to leave out: baselines,engine,service,wer,load,long")
    p.add_argument("--no-tcmalloc", action="store_true", help="every phase on glibc malloc")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/bench.json"))
    p.add_argument("--readme", type=Path, default=None)
    p.add_argument("--strict", action="store_true", help="exit 1 if a target of the issue is missed")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

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
            long_files: list[tuple[Path, float]] = []
            if "long" not in skip:
                for minutes in (float(m) for m in args.long_minutes.split(",")):
                    path = work / f"long-{minutes:g}min.wav"
                    long_files.append((path, write_long_wav(clips, path, minutes * 60)))
            res["service"] = asyncio.run(run_service(args, work, clips, long_files))
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
    md = render_markdown(res)
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
