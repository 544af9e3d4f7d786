"""Batch-size sweep of the engine on this machine: throughput and peak RSS per configuration.

    .venv/bin/python -m loadtest.sweep --out loadtest/results/sweep.json

For every allocator x (workers x threads) one subprocess loads the model once and runs the
service's own windows (decode + Silero VAD + cut, via app.audio) through
app.engine.whisper.WhisperEngine at each batch size in increasing order, ``workers`` batches in flight,
sampling its RSS (tcmalloc keeps freed memory, so the peak at batch B is B's own need as long as
sizes go up). It prints a table and recommends the service settings: the best throughput whose
peak RSS stays within ``--memory-budget-mb``, then the smallest batch cap within
``--tolerance`` of it (less memory and shorter batches, so lower latency, at the same speed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.lib.common import (
    child_env,
    cpu_count,
    layout_name,
    machine_info,
    parse_layout,
    resolve_model,
    run_json_subprocess,
    tcmalloc_path,
)
from loadtest.lib.corpus import load_corpus, save_clips, select_clips


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mem_total_mb() -> float:
    try:
        return int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return 8192.0


def _key(r: dict[str, Any]) -> tuple[str, int, int, int]:
    return r["allocator"], r["engines"], r["workers"], r["threads"]


def recommend(rows: list[dict[str, Any]], budget_mb: float, tolerance: float) -> dict[str, Any]:
    fits = [r for r in rows if r["peak_rss_mb"] <= budget_mb]
    if not fits:
        return {"error": f"no configuration fits in {budget_mb:.0f} MB"}
    best = max(fits, key=lambda r: r["throughput_x"])
    same = [r for r in fits if _key(r) == _key(best)
            and r["throughput_x"] >= (1 - tolerance) * best["throughput_x"]]
    pick = min(same, key=lambda r: r["batch"])
    # RSS grows about linearly with the windows in flight (engines x workers x batch): fit it,
    # so a memory budget can be turned into a batch cap.
    pts = [(r["engines"] * r["workers"] * r["batch"], r["peak_rss_mb"]) for r in rows
           if _key(r) == _key(best)]
    slope = base = None
    if len(pts) >= 2:
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        if var > 0:
            slope = sum((x - mx) * (y - my) for x, y in pts) / var
            base = my - slope * mx
    return {
        "best": best, "recommended": pick, "memory_budget_mb": round(budget_mb),
        "tolerance": tolerance,
        "rss_model_mb_per_window_in_flight": None if slope is None else round(slope, 1),
        "rss_model_base_mb": None if base is None else round(base, 1),
        "env": {
            "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": str(pick["batch"]),
            "BATCHSCRIBE_MODEL__ENGINES": str(pick["engines"]),
            "BATCHSCRIBE_MODEL__NUM_WORKERS": str(pick["workers"]),
            "BATCHSCRIBE_MODEL__CPU_THREADS": str(pick["threads"]),
        },
        "allocator": pick["allocator"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| allocator | layout | batch | x realtime | window x realtime | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['allocator']} | {layout_name(r['engines'], r['workers'], r['threads'])} "
                     f"| {r['batch']} | {r['throughput_x']:.1f} | {r['window_throughput_x']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="2x1,1x2,2e1x1",
                   help="[engines e] workers x threads, comma-separated, e.g. 2x1,1x2,2e1x1 "
                        "(more threads than cores is skipped unless --oversubscribe)")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--allocators", default="tcmalloc", help="tcmalloc,glibc")
    p.add_argument("--order", choices=("sorted", "corpus"), default="sorted",
                   help="sorted: batches of similar lengths, as the batcher's buckets make them")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat passes over the windows until this long per batch size")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="default: 75%% of this machine's memory")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="a smaller batch within this fraction of the best throughput is preferred")
    p.add_argument("--oversubscribe", action="store_true")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--language", default="en")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--clips", type=int, default=None, help="use a spread subset of N clips")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/sweep.json"))
    args = p.parse_args(argv)

    cores = cpu_count()
    work = Path(tempfile.mkdtemp(prefix="batchscribe-sweep-"))
    clips = select_clips(load_corpus(args.corpus) if args.corpus else load_corpus(), args.clips)
    save_clips(clips, work / "clips.json")
    model = resolve_model(args.model)
    rows: list[dict[str, Any]] = []
    started = time.time()
    for alloc in args.allocators.split(","):
        if alloc == "tcmalloc" and tcmalloc_path() is None:
            log("tcmalloc not installed; skipping it")
            continue
        for spec in args.configs.split(","):
            e, w, t = parse_layout(spec)
            if e * w * t > cores and not args.oversubscribe:
                log(f"skip {spec}: more threads than the {cores} cores")
                continue
            log(f"{alloc}: {layout_name(e, w, t)}, batches {args.batches}")
            res = run_json_subprocess(
                ["loadtest.offline", "engine", "--clips", str(work / "clips.json"),
                 "--model", model, "--language", args.language, "--engines", str(e),
                 "--workers", str(w),
                 "--threads", str(t), "--batches", args.batches, "--order", args.order,
                 "--min-seconds", str(args.min_seconds), "--cache", str(work)],
                child_env(alloc == "tcmalloc"), work / f"{alloc}-{e}e{w}x{t}.json",
                work / "sweep.log", timeout=7200)
            for r in res["runs"]:
                row = {"allocator": res["allocator"], "engines": e, "workers": w, "threads": t,
                       "rss_model_loaded_mb": res["rss_model_loaded_mb"], **r}
                rows.append(row)
                log(f"  b{r['batch']}: {r['throughput_x']:.1f}x realtime, "
                    f"peak RSS {r['peak_rss_mb']:.0f} MB")
    budget = args.memory_budget_mb or 0.75 * mem_total_mb()
    rec: dict[str, Any] = (recommend(rows, budget, args.tolerance) if rows
                           else {"error": "nothing measured"})
    out = {"machine": machine_info(), "command": "python -m loadtest.sweep " + " ".join(
        sys.argv[1:] if argv is None else argv), "clips": len(clips),
        "audio_s": round(sum(c.duration_s for c in clips), 3), "order": args.order,
        "runtime_s": round(time.time() - started, 1), "rows": rows, "recommendation": rec}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(table(rows))
    print()
    if "error" in rec:
        print(f"no recommendation: {rec['error']}")
    else:
        b, r = rec["best"], rec["recommended"]
        print(f"best: {b['allocator']} {layout_name(b['engines'], b['workers'], b['threads'])}, "
              f"batch {b['batch']}: "
              f"{b['throughput_x']:.1f}x realtime, {b['peak_rss_mb']:.0f} MB")
        print(f"recommended (smallest batch within {args.tolerance:.0%} of best, "
              f"peak RSS <= {budget:.0f} MB): {layout_name(r['engines'], r['workers'], r['threads'])}"
              f", batch {r['batch']}: "
              f"{r['throughput_x']:.1f}x realtime, {r['peak_rss_mb']:.0f} MB")
        if rec["rss_model_mb_per_window_in_flight"] is not None:
            print(f"RSS ~ {rec['rss_model_base_mb']:.0f} MB + "
                  f"{rec['rss_model_mb_per_window_in_flight']:.0f} MB per window in flight")
        print("service settings: " + " ".join(f"{k}={v}" for k, v in rec["env"].items())
              + ("" if rec["allocator"] == "tcmalloc" else "  (and preload tcmalloc)"))
    shutil.rmtree(work, ignore_errors=True)
    log(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
