"""The engine's cost of each short clip of the stall bench (``python -m loadtest.stall
--engine-costs``): each clip's windows through the engine alone, and one decoder batch with and
without a looping clip in it, what every other window of that batch pays for the loop."""

from __future__ import annotations

import time
from typing import Any

from loadtest.lib.corpus import SHORT_CLIP_S, load_corpus


def engine_costs(model: str, threads: int = 1) -> list[dict[str, Any]]:
    """Each short clip's windows through the engine alone (batch 1, ``threads`` threads): the
    encoder and decoder stage seconds, and whether the decode went back to Whisper's 30 s axis
    (its text looped or was unsure: app/engine/whisper.py ``_redo_axis``)."""
    from app.config import ModelSettings
    from app.engine.whisper import WhisperEngine
    from app.windows import DecodeOptions
    from loadtest.lib.common import cut_corpus, resolve_model

    clips = [c for c in load_corpus() if c.duration_s <= SHORT_CLIP_S]
    engine = WhisperEngine(resolve_model(model), ModelSettings(
        device="cpu", compute_type="int8", num_workers=1, cpu_threads=threads), model)
    redo: list[int] = []
    inner = engine._run

    def counted(windows: Any, options: Any, n: int, languages: Any = None) -> Any:
        redo.append(n)
        return inner(windows, options, n, languages)

    engine._run = counted  # type: ignore[method-assign]
    opts = DecodeOptions()
    out: list[dict[str, Any]] = []
    cut = cut_corpus(clips)
    for cw in cut:
        w = cw.window
        t0 = time.perf_counter()
        [enc] = engine.encode([w], opts)
        t1 = time.perf_counter()
        redo.clear()
        [res] = engine.decode([w], [enc], opts)
        t2 = time.perf_counter()
        out.append({"clip": cw.clip_id, "window_s": round(w.duration, 2),
                    "encode_s": round(t1 - t0, 3), "decode_s": round(t2 - t1, 3),
                    "redo_at_30s": bool(redo), "text": res.text[:80]})
    out.sort(key=lambda r: -float(r["decode_s"]))
    out.append(_batch_with_a_loop(engine, [cw.window for cw in cut],
                                  [cw.clip_id for cw in cut], out))
    engine.close()
    return out


def _batch_with_a_loop(engine: Any, windows: list[Any], ids: list[str],
                       costs: list[dict[str, Any]]) -> dict[str, Any]:
    """One decoder batch of 8 windows of one padded length, without and with the slowest
    looping clip in it: what every other window of that batch pays for the loop's redo."""
    from app.windows import DecodeOptions

    opts = DecodeOptions()
    looping = next(r["clip"] for r in costs if r.get("redo_at_30s"))
    k = ids.index(looping)
    n = engine.padded_samples(windows[k])
    plain = [w for w, c in zip(windows, ids, strict=True)
             if engine.padded_samples(w) == n and not any(
                 r["clip"] == c and r.get("redo_at_30s") for r in costs)][:8]
    timings = {}
    for name, batch in (("8 plain", plain), ("7 plain + the loop", [*plain[:7], windows[k]])):
        enc = engine.encode(batch, opts)
        t0 = time.perf_counter()
        engine.decode(batch, enc, opts)
        timings[name] = round(time.perf_counter() - t0, 3)
    return {"clip": f"decoder batch at padded {n} samples", "looping_clip": looping, **timings}
