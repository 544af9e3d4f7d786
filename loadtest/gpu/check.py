"""``scripts/gpu-check``: the service on a device, measured in one run of a few minutes.

    scripts/gpu-check                                  # cuda:0, whisper-base
    scripts/gpu-check --model large-v3                 # a provisioned name, or a model folder
    scripts/gpu-check --device cpu --tiny              # the same steps on CPU, small numbers
    scripts/gpu-check --only saturate,engine_limit_saturate,peer   # some steps

The results file (``loadtest/results/gpu-<device>.json`` or ``--out``) is rewritten after every
step, so a run cut short still holds what it measured. It records the host (GPU, driver, CUDA
of torch, the cuBLAS file the service actually mapped, CTranslate2 and torch versions) and, in
this order (``--only`` / ``--skip`` choose):

1. the service (``python -m app``, its own warm-up and sizing, quoted from ``/readyz``), driven
   over HTTP with the corpus (every clip posted at once, ``--concurrency`` in flight):
   ``corpus_detected`` (no language, as clients send), ``corpus_en``;
2. ``forced_oom`` (GPU): a side process takes all but ``--oom-keep-gb`` of the free memory,
   the long upload and the corpus run into real out-of-memory errors, the side process lets
   go, and a second round lets the cap grow back;
3. ``long_alone``: one long upload (``--long-min`` minutes, 60 on GPU) on an idle service;
   ``long_beside_short``: that upload and the corpus at once;
4. ``saturate``: ``--saturate`` copies of a ``--saturate-min`` upload (16 x 20 minutes on GPU)
   at once, each its own job: py-spy samples the service's threads meanwhile, where installed;
5. ``live_<N>`` for each of ``--live`` (64, 256 on GPU): N OpenAI Realtime sessions at once,
   corpus speech at real-time pace for ``--live-s`` seconds each: turn latency p50/p95/max,
   utterances never finalised or never heard (``every_turn_completed``);
6. with the service stopped, each in a child process: ``bare_encode`` (CTranslate2's encoder
   alone at 30 s and 10 s, and with flash attention on GPU); ``engine_limit`` (the service's
   engine on the corpus's windows), ``engine_limit_saturate`` and ``engine_limit_long`` (on
   the saturate step's windows, as many copies as it posted, and on the long upload's: the
   engine-alone rates those steps are held to; each step then gets ``vs_engine_alone``);
   ``peer``: faster-whisper's BatchedInferencePipeline on the saturate step's files, one after
   another, batch 16 and its best batch, WER and throughput (loadtest/gpu/peer.py);
   ``time_axes``: the corpus's WER on the 30 s and the dynamic axis on this device
   (loadtest/dynamic_axis.py).

Per traffic step: failures, WER (read speech and the rest; ``wer_long_percent`` for the long
uploads, whose references are their clips'), throughput (audio s / wall s), latency (p50, p95,
max, from the moment each request was posted), batch sizes (``mean_batch``), GPU utilisation
(NVML every 0.2 s: ``gpu_busy_percent`` of the samples) and peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.client.scoring import normaliser_name
from loadtest.gpu.steps import (
    bare_encode,
    corpus,
    engine_alone,
    live_sessions,
    long_and,
    many_long,
    measured,
    peer,
    time_axes,
    write_upload,
)
from loadtest.gpu.watch import VramHog
from loadtest.lib.common import ROOT, machine_info
from loadtest.lib.corpus import DEFAULT_CORPUS, Clip, load_corpus, select_clips
from loadtest.lib.service import Server

STEPS = ("corpus_detected", "corpus_en", "forced_oom", "long_alone", "long_beside_short",
         "saturate", "live", "bare_encode", "engine_limit", "engine_limit_saturate",
         "engine_limit_long", "peer", "time_axes")


class Report:
    """The results file, rewritten after every step (and copied to ``mirror``). ``resume``:
    an earlier call's file is kept and this call's steps are added to it (a lent GPU runs
    at most 10 minutes a command: the run goes on over two calls on the same warm machine)."""

    def __init__(self, path: Path, head: dict[str, Any], steps: set[str],
                 mirror: Path | None = None, resume: bool = False) -> None:
        earlier = json.loads(path.read_text()) if resume and path.is_file() else {}
        self.path, self.mirror, self.t0 = path, mirror, time.monotonic()
        self.data = {**earlier, **head}
        if earlier:
            self.data["earlier_calls"] = [*earlier.get("earlier_calls", []),
                                          {k: earlier.get(k) for k in ("command", "minutes")}]
        self.steps = steps
        self.save()

    def wanted(self, name: str) -> bool:
        return name in self.steps or (name.startswith("live_") and "live" in self.steps)

    def save(self) -> None:
        self.data["minutes"] = round((time.monotonic() - self.t0) / 60, 2)
        text = json.dumps(self.data, indent=1, default=str) + "\n"
        for path in (self.path, self.mirror):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        if not self.wanted(name):
            return None
        print(f"gpu-check: {name} ...", flush=True)
        t = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # recorded, and the run goes on to the next step
            value = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        if isinstance(value, dict):
            value["step_s"] = round(time.monotonic() - t, 1)
        self.data[name] = value
        self.save()
        print(f"gpu-check: {name}: {brief(value)}", flush=True)
        return value


def brief(v: Any) -> str:
    if not isinstance(v, dict):
        return str(v)[:300]
    keys = ("error", "throughput_x", "failed", "wer_read_percent", "wer_long_percent",
            "mean_batch", "gpu_busy_percent", "vs_engine_alone", "best_throughput_x",
            "oom_events", "cap_min", "cap_max", "healthz", "turn_latency",
            "every_turn_completed", "best_batch", "wer_all_percent")
    return json.dumps({k: v[k] for k in keys if k in v}, default=str)[:600]


def host_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"machine": machine_info()}
    if device == "cuda":
        def sh(cmd: str) -> str:
            got = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30)
            return got.stdout.strip()
        info["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                         "power.limit --format=csv,noheader")
        info["cuda_driver"] = sh("nvidia-smi | grep -o 'CUDA Version: [0-9.]*'")
        try:
            import torch

            info["torch_cuda"] = torch.version.cuda
        except ImportError:
            info["torch_cuda"] = None
        info["ld_library_path"] = os.environ.get("LD_LIBRARY_PATH")
    return info


def mapped_libraries(pid: int) -> list[str]:
    """The CUDA libraries a process has mapped (which cuBLAS CTranslate2's dlopen found)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    names = {line.split()[-1] for line in maps.splitlines() if "/lib" in line}
    return sorted(n for n in names if any(k in n for k in ("cublas", "cudart", "ctranslate2")))


def profiled(srv: Server, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the service's threads (collapsed stacks, GIL holders marked), if there."""
    import shutil

    spy = shutil.which("py-spy") or next((str(p) for p in (
        Path(sys.executable).parent / "py-spy", *[Path(x) / "bin" / "py-spy" for x in sys.path])
        if p.is_file()), None)
    if spy is None or srv.proc is None:
        return None
    return subprocess.Popen([spy, "record", "--pid", str(srv.proc.pid), "--duration",
                             str(int(seconds)), "--rate", "50", "--format", "raw", "--threads",
                             "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def forced_oom(srv: Server, clips: list[Clip], long: Clip, args: argparse.Namespace) -> dict[str, Any]:
    """A real OOM: another process holds the memory, then lets go; the service must recover."""
    hog = VramHog(int(args.oom_keep_gb * 2**30)).start()
    out: dict[str, Any] = {"keep_gb": args.oom_keep_gb, "held_gb": round(hog.held / 2**30, 1),
                           "free_while_held_gb": round(hog.free_after / 2**30, 2)}
    try:
        out["while_held"] = asyncio.run(measured(srv, clips, None,
                                                 long_and(long, clips, args.concurrency)))
    finally:
        hog.release()
    out["after_release"] = asyncio.run(measured(srv, clips, None,
                                                long_and(long, clips, args.concurrency)))
    health = httpx.get(srv.url + "/healthz", timeout=10)
    held, after = out["while_held"], out["after_release"]
    out.update({"oom_events": held["oom_events"] + after["oom_events"],
                "failed": held["failed"] + after["failed"], "healthz": health.status_code,
                "cap_min": min(x for x in (held["cap_min"], after["cap_min"]) if x is not None),
                "cap_max": after["cap_max"]})
    return out


# ---- the run -----------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="whisper-base",
                    help="a provisioned model name or a CTranslate2 Whisper folder")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--clips", type=int, default=None, help="a subset of the corpus (all: 83)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    ap.add_argument("--long-min", type=float, default=None,
                    help="the long upload's minutes (default: 60 on GPU, 5 on CPU)")
    ap.add_argument("--oom-keep-gb", type=float, default=0.15,
                    help="GPU memory left free by the side process in forced_oom (whisper-base: "
                         "~35-45 MB per 30 s window in a batch)")
    ap.add_argument("--saturate", type=int, default=None,
                    help="copies of an upload at once in the saturate step (default: 16 on "
                         "GPU, 2 on CPU)")
    ap.add_argument("--saturate-min", type=float, default=None,
                    help="that upload's minutes (default: 20 on GPU, 2 on CPU; the service "
                         "queues at most max_backlog_s of audio, 6 h by default)")
    ap.add_argument("--live", default=None,
                    help="concurrent Realtime sessions per live step (default: 64,256 on GPU, "
                         "4 on CPU)")
    ap.add_argument("--live-s", type=float, default=None,
                    help="seconds of speech per live session (default: 30 on GPU, 15 on CPU)")
    ap.add_argument("--time-axis", choices=("auto", "dynamic", "full"), default="auto",
                    help="BATCHSCRIBE_MODEL__TIME_AXIS of the service and the engine limits")
    ap.add_argument("--bare-batches", default=None)
    ap.add_argument("--engine-batches", default=None,
                    help="the engine limits' batch sizes (default: 8,32,128 on GPU, 8 on CPU)")
    ap.add_argument("--peer-sweep", default=None,
                    help="the peer's batch sizes tried (default: 8,16,32,64 on GPU, 4,8 on CPU)")
    ap.add_argument("--tiny", action="store_true",
                    help="small numbers (8 clips, 1-minute uploads, 2 copies, 2 live sessions "
                         "of 8 s): every step end to end in a few minutes, e.g. on CPU")
    ap.add_argument("--only", default=None, help=f"comma-separated steps, of {', '.join(STEPS)}")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-gpu-check"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mirror", type=Path, default=None, help="a copy of the results file")
    ap.add_argument("--resume", action="store_true",
                    help="add this call's steps to an existing --out file")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    tiny = args.tiny
    args.clips = args.clips or (8 if tiny else None)
    args.long_min = args.long_min or (1.0 if tiny else 60.0 if gpu else 5.0)
    args.saturate = args.saturate or (2 if tiny or not gpu else 16)
    args.saturate_min = args.saturate_min or (1.0 if tiny else 20.0 if gpu else 2.0)
    args.live = [int(x) for x in (args.live or ("2" if tiny else "64,256" if gpu else "4"))
                 .split(",")]
    args.live_s = args.live_s or (8.0 if tiny else 30.0 if gpu else 15.0)
    args.peer_sweep = args.peer_sweep or ("8,16,32,64" if gpu else "4,8")
    if tiny and not args.bare_batches:
        args.bare_batches = "1,2"
    steps = set(args.only.split(",") if args.only else STEPS) - set(args.skip.split(","))
    if unknown := steps - set(STEPS):
        ap.error(f"unknown steps {sorted(unknown)}")
    args.steps = steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from app.config import ModelSettings
    from app.engine.whisper import time_axis
    from loadtest.lib.common import resolve_model

    args.model_dir = resolve_model(args.model)
    args.time_axis = time_axis(ModelSettings(time_axis=args.time_axis), args.device)
    out_path = args.out or ROOT / "loadtest" / "results" / f"gpu-{args.device}.json"
    clips = select_clips(load_corpus(args.corpus), args.clips)
    report = Report(out_path, {
        "command": "scripts/gpu-check " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device, "model": args.model, "time_axis": args.time_axis,
        "host": host_info(args.device), "clips": len(clips),
        "audio_s": round(sum(c.duration_s for c in clips), 1), "steps": sorted(args.steps),
        "concurrency": args.concurrency, "normaliser": normaliser_name()}, args.steps,
        args.mirror, args.resume)
    args.work.mkdir(parents=True, exist_ok=True)
    long = write_upload(clips, args.work / "long.wav", args.long_min)
    part = write_upload(clips, args.work / "part.wav", args.saturate_min, name="part")
    with_service = {"corpus_detected", "corpus_en", "forced_oom", "long_alone",
                    "long_beside_short", "saturate", "live"}
    if args.steps & with_service:
        serve(args, report, clips, long, part, out_path)
    compute_type = report.data.get("service", {}).get("readyz", {}).get("compute_type") or (
        "float16" if args.device == "cuda" else "int8")
    report.step("bare_encode", lambda: bare_encode(args, compute_type))
    report.step("engine_limit", lambda: engine_alone(args, clips, compute_type, "engine_limit"))
    for name, step, upload, copies in (
            ("engine_limit_saturate", "saturate", part, args.saturate),
            ("engine_limit_long", "long_alone", long, 1)):
        def limit(u: Clip = upload, n: int = copies, m: str = name) -> dict[str, Any]:
            return engine_alone(args, [u], compute_type, m, repeat=n)

        if report.step(name, limit) is not None:
            held_to(report, step, name)
    report.step("peer", lambda: peer(args, part, args.saturate, compute_type))
    if isinstance(report.data.get("peer"), dict) and isinstance(report.data.get("saturate"), dict):
        report.data["peer"]["service_saturate"] = {
            k: report.data["saturate"].get(k) for k in ("throughput_x", "wer_long_percent")}
        report.save()
    report.step("time_axes", lambda: time_axes(args, compute_type))
    print(f"gpu-check: wrote {out_path} ({report.data['minutes']} min)")
    return 0


def held_to(report: Report, step: str, limit: str) -> None:
    """``vs_engine_alone``: the step's throughput over the engine's best on its windows."""
    got, best = report.data.get(step), report.data.get(limit, {}).get("best_throughput_x")
    if isinstance(got, dict) and got.get("throughput_x") and best:
        got["vs_engine_alone"] = round(got["throughput_x"] / best, 3)
        report.save()


def serve(args: argparse.Namespace, report: Report, clips: list[Clip], long: Clip, part: Clip,
          out_path: Path) -> None:
    """The steps against the running service."""
    most = max(args.live)
    env = {"BATCHSCRIBE_MODEL__DEVICE": args.device, "BATCHSCRIBE_MODEL__NAME": args.model,
           "BATCHSCRIBE_MODEL__TIME_AXIS": args.time_axis,
           "BATCHSCRIBE_STORAGE__DATA_DIR": str(args.work / "service"),
           # every session is one tenant here (no keys): the live caps must admit them all
           "BATCHSCRIBE_LIVE__MAX_SESSIONS": str(max(32, most)),
           "BATCHSCRIBE_LIVE__MAX_SESSIONS_PER_KEY": str(max(16, most))}
    t0 = time.monotonic()
    srv = Server(args.work / "service", env=env).start(timeout=args.start_timeout)
    try:
        report.data["service"] = {
            "start_s": round(time.monotonic() - t0, 1),
            "readyz": httpx.get(srv.url + "/readyz", timeout=10).json(),
            "mapped": mapped_libraries(srv.proc.pid) if srv.proc else []}
        report.save()
        run = asyncio.run
        report.step("corpus_detected", lambda: run(measured(srv, clips, None,
                                                            corpus(clips, args.concurrency))))
        report.step("corpus_en", lambda: run(measured(srv, clips, "en",
                                                      corpus(clips, args.concurrency))))
        if args.device == "cuda":
            report.step("forced_oom", lambda: forced_oom(srv, clips, long, args))
        elif "forced_oom" in args.steps:
            report.data["forced_oom"] = {"skipped": "no device memory to take on CPU; the OOM "
                                         "backoff is tested there by fault injection "
                                         "(tests/test_gpu_service.py)"}
        report.step("long_alone", lambda: run(measured(srv, clips, None,
                                                       long_and(long, [], args.concurrency))))
        report.step("long_beside_short", lambda: run(measured(
            srv, clips, None, long_and(long, clips, args.concurrency))))
        spy = (profiled(srv, out_path.with_name(out_path.stem + "-profile.txt"), 15)
               if "saturate" in args.steps else None)
        report.step("saturate", lambda: run(measured(srv, clips, None,
                                                     many_long(part, args.saturate))))
        if spy is not None:
            spy.wait(60)
        for n in args.live:
            def live(n: int = n) -> dict[str, Any]:
                return run(live_sessions(srv, clips, n, args.live_s))

            report.step(f"live_{n}", live)
    finally:
        srv.stop()
        report.data["server_log_tail"] = srv.log_tail(3000)
        report.save()


if __name__ == "__main__":
    raise SystemExit(main())
