"""Why the batcher runs the encoder and the decoder apart on CPU, measured offline.

    .venv/bin/python -m loadtest.stages --out loadtest/results/stages.json

One engine, one worker, one thread (wall time is then CPU time), on the corpus's own windows
(decode + Silero VAD + cut, as the service makes them):

1. ``decoder_ms_per_window``: the decoder alone (``generate`` on encoder outputs), per batch size,
   for the three commonest padded lengths; and the encoder's ms per window at batch 1 and 8.
2. ``orders``: the same windows through the engine, audio seconds per wall second:
   ``sorted``: single calls (``transcribe_batch``) on windows sorted by length, batch 16 (what
   the engine limit does); ``arrival``: single calls in a shuffled (arrival) order, batch 8, as a
   one-stage batcher would see them; ``staged``: the same arrival order encoded 8 at a time,
   each padded length decoded once 8 of its windows are encoded (what app/batching/stages.py does).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.common import allocator, cut_corpus, load_corpus, resolve_model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--seed", type=int, default=1, help="shuffle of the arrival order")
    p.add_argument("--cache", type=Path, default=None, help="folder for the cut-windows cache")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import ctranslate2
    import numpy as np

    from app.config import ModelSettings
    from app.engine.whisper import WhisperEngine
    from app.windows import SAMPLE_RATE, DecodeOptions, Encoded, Prompt, Window

    windows = [cw.window for cw in cut_corpus(load_corpus(), args.cache)]
    engine = WhisperEngine(resolve_model(args.model), ModelSettings(
        device="cpu", compute_type="int8", num_workers=1, cpu_threads=1), args.model)
    opts = DecodeOptions()
    for w in windows:
        w.prompt = Prompt(language="en")
    audio = sum(w.duration for w in windows)
    by_len: dict[int, list[Window]] = {}
    for w in windows:
        by_len.setdefault(engine.padded_samples(w), []).append(w)

    tok = engine._decoder.prompts.tokenizer("en", "transcribe")
    prompt = engine.model.get_prompt(tok, [], without_timestamps=True)
    decoder: dict[str, Any] = {}
    for n, ws in sorted(by_len.items(), key=lambda kv: -len(kv[1]))[:3]:
        ws = ws[:16]
        enc = np.stack([e.features for e in engine.encode(ws, opts)])
        row: dict[str, Any] = {"windows": len(ws)}
        for b in (1, 2, 4, 8, 16):
            k = len(ws) - len(ws) % b
            if not k:
                break
            t0 = time.perf_counter()
            for i in range(0, k, b):
                engine.model.model.generate(
                    ctranslate2.StorageView.from_array(np.ascontiguousarray(enc[i:i + b])),
                    [prompt] * b, max_length=448, suppress_blank=True, suppress_tokens=[-1],
                    return_scores=True, return_no_speech_prob=True, beam_size=1)
            row[f"b{b}"] = round(1000 * (time.perf_counter() - t0) / k, 1)
        for b in (1, 8):
            t0 = time.perf_counter()
            engine.encode(ws[:b], opts)
            row[f"encoder_b{b}"] = round(1000 * (time.perf_counter() - t0) / b, 1)
        decoder[f"{n // SAMPLE_RATE}s"] = row
        print(f"padded {n // SAMPLE_RATE}s: {row}", flush=True)

    def single(order: list[Window], b: int) -> None:
        for i in range(0, len(order), b):
            engine.transcribe_batch(order[i:i + b], opts)

    def staged(order: list[Window], b: int, d: int = 8) -> None:
        pool: dict[int, list[tuple[Window, Encoded]]] = {}

        def flush(group: list[tuple[Window, Encoded]]) -> None:
            engine.decode([w for w, _ in group], [e for _, e in group], opts)

        for i in range(0, len(order), b):
            batch = order[i:i + b]
            for w, e in zip(batch, engine.encode(batch, opts), strict=True):
                pool.setdefault(e.samples, []).append((w, e))
                if len(pool[e.samples]) >= d:
                    flush(pool.pop(e.samples))
        for group in pool.values():
            flush(group)

    arrival = list(windows)
    random.Random(args.seed).shuffle(arrival)
    by_length = sorted(windows, key=lambda w: -len(w.audio))
    runs: list[tuple[str, Callable[[], None]]] = [
        ("sorted", lambda: single(by_length, 16)), ("arrival", lambda: single(arrival, 8)),
        ("staged", lambda: staged(arrival, 8)),
    ]
    single(by_length[:8], 8)  # warm-up
    orders: dict[str, float] = {}
    for _ in range(2):  # interleaved twice: drift on a shared machine hits all three alike
        for name, fn in runs:
            t0 = time.perf_counter()
            fn()
            orders.setdefault(name, 0.0)
            orders[name] += time.perf_counter() - t0
    result = {
        "allocator": allocator(), "windows": len(windows), "window_audio_s": round(audio, 1),
        "decoder_ms_per_window": decoder,
        "orders": {k: round(2 * audio / v, 2) for k, v in orders.items()},
    }
    print(json.dumps(result["orders"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
