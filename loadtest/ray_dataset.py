"""The Ray path (``batchscribe dataset --ray``) against the engine limit and today's dataset mode,
on the same manifest, in one run:

    . scripts/env.sh && .venv/bin/python -m loadtest.ray_dataset --minutes 60 \\
        --out loadtest/results/ray_dataset.json

Phases, never overlapping (tcmalloc preloaded in every process, as scripts/env.sh does):

1. the engine limit (``loadtest.offline engine``, the bench's best layout 2 workers x 1 thread,
   batch 16, subprocess: the corpus's windows straight into the engine; no decode, VAD, HTTP);
2. ``batchscribe dataset --ray``: the real CLI in a subprocess, which starts a local Ray on
   this machine's CPUs and one actor (app/dataset/plan.py) over the manifest (the corpus
   replayed in the bench's order to >= ``--minutes``, ``--language en``, as loadtest.dataset);
3. today's dataset mode on the same manifest: a fresh service and the CLI against it;
4. the engine limit again; the limit is the mean of 1 and 4.

``--order`` swaps 2 and 3. Throughput is audio seconds of whole files per wall second. For the
Ray path, *whole run* is the CLI's wall time (a local Ray's start and the actor's model load and
warm-up included: what a user waits for; also given from its first finished row on). *Steady
state*, for both paths, is the audio of the files finished between the 10 % and 90 % marks of
the run's audio over the time between them (a row's time: its part record's ``t``; dataset
mode's: its checkpoint's, as loadtest/dataset.py's ``steady_files_finished``, which also gives
the engine's progress between the marks for dataset mode). Both are also given over the limit (target: the
Ray path >= 0.9x of the limit in steady state, and no worse than dataset mode). The results
record the machine's load average before and after: on 2 shared cores any other load shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from loadtest.dataset import (
    PROCESSED,
    marks,
    metrics,
    run_client,
    steady_from_progress,
    steady_state,
    write_manifest,
)
from loadtest.lib.common import ROOT, layout_name, machine_info, resolve_model
from loadtest.lib.corpus import load_corpus, save_clips
from loadtest.lib.phases import offline_engine, parse_engine_configs
from loadtest.lib.report import log
from loadtest.lib.service import Server

GPU_RESULT = ROOT / "loadtest" / "results" / "gpu-h200.json"


def steady_rows(parts: Path, lo: float = 0.1, hi: float = 0.9) -> dict[str, Any]:
    """Audio of the rows finished between the ``lo`` and ``hi`` marks of the run's audio over
    the time between them; a row's time is when its transcript was done (its part record's
    ``t``), not when its block's part was written (a block ends with its slowest row)."""
    done = [(float(r["t"]), float(r["facts"].get("audio_s") or 0.0))
            for p in parts.glob("part-*.jsonl") for r in map(json.loads, p.read_text().splitlines())]
    return {**marks(sorted(done), lo, hi), "from": "files finished between the marks"}


def run_ray(manifest: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "app.cli", "dataset", str(manifest), "-o", str(out), "--overwrite",
           "--language", "en", "--log-every", "10", "--ray", *extra]
    log(f"ray: {shlex.join(cmd[2:])}")
    t0 = time.time()
    with (out.parent / "ray-client.log").open("wb") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    parts = out.with_name(out.name + ".parts")
    times = [float(r["t"]) for p in parts.glob("part-*.jsonl")
             for r in map(json.loads, p.read_text().splitlines())]
    audio = summary["audio_hours"] * 3600
    first = min(times) - t0 if times else None
    return {"exit_code": code, "wall_s": round(wall, 2), "done": summary["done"],
            "failed": summary["failed"], "plan": summary["ray"]["plan"],
            "ids_in_two_parts": summary["ray"]["ids_in_two_parts"],
            "throughput_x": round(audio / wall, 3), "steady": steady_rows(parts),
            # A local Ray's start and the actor's model load and warm-up come first:
            "first_row_after_s": round(first, 2) if first is not None else None,
            "throughput_after_first_row_x": round(audio / (wall - first), 3)
            if first is not None and wall > first else None,
            "scores": summary["scores"]}


def run_http(manifest: Path, work: Path, env: dict[str, str], tcmalloc: bool) -> dict[str, Any]:
    shutil.rmtree(work / "server", ignore_errors=True)
    server = Server(work / "server", env=env, tcmalloc=tcmalloc).start()
    try:
        out = work / "dataset.jsonl"
        cmd = [sys.executable, "-m", "app.cli", "dataset", str(manifest), "-o", str(out),
               "--overwrite", "--server", server.url, "--language", "en", "--log-every", "10"]
        log(f"dataset mode: {shlex.join(cmd[2:])}")
        before = metrics(server.url)
        code, t0, wall, samples = asyncio.run(run_client(cmd, server.url, work / "client.log"))
        after = metrics(server.url)
    finally:
        server.stop()
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    audio = summary["audio_hours"] * 3600
    return {"exit_code": code, "wall_s": round(wall, 2), "done": summary["done"],
            "failed": summary["failed"], "throughput_x": round(audio / wall, 3),
            # Like with like: files finished between the marks, as for the Ray path (and the
            # engine's progress between them, loadtest/dataset.py's steady state).
            "steady": steady_state(out.with_name(out.name + ".checkpoint")),
            "steady_engine_progress": steady_from_progress(
                samples, (t0, before.get(PROCESSED, 0.0)), (t0 + wall, after.get(PROCESSED, 0.0)),
                audio),
            "scores": summary["scores"]}


