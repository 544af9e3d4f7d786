"""One long upload alone on CPU (a meeting recording posted by itself): this tree against
``--base`` and against faster-whisper's ``BatchedInferencePipeline``, in one run.

    python -m loadtest.long_alone --base 47bba3e --job-memory 300,600

A 20-minute WAV of corpus speech (``--minutes``; its clips' references joined are its
reference), then, ``--repeats`` times in turn so the host's drift falls on every set-up alike:

* **engine**: the service's engine alone on the upload's windows in time order, calls of
  ``--batches`` windows on 2 workers x 1 thread, each batch size in a process of its own (so its
  peak RSS is its own): throughput and peak RSS above the loaded model (``loadtest.offline``);
* **service**: a fresh ``python -m app`` per set-up (``--base`` at its defaults; this tree at
  each ``--job-memory``), four short clips, 31 s of quiet (past the scheduler's "short work is
  recent" window), then the upload with ``wait=true``: throughput from its POST, the decoder
  batches' mean size (``/metrics``), the service's peak RSS above its idle peak, WER;
* **peer**: ``BatchedInferencePipeline`` (its own VAD, language given, beam 1 as the service)
  at each ``--peer-batches``, 2 threads, one process per batch size: throughput, peak RSS above
  the loaded model, WER.

Written to ``--out`` (default ``loadtest/results/long-alone.json``) after every measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.client.scoring import wer_percent
from loadtest.feed import base_tree, tree_env
from loadtest.lib.common import ROOT, child_env, machine_info, proc_status_kb, resolve_model
from loadtest.lib.corpus import Clip, read_manifest, save_clips
from loadtest.lib.probes import histogram_delta, parse_metrics
from loadtest.lib.service import Server, write_long_wav

CORPUS = ROOT.parent / "shared" / "corpus"
QUIET_S = 31.0  # app/batching/urgency.py LIGHT_RECENT_S (30 s) and a second


def engine(tree: Path, clips_json: Path, model: str, batch: int, work: Path) -> dict[str, Any]:
    out = work / f"engine-{tree.name}-{batch}.json"
    subprocess.run([sys.executable, "-m", "loadtest.offline", "engine", "--clips", str(clips_json),
                    "--model", model, "--workers", "2", "--threads", "1", "--batches", str(batch),
                    "--language", "en", "--order", "corpus", "--cache", str(work / "cache"),
                    "--out", str(out)], cwd=tree, env=child_env(True, tree_env(tree)),
                   check=True, capture_output=True)
    got = json.loads(out.read_text())
    run = got["runs"][0]
    return {"batch": batch, "throughput_x": run["throughput_x"],
            "rss_above_model_mb": round(run["peak_rss_mb"] - got["rss_model_loaded_mb"], 1)}


def service(tree: Path, env: dict[str, str], upload: Path, audio_s: float, reference: str,
            short: list[Clip], work: Path) -> dict[str, Any]:
    srv = Server(work / f"server-{time.monotonic_ns()}", cwd=tree,
                 env={**env, "PYTHONPATH": str(tree)}).start()
    assert srv.proc is not None
    try:
        with httpx.Client(base_url=srv.url, timeout=3600) as c:
            for clip in short:
                with clip.path.open("rb") as f:
                    c.post("/transcribe", params={"wait": "true"}, files={"file": (clip.path.name, f)})
            idle = (proc_status_kb(srv.proc.pid, "VmHWM") or 0) / 1024
            time.sleep(QUIET_S)  # (a bench's pause, not a poll)
            before = parse_metrics(c.get("/metrics").text)
            t0 = time.monotonic()
            r = c.post("/transcribe", params={"wait": "true", "language": "en"},
                       files={"file": (upload.name, upload.read_bytes())})
            wall = time.monotonic() - t0
            peak = (proc_status_kb(srv.proc.pid, "VmHWM") or 0) / 1024
            after = parse_metrics(c.get("/metrics").text)
        job = r.json()
        text = str((job.get("result") or {}).get("text") or "")
        batches = histogram_delta(before, after, "batchscribe_batch_size_windows")
        return {"status": job.get("status"), "wall_s": round(wall, 2),
                "throughput_x": round(audio_s / wall, 2), "mean_batch": batches.get("mean"),
                "rss_growth_mb": round(peak - idle, 1), "idle_peak_rss_mb": round(idle, 1),
                "wer_percent": wer_percent([reference], [text])}
    finally:
        srv.stop()


def peer(upload: Path, model: str, batch: int, reference: str) -> dict[str, Any]:
    code = f"""
import json, resource, time
from faster_whisper import BatchedInferencePipeline, WhisperModel
m = WhisperModel({model!r}, device="cpu", compute_type="int8", cpu_threads=2)
p = BatchedInferencePipeline(m)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
segs, info = p.transcribe({str(upload)!r}, batch_size={batch}, beam_size=1, language="en")
text = " ".join(s.text.strip() for s in segs)
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"wall_s": wall, "audio_s": info.duration, "rss": peak - base, "text": text}}))
"""
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=child_env(True), check=True,
                                    capture_output=True, text=True).stdout.splitlines()[-1])
    return {"batch": batch, "throughput_x": round(got["audio_s"] / got["wall_s"], 2),
            "rss_above_model_mb": round(got["rss"], 1),
            "wer_percent": wer_percent([reference], [got["text"]])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.long_alone", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit before the change")
    p.add_argument("--job-memory", default="300,600", help="this tree's batcher.job_memory_mb")
    p.add_argument("--batches", default="1,2,4", help="engine calls of this many windows")
    p.add_argument("--peer-batches", default="8,16")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "long-alone.json")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="long-alone-"))
    work.mkdir(parents=True, exist_ok=True)
    clips = read_manifest(args.corpus)
    used: list[Clip] = []
    upload = work / f"long-{args.minutes:g}min.wav"
    audio_s = write_long_wav(clips, upload, args.minutes * 60, used=used)
    reference = " ".join(c.reference or "" for c in used)
    long_clip = Clip(id="long", path=upload, duration_s=audio_s, set="long", language="en",
                     reference=reference)
    clips_json = work / "long.json"
    save_clips([long_clip], clips_json)
    model = resolve_model("whisper-base")
    trees = {"base": base_tree(args.base, work), "this": ROOT}
    setups: list[tuple[str, str, dict[str, str]]] = [("base", "defaults", {})] + [
        ("this", f"job_memory_mb={m}", {"BATCHSCRIBE_BATCHER__JOB_MEMORY_MB": m})
        for m in args.job_memory.split(",")]
    report: dict[str, Any] = {"meta": {**machine_info(), "base": args.base, "args": vars(args)},
                              "upload": {"audio_s": round(audio_s, 1), "clips": len(used)},
                              "engine": [], "service": [], "peer": []}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    for rep in range(args.repeats):
        for name, tree in trees.items():
            for b in map(int, args.batches.split(",")):
                report["engine"].append({"tree": name, "repeat": rep,
                                         **engine(tree, clips_json, model, b, work)})
                print(report["engine"][-1], flush=True)
                save()
        for name, label, env in setups:
            report["service"].append({"tree": name, "setup": label, "repeat": rep,
                                      **service(trees[name], env, upload, audio_s, reference,
                                                clips[:4], work)})
            print(report["service"][-1], flush=True)
            save()
        for b in map(int, args.peer_batches.split(",")):
            report["peer"].append({"repeat": rep, **peer(upload, model, b, reference)})
            print(report["peer"][-1], flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
