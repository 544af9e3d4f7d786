"""The peer users pick instead, side by side: faster-whisper's ``BatchedInferencePipeline``.

    python -m loadtest.gpu.peer --model DIR --device cuda --compute-type float16 \\
        --files a.wav,b.wav,... --references refs.json --out peer.json

As its users run it: one ``WhisperModel`` (the same model folder and compute type as the
service), one ``BatchedInferencePipeline``, the files transcribed one after another, each with
the pipeline's own VAD and language detection. First the batch size is swept on the first file
(``--sweep``; the best is the one of highest throughput), then every file at batch 16 and at
that best batch, at the service's decode (``beam_size=1``, matched), and once at batch 16 with
the pipeline's defaults (beam 5: labelled ``defaults``). Per pass: wall seconds, throughput
(audio seconds / wall seconds) and WER against each file's reference. Written to ``--out``
after every pass. scripts/gpu-check runs it after the service has stopped, so the two never
share the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def transcribe_files(pipeline: Any, files: list[Path], batch: int,
                     options: dict[str, Any]) -> tuple[list[str], float, float]:
    """Every file in turn; each file's text, the wall seconds, the audio seconds."""
    texts, audio = [], 0.0
    t0 = time.perf_counter()
    for f in files:
        segments, info = pipeline.transcribe(str(f), batch_size=batch, **options)
        texts.append(" ".join(s.text.strip() for s in segments))  # the generator runs here
        audio += float(info.duration)
    return texts, time.perf_counter() - t0, audio


def one_pass(pipeline: Any, files: list[Path], refs: list[str] | None, batch: int,
             options: dict[str, Any], label: str) -> dict[str, Any]:
    from app.client.scoring import wer_percent

    texts, wall, audio = transcribe_files(pipeline, files, batch, options)
    out: dict[str, Any] = {"label": label, "batch": batch, "files": len(files),
                           "options": options, "wall_s": round(wall, 2),
                           "audio_s": round(audio, 1), "throughput_x": round(audio / wall, 1)}
    if refs is not None:
        out["wer_percent"] = wer_percent(refs, texts)
    print(f"gpu_peer: {json.dumps(out)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a CTranslate2 Whisper folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compute-type", default="float16")
    p.add_argument("--files", required=True, help="comma-separated audio files")
    p.add_argument("--references", type=Path, default=None,
                   help="JSON list of the files' reference texts, in order")
    p.add_argument("--sweep", default="8,16,32,64", help="batch sizes tried on the first file")
    p.add_argument("--threads", type=int, default=0, help="CTranslate2 CPU threads (0: its own)")
    p.add_argument("--no-defaults", action="store_true", help="skip the defaults pass")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from faster_whisper import BatchedInferencePipeline, WhisperModel

    files = [Path(f) for f in args.files.split(",")]
    refs = json.loads(args.references.read_text()) if args.references else None
    report: dict[str, Any] = {"model": args.model, "device": args.device,
                              "compute_type": args.compute_type, "files": len(files),
                              "runs": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    t0 = time.perf_counter()
    model = WhisperModel(args.model, device=args.device, compute_type=args.compute_type,
                         cpu_threads=args.threads, local_files_only=True)
    pipeline = BatchedInferencePipeline(model=model)
    report["load_s"] = round(time.perf_counter() - t0, 1)
    matched = {"beam_size": 1}
    transcribe_files(pipeline, files[:1], 16, matched)  # warm-up (kernels, VAD session)
    sweep = []
    for b in (int(x) for x in args.sweep.split(",")):
        sweep.append(one_pass(pipeline, files[:1], refs[:1] if refs else None, b, matched,
                              "sweep"))
        report["sweep"] = sweep
        save()
    best = max(sweep, key=lambda r: r["throughput_x"])["batch"]
    report["best_batch"] = best
    for b in dict.fromkeys((16, best)):
        report["runs"].append(one_pass(pipeline, files, refs, b, matched, "matched"))
        save()
    if not args.no_defaults:
        report["runs"].append(one_pass(pipeline, files, refs, 16, {}, "defaults"))
        save()
    print(f"gpu_peer: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
