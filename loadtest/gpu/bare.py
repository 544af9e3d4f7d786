"""Bare CTranslate2 encode, no service: the encoder's own rate at two time axes.

Run as a child of ``loadtest.gpu.check`` (its CUDA context and memory end with it, so the
service started after it sizes against a clean device). Features are the corpus's own speech
(log-mel of its clips, cycled), padded to Whisper's 30 s and to 10 s (the dynamic axis's class
for a short clip); each batch size is warmed once, then timed over ``--reps`` calls.
``encode`` synchronises its CUDA stream before it returns (CTranslate2's
``WhisperReplica::encode``), so wall time per call is the device's time plus launch overhead.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from loadtest.lib.corpus import load_corpus


def run(model: str, device: str, compute_type: str, corpus: Path, batches: list[int],
        axes: list[int], reps: int, flash: bool = False) -> dict[str, Any]:
    import ctranslate2

    from app.audio import decode
    from app.engine.gpumem import pool_meter
    from app.engine.mel import encoder_input
    from loadtest.lib.common import proc_status_kb

    clips = sorted(load_corpus(corpus), key=lambda c: c.id)[:32]
    audio = [decode(c.path, 3600.0) for c in clips]
    threads = {"intra_threads": 1, "inter_threads": 1} if device == "cpu" else {}
    t0 = time.monotonic()
    whisper = ctranslate2.models.Whisper(model, device=device, compute_type=compute_type,
                                         flash_attention=flash, **threads)
    out: dict[str, Any] = {"load_s": round(time.monotonic() - t0, 2), "compute_type": compute_type,
                           "flash_attention": flash, "rows": []}
    meter = pool_meter()
    mel_device = "cuda:0" if device == "cuda" else "cpu"
    for seconds in axes:
        for b in batches:
            windows = [audio[k % len(audio)][: seconds * 16000] for k in range(b)]
            feats = encoder_input(windows, seconds * 16000, whisper.n_mels, mel_device)
            row: dict[str, Any] = {"axis_s": seconds, "batch": b}
            try:
                whisper.encode(feats)  # warm: kernels, cuBLAS handles, pool growth
                if device == "cuda":
                    meter.reset(0)
                t = time.monotonic()
                for _ in range(reps):
                    whisper.encode(feats)
                wall = time.monotonic() - t
            except Exception as exc:  # out of memory at this size: recorded, next size
                row["error"] = str(exc)[:300]
                out["rows"].append(row)
                continue
            row.update({"ms_per_call": round(1000 * wall / reps, 2),
                        "windows_per_s": round(b * reps / wall, 1),
                        "audio_x": round(b * reps * seconds / wall, 1)})
            if device == "cuda":
                peak = meter.peak(0)
                row["pool_peak_mb"] = None if peak is None else round(peak / 2**20, 1)
            else:
                kb = proc_status_kb("self", "VmHWM")
                row["peak_rss_mb"] = None if kb is None else round(kb / 1024, 1)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compute-type", default="float16")
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--axes", default="30,10")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--flash-attention", action="store_true",
                    help="CTranslate2's flash attention (GPU, compute capability >= 8.0)")
    args = ap.parse_args(argv)
    result = run(args.model, args.device, args.compute_type, args.corpus,
                 [int(b) for b in args.batches.split(",")], [int(a) for a in args.axes.split(",")],
                 args.reps, args.flash_attention)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
