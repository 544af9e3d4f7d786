"""The offline phases of loadtest.bench, each heavy one in its own subprocess: faster-whisper
baselines and the engine limit (the sweep, the best configuration re-measured, and the same
engine at batch 1, in arrival order and on the full 30 s axis)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from loadtest.lib.common import child_env, cpu_count, layout_name, parse_layout, run_json_subprocess
from loadtest.lib.report import log


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
            "torch_threads": s.model.torch_threads, "prep_workers": s.prep.workers or cpu_count(),
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


def config_row(e: int, w: int, t: int, res: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """One measured engine configuration: its layout, window order and one batch size's run."""
    return {"engines": e, "workers": w, "threads": t, "order": res["order"],
            "windows": res["windows"], **run}


def rerun_best(args: argparse.Namespace, work: Path, model: str, best: dict[str, Any],
               what: str, out: str, *extra: str) -> dict[str, Any]:
    """The sweep's best layout and batch size, measured again in its own subprocess."""
    e, w, t, b = best["engines"], best["workers"], best["threads"], best["batch"]
    log(f"engine limit {what}: {layout_name(e, w, t)}, batch {b} (subprocess)")
    res = offline_engine(args, work, model, e, w, t, [b], out, *extra)
    row = config_row(e, w, t, res, res["runs"][0])
    log(f"  b{b}: {row['throughput_x']}x realtime")
    return row


def run_engine(args: argparse.Namespace, work: Path, model: str) -> dict[str, Any]:
    configs = []
    sequential = None
    for i, (e, w, t, batches) in enumerate(parse_engine_configs(args.engine_configs)):
        log(f"engine limit: {layout_name(e, w, t)}, batches {batches} (subprocess)")
        res = offline_engine(args, work, model, e, w, t, batches, f"engine-{e}e{w}x{t}.json",
                             "--texts", *(["--sequential-texts"] if i == 0 else []))
        for r in res["runs"]:
            log(f"  b{r['batch']}: {r['throughput_x']}x realtime, peak RSS {r['peak_rss_mb']} MB")
            configs.append(config_row(e, w, t, res, r))
        sequential = sequential or res.get("sequential")
    best = max(configs, key=lambda c: c["throughput_x"]) if configs else None
    arrival = None
    if best and args.engine_arrival:
        # The same best layout and batch, windows batched in corpus order instead of sorted by
        # length: what an engine gets with no queue to group lengths from (context for the
        # ratio; the check stays against the sorted best).
        arrival = rerun_best(args, work, model, best, "in arrival order", "engine-arrival.json",
                             "--order", "corpus")
    batch1 = full_axis = None
    if best:
        # What cross-request batching itself buys: the same engine and windows, one at a time;
        # and what the dynamic time axis buys: the best config padded to Whisper's 30 s.
        batch1 = rerun_best(args, work, model, {**best, "batch": 1}, "at batch 1",
                            "engine-batch1.json")
        full_axis = rerun_best(args, work, model, best, "on the full 30 s axis",
                               "engine-full-axis.json", "--time-axis", "full")
    return {"configs": configs, "best": best, "arrival": arrival, "sequential": sequential,
            "batch1": batch1, "full_axis": full_axis}


def limit_round(args: argparse.Namespace, work: Path, model: str, best: dict[str, Any],
                k: int) -> dict[str, Any]:
    """The sweep's best engine configuration, measured again before service round ``k``."""
    return rerun_best(args, work, model, best, f"before round {k + 1}", f"engine-round{k + 1}.json")