def on_paper(gpus: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    """What N GPUs give, one actor per GPU: N x the measured per-GPU figure (the H200 run's)."""
    if not GPU_RESULT.is_file():
        return {"note": f"no GPU result at {GPU_RESULT}"}
    g = json.loads(GPU_RESULT.read_text())
    limit = max(r["throughput_x"] for r in g["engine_limit"]["runs"])
    cores = g["host"]["machine"]["cores"]
    service = {k: g[k]["throughput_x"] for k in ("saturate", "long_alone", "long_beside_short")}
    per_gpu = g["saturate"]["throughput_x"]
    return {
        "source": f"{GPU_RESULT.relative_to(ROOT)} ({g['host']['gpu'].split(',')[0]}, {g['model']}, "
                  f"{cores} cores, git {g['host']['machine']['git']})",
        "engine_limit_x": limit, "service_x": service, "per_gpu_x": per_gpu,
        "assumption": f"each actor has its GPU and {cores} cores for prep (the measured host's), "
                      "its figure the service's saturated one (bounded by CPU prep, not the GPU); "
                      "actors share nothing but the driver's small rows, so N add up; with fewer "
                      "cores per GPU scale by cores (prep is the bound); never above N x the "
                      "engine limit. Not measured on several GPUs.",
        "n_gpus": {str(n): {"x_realtime": round(n * per_gpu), "bound_x": round(n * limit)}
                   for n in gpus},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.ray_dataset", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="audio in the manifest, at least")
    p.add_argument("--engine-config", default="2x1:16", help="[engines e] workers x threads : batch")
    p.add_argument("--engine-min-seconds", type=float, default=30.0)
    p.add_argument("--order", default="ray,http", help="ray,http or http,ray (or one of them)")
    p.add_argument("--ray-args", default="", help="extra batchscribe dataset --ray arguments")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/ray_dataset.json"))
    args = p.parse_args(argv)
    args.language = "en"  # what loadtest.lib.phases.offline_engine reads
    work = args.workdir or Path(tempfile.mkdtemp(prefix="batchscribe-ray-"))
    work.mkdir(parents=True, exist_ok=True)
    clips = load_corpus(args.corpus) if args.corpus else load_corpus()
    save_clips(clips, work / "clips.json")
    model = resolve_model(args.model)
    [(e, w, t, batches)] = parse_engine_configs(args.engine_config)
    rows, audio = write_manifest(clips, args.minutes, work / "manifest.jsonl")
    log(f"workdir {work}; manifest {rows} files, {audio / 60:.1f} min of audio")
    env = {"BATCHSCRIBE_MODEL__NAME": args.model}
    os.environ.update(env)  # the Ray actors read the same settings as the service
    machine = machine_info()
    machine["versions"]["ray"] = metadata.version("ray")
    res: dict[str, Any] = {"meta": {"command": "python -m loadtest.ray_dataset " + shlex.join(
        sys.argv[1:] if argv is None else argv), "machine": machine, "workdir": str(work)},
        "manifest": {"files": rows, "audio_s": round(audio, 1)}}
    limits = []

    def limit(when: str) -> None:
        log(f"engine limit {when}: {layout_name(e, w, t)}, batch {batches[0]} (subprocess)")
        lim = offline_engine(args, work, model, e, w, t, batches[:1], f"engine-{when}.json")
        limits.append(lim["runs"][0]["throughput_x"])
        log(f"  {limits[-1]}x realtime")

    limit("before")
    for phase in args.order.split(","):
        if phase == "ray":
            res["ray"] = run_ray(work / "manifest.jsonl", work / "ray.jsonl",
                                 shlex.split(args.ray_args))
        elif phase == "http":
            res["dataset_mode"] = run_http(work / "manifest.jsonl", work, env, not args.no_tcmalloc)
        log(f"  {res.get('ray' if phase == 'ray' else 'dataset_mode')}")
    limit("after")
    res["meta"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    mean = sum(limits) / len(limits)
    res["engine_limit"] = {"config": f"{layout_name(e, w, t)}, batch {batches[0]}",
                           "runs_x": limits, "mean_x": round(mean, 3)}
    ratios: dict[str, Any] = {}
    for name in ("ray", "dataset_mode"):
        if name in res:
            r = res[name]
            ratios[name] = {"whole_run": round(r["throughput_x"] / mean, 3),
                            "steady": round(r["steady"]["throughput_x"] / mean, 3)
                            if r["steady"].get("throughput_x") else None}
    if "ray" in res and "dataset_mode" in res:
        ray, http = res["ray"], res["dataset_mode"]
        steady = (ray["steady"].get("throughput_x"), http["steady"].get("throughput_x"))
        ratios["ray_over_dataset_mode"] = {
            "whole_run": round(ray["throughput_x"] / http["throughput_x"], 3),
            "steady": round(steady[0] / steady[1], 3) if all(steady) else None}
    res["ratios_to_engine_limit"] = ratios
    res["n_gpus_on_paper"] = on_paper()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    log(f"results: {args.out}: {json.dumps(ratios)}")
    ok = all(res[k]["exit_code"] == 0 for k in ("ray", "dataset_mode") if k in res)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
