"""Models side by side on this host: WER and engine throughput on the corpus, in one run.

    . scripts/env.sh && .venv/bin/python -m loadtest.model_choice \\
        --models whisper-base,whisper-small --min-seconds 60 \\
        --out loadtest/results/model-choice-cpu.json

Each model (a provisioned name, ``BATCHSCRIBE_MODEL__NAME``'s meaning) runs as the bench's
engine limit does (``loadtest.offline engine``: the service's own windows, decode + Silero VAD +
cut, fed straight to ``WhisperEngine`` at its CPU layout: one engine of two 1-thread workers,
batch 8, the dynamic axis, language en), each in its own subprocess with tcmalloc, one after the
other, so the throughputs are comparable within the run; WER over the clips' joined windows.
A model that cannot be resolved (not provisioned, or, as whisper-small from PyPI, an incomplete
release: models/registry.py) is recorded with the reason and the run goes on. The results file
is rewritten after each model and records the commit and whether the tree was clean. On a
loaded host the throughputs are no claim; the WER is deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.client.scoring import normaliser_name
from loadtest.lib.common import child_env, machine_info, resolve_model, run_json_subprocess
from loadtest.lib.corpus import DEFAULT_CORPUS, load_corpus, save_clips, select_clips
from loadtest.lib.stats import wer_by_group


def one_model(name: str, clips_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from models.registry import ModelUnavailable

    try:
        folder = resolve_model(name)
    except ModelUnavailable as exc:
        return {"error": str(exc)}
    out = args.work / f"engine-{name}.json"
    result = run_json_subprocess(
        ["loadtest.offline", "engine", "--clips", str(clips_path), "--model", folder,
         "--workers", str(args.workers), "--threads", str(args.threads), "--batches",
         str(args.batch), "--language", args.language, "--min-seconds", str(args.min_seconds),
         "--cache", str(args.work / "windows"), "--texts"],
        child_env(), out, args.work / "log.txt", timeout=args.timeout)
    run = result["runs"][0]
    texts = run.pop("texts")
    manifest = Path(folder) / "manifest.json"
    facts = json.loads(manifest.read_text()).get("model", {}) if manifest.is_file() else {}
    return {"folder": folder, "model": facts, **run,
            "rss_model_loaded_mb": result.get("rss_model_loaded_mb"),
            "wer": wer_by_group(args.clips, texts), "texts": texts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.model_choice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="whisper-base,whisper-small")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--clips", type=int, default=None, help="a subset (all: 83)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--language", default="en")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat passes over the windows until this long (per model)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-model-choice"))
    p.add_argument("--out", type=Path, default=Path("loadtest/results/model-choice-cpu.json"))
    args = p.parse_args(argv)
    args.clips = select_clips(load_corpus(args.corpus), args.clips)
    args.work.mkdir(parents=True, exist_ok=True)
    clips_path = args.work / "clips.json"
    save_clips(args.clips, clips_path)
    report: dict[str, Any] = {
        "command": "python -m loadtest.model_choice " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv),
        "machine": machine_info(), "clips": len(args.clips),
        "audio_s": round(sum(c.duration_s for c in args.clips), 1), "normaliser":
        normaliser_name(), "layout": {"engines": 1, "workers": args.workers,
                                      "threads": args.threads, "batch": args.batch,
                                      "time_axis": "dynamic", "language": args.language},
        "models": {}}
    names = args.models.split(",")
    for name in names:
        print(f"model_choice: {name} ...", flush=True)
        row = one_model(name, clips_path, args)
        report["models"][name] = row
        brief = {k: row.get(k) for k in ("error", "throughput_x", "peak_rss_mb")}
        brief["wer_read"] = row.get("wer", {}).get("read_speech", {}).get("wer_percent")
        print(f"model_choice: {name}: {json.dumps(brief)}", flush=True)
        ok = [r for r in report["models"].values() if "throughput_x" in r]
        if len(ok) >= 2:
            report["throughput_ratio_to_first"] = {
                n: round(r["throughput_x"] / ok[0]["throughput_x"], 3)
                for n, r in report["models"].items() if "throughput_x" in r}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
