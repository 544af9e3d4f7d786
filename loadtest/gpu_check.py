"""``scripts/gpu-check``: the service on a device, measured in one run of a few minutes.

    scripts/gpu-check                                  # cuda:0, whisper-base
    scripts/gpu-check --model large-v3                 # a provisioned name, or a model folder
    scripts/gpu-check --device cpu                     # the same run on CPU

The results file (``loadtest/results/gpu-<device>.json`` or ``--out``) is rewritten after every
step, so a run cut short still holds what it measured. It records the host (GPU, driver, CUDA
of torch, the cuBLAS file the service actually mapped, CTranslate2 and torch versions) and:

1. the service (``python -m app``, its own warm-up and sizing, quoted from ``/readyz``), driven
   over HTTP with the corpus (``--corpus``, every clip posted at once, ``--concurrency`` in
   flight): ``corpus_detected`` (no language, as clients send), ``corpus_en``;
2. ``forced_oom`` (GPU): a side process takes all but ``--oom-keep-gb`` of the free memory,
   the long upload and the corpus run into real out-of-memory errors, the side process lets
   go, and a second round lets the cap grow back: OOM events, the cap's path, failed jobs,
   ``/healthz``;
3. ``long_alone``: one long upload (the corpus concatenated, ``--long-min`` minutes) on an idle
   service: the batch sizes one job reaches against the sized cap;
4. ``long_beside_short``: that upload and the corpus at once (latency of both, batch sizes);
   ``saturate``: ``--saturate`` copies of it at once, each its own job: the service's rate
   when the engine, not one upload's chunk-by-chunk prep, is the limit;
5. ``bare_encode``, last, with the service stopped: CTranslate2's encoder alone (a child
   process) at Whisper's 30 s and at 10 s, at several batch sizes (and, on GPU, with its flash
   attention): the device's own rate and its allocator's peak; ``engine_limit``: the service's
   engine on the corpus's own windows with no HTTP, prep or batcher (``loadtest.offline``).

Per step: failures, WER (read speech and the rest), throughput (audio s / wall s), latency
(p50, p95, max, from the moment each request was posted), mean batch size and distribution, GPU
utilisation and peak memory (NVML sampled every 0.2 s; the CUDA pool, CTranslate2's
allocator, from the service's metrics; on CPU the server's peak RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.common import DEFAULT_CORPUS, ROOT, Clip, load_corpus, machine_info, select_clips
from loadtest.gpu_watch import MetricsSampler, NvmlSampler, VramHog
from loadtest.probes import counter_delta, histogram_delta
from loadtest.scoring import latency_summary, normaliser_name, wer_by_group
from loadtest.service import Client, Result, Server, all_at_once, write_long_wav


class Report:
    def __init__(self, path: Path, head: dict[str, Any]) -> None:
        self.path, self.data, self.t0 = path, head, time.monotonic()
        self.save()

    def save(self) -> None:
        self.data["minutes"] = round((time.monotonic() - self.t0) / 60, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
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
    keys = ("error", "throughput_x", "failed", "wer_read_percent", "batch_size", "oom_events",
            "gpu", "cap_min", "cap_max", "healthz")
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


# ---- one step's traffic ----------------------------------------------------------------------
async def measured(srv: Server, clips: list[Clip], language: str | None,
                   traffic: Callable[[Client], Awaitable[list[Result]]]) -> dict[str, Any]:
    client = Client(srv.url, clips, language)
    try:
        before = await client.metrics()
        t0 = time.monotonic()
        with NvmlSampler() as nvml:
            async with MetricsSampler(client) as gauges:
                results = await traffic(client)
        wall = time.monotonic() - t0
        after = await client.metrics()
    finally:
        await client.close()
    ok = [r for r in results if r.ok]
    short = [r for r in ok if r.clip.set != "long"]
    audio = sum(r.clip.duration_s for r in ok)
    wer = (wer_by_group([r.clip for r in short], {r.clip.id: r.text or "" for r in short})
           if short else {})
    return {
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error or "" for r in results if not r.ok})[:5],
        "wall_s": round(wall, 2), "audio_s": round(audio, 1),
        "throughput_x": round(audio / wall, 1) if wall else None,
        "wer_read_percent": wer.get("read_speech", {}).get("wer_percent"), "wer": wer,
        "latency_short": latency_summary([r.latency for r in short]),
        "latency_long": [round(r.latency, 2) for r in ok if r.clip.set == "long"],
        "batch_size": histogram_delta(before, after, "batchscribe_batch_size_windows"),
        "oom_events": counter_delta(before, after, "batchscribe_oom_events_total"),
        "cap_after": after.get(("batchscribe_batch_cap_windows", "")),
        **gauges.summary(), "gpu": nvml.summary(), "server_peak_rss_mb": srv.peak_rss_mb(),
    }


def corpus(clips: list[Clip], concurrency: int) -> Callable[[Client], Awaitable[list[Result]]]:
    return lambda client: all_at_once(client, clips, concurrency)


def long_and(long: Clip, clips: list[Clip],
             concurrency: int) -> Callable[[Client], Awaitable[list[Result]]]:
    async def run(client: Client) -> list[Result]:
        client.blobs[long.id] = Path(long.path).read_bytes()
        first = asyncio.create_task(client.transcribe(long))
        await asyncio.sleep(1.0)  # the long upload's windows are queued first
        rest = await all_at_once(client, clips, concurrency) if clips else []
        return [await first, *rest]
    return run


def many_long(long: Clip, n: int) -> Callable[[Client], Awaitable[list[Result]]]:
    """``n`` copies of a long upload at once: prep runs on as many threads, so the engine,
    not one job's chunk-by-chunk prep, should be what limits (each copy is its own job). A
    429 (the backlog limit) is retried after its ``retry_after_s``, as a client would."""
    async def one(client: Client, clip: Clip) -> Result:
        while True:
            r = await client.transcribe(clip)
            if r.status != 429:
                return r
            try:
                wait = float(json.loads(r.error or "{}")["error"]["retry_after_s"])
            except (ValueError, KeyError, TypeError):
                wait = 1.0
            await asyncio.sleep(wait)

    async def run(client: Client) -> list[Result]:
        blob = Path(long.path).read_bytes()
        copies = [Clip(f"long-{k}", long.path, long.duration_s, "", "long") for k in range(n)]
        for c in copies:
            client.blobs[c.id] = blob
        return list(await asyncio.gather(*(one(client, c) for c in copies)))
    return run


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


def engine_limit(args: argparse.Namespace, clips: list[Clip], compute_type: str) -> dict[str, Any]:
    """The engine alone on the service's own windows (``loadtest.offline engine``): no HTTP,
    prep or batcher, so the gap to the service's rate is the rest of the pipeline."""
    from loadtest.common import save_clips

    path = args.work / "clips.json"
    save_clips(clips, path)
    out = args.work / "engine.json"
    cmd = [sys.executable, "-m", "loadtest.offline", "engine", "--clips", str(path), "--model",
           args.model_dir, "--device", args.device, "--compute-type", compute_type, "--language",
           "en", "--batches", "8,32,128" if args.device == "cuda" else "8", "--min-seconds",
           "3", "--time-axis", "full" if args.device == "cuda" else "dynamic", "--out", str(out)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if not out.exists():
        return {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"}
    return dict(json.loads(out.read_text()))


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
def bare_encode(args: argparse.Namespace, compute_type: str) -> dict[str, Any]:
    """The encoder alone; on GPU once more with CTranslate2's flash attention (64 windows)."""
    gpu = args.device == "cuda"
    batches = args.bare_batches or ("1,16,64,128" if gpu else "1,4")
    runs: list[tuple[str, list[str]]] = [("default", ["--batches", batches])]
    if gpu:
        runs.append(("flash_attention", ["--batches", "64", "--flash-attention"]))
    out: dict[str, Any] = {}
    for name, extra in runs:
        cmd = [sys.executable, "-m", "loadtest.gpu_bare", "--model", args.model_dir, "--device",
               args.device, "--compute-type", compute_type, "--corpus", str(args.corpus),
               "--reps", "5" if gpu else "2", *extra]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        line = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
        out[name] = (json.loads(line[0][7:]) if line
                     else {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"})
    return out


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--bare-batches", default=None)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-gpu-check"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from loadtest.common import resolve_model

    args.model_dir = resolve_model(args.model)
    out_path = args.out or ROOT / "loadtest" / "results" / f"gpu-{args.device}.json"
    clips = select_clips(load_corpus(args.corpus), args.clips)
    report = Report(out_path, {
        "command": "scripts/gpu-check " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device, "model": args.model, "host": host_info(args.device),
        "clips": len(clips), "audio_s": round(sum(c.duration_s for c in clips), 1),
        "concurrency": args.concurrency, "normaliser": normaliser_name()})
    minutes = args.long_min or (60.0 if args.device == "cuda" else 5.0)
    long_path = args.work / "long.wav"
    args.work.mkdir(parents=True, exist_ok=True)
    long = Clip("long", str(long_path), write_long_wav(clips, long_path, minutes * 60), "", "long")
    env = {"BATCHSCRIBE_MODEL__DEVICE": args.device, "BATCHSCRIBE_MODEL__NAME": args.model,
           "BATCHSCRIBE_STORAGE__DATA_DIR": str(args.work / "service")}
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
        else:
            report.data["forced_oom"] = {"skipped": "no device memory to take on CPU; the OOM "
                                         "backoff is tested there by fault injection "
                                         "(tests/test_gpu_service.py)"}
        report.step("long_alone", lambda: run(measured(srv, clips, None,
                                                       long_and(long, [], args.concurrency))))
        report.step("long_beside_short", lambda: run(measured(
            srv, clips, None, long_and(long, clips, args.concurrency))))
        copies = args.saturate or (16 if args.device == "cuda" else 2)
        minutes = args.saturate_min or (20.0 if args.device == "cuda" else 2.0)
        part = Clip("part", str(args.work / "part.wav"),
                    write_long_wav(clips, args.work / "part.wav", minutes * 60), "", "long")
        spy = profiled(srv, out_path.with_name(out_path.stem + "-profile.txt"), 15)
        report.step("saturate", lambda: run(measured(srv, clips, None, many_long(part, copies))))
        if spy is not None:
            spy.wait(60)
    finally:
        srv.stop()
        report.data["server_log_tail"] = srv.log_tail(3000)
        report.save()
    # Last, on the device alone: the service's memory is back before the encoder is timed.
    compute_type = report.data.get("service", {}).get("readyz", {}).get("compute_type") or (
        "float16" if args.device == "cuda" else "int8")
    report.step("bare_encode", lambda: bare_encode(args, compute_type))
    report.step("engine_limit", lambda: engine_limit(args, clips, compute_type))
    print(f"gpu-check: wrote {out_path} ({report.data['minutes']} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
