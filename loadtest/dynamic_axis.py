"""The dynamic time axis against Whisper's 30 s, on the service's own engine: WER on the corpus.

    . scripts/env.sh && .venv/bin/python -m loadtest.dynamic_axis \\
        --out loadtest/results/dynamic-axis-cpu.json                 # here: int8, 2 cores
    python3 -m loadtest.dynamic_axis --device cuda --batch 32 ...    # a GPU (scripts/gpu-check)

Whisper was trained on 30 s inputs and the engine can pad every window to 30 s (``time_axis:
full``, the GPU's default until this measurement); on the dynamic axis a window is padded to its
length + ``pad_margin_s`` (8 s) in 5 s classes, and a window whose decode there loops or is
unsure is encoded again at 30 s (``Fallback.AXIS``, app/engine/decoder.py). The question is
accuracy only: does a window shorter than 30 s read as well at its own length? This runs every
window of the corpus (app.audio: decode, Silero VAD, cut) through ``WhisperEngine`` in batches
of one padded length (as the batcher groups them when the axis is dynamic), once per setting:

* ``full``: every window at 30 s;
* ``dynamic``: every window at its padded length, with the 30 s redo (the service's decode);
* ``dynamic_no_redo`` (``--no-redo-variant``): the same without the 30 s step (fallbacks run at
  the window's own length), to show what the redo buys.

Per setting: WER (read speech, the other sets, all), the transcripts that differ from ``full``
(with both texts), windows redone at 30 s, the encoder's padded seconds (what the axis saves,
device-independent) and process CPU seconds (a contended host's timings are no claim).
WER is deterministic for a given host, model and compute type.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.client.scoring import normaliser_name
from loadtest.lib.common import ClipWindow, cut_corpus, join_texts, machine_info, resolve_model
from loadtest.lib.corpus import DEFAULT_CORPUS, load_corpus, select_clips
from loadtest.lib.stats import wer_by_group

SETTINGS = ("full", "dynamic", "dynamic_no_redo")


def make_engine(model_dir: str, setting: str, args: argparse.Namespace) -> Any:
    """The service's engine on one time axis; ``dynamic_no_redo`` runs every fallback at the
    window's own padded length (its final length is where it was first encoded)."""
    from app.config import ModelSettings
    from app.engine.whisper import WhisperEngine
    from app.windows import Window

    settings = ModelSettings(device=args.device, compute_type=args.compute_type,
                             num_workers=1, cpu_threads=args.threads,
                             time_axis="full" if setting == "full" else "dynamic")

    class NoRedo(WhisperEngine):
        def final_samples(self, window: Window) -> int:
            return self.padded_samples(window)

    cls = NoRedo if setting == "dynamic_no_redo" else WhisperEngine
    return cls(model_dir, settings, args.model)


def run_setting(engine: Any, windows: Sequence[ClipWindow], batch: int,
                language: str | None) -> dict[str, Any]:
    """Every window once, in batches of one padded length (longest first); the encoder's padded
    seconds counted at each call (redos included)."""
    from app.windows import SAMPLE_RATE, DecodeOptions, LanguageChoice, Prompt

    encoded: list[int] = []
    inner = engine._encode

    def counted(ws: Any, n: int, languages: Any = None) -> Any:
        encoded.append(n * len(ws))
        return inner(ws, n, languages)

    engine._encode = counted
    choices: dict[str, LanguageChoice] = {}
    for cw in windows:
        cw.window.prompt = (Prompt(language=language) if language else
                            Prompt(choice=choices.setdefault(cw.clip_id, LanguageChoice())))
    classes: dict[int, list[ClipWindow]] = {}
    for cw in sorted(windows, key=lambda w: -w.window.duration):
        classes.setdefault(engine.padded_samples(cw.window), []).append(cw)
    order = [cw for n in sorted(classes, reverse=True) for cw in classes[n]]
    first = sum(engine.padded_samples(cw.window) for cw in order)
    texts: list[str] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for n in sorted(classes, reverse=True):
        members = classes[n]
        for i in range(0, len(members), batch):
            part = members[i:i + batch]
            texts += [r.text for r in engine.transcribe_batch([cw.window for cw in part],
                                                              DecodeOptions())]
    return {"texts": join_texts(order, texts),
            "cpu_s": round(time.process_time() - cpu0, 1),
            "wall_s": round(time.perf_counter() - wall0, 1),
            "padded_s": round(sum(encoded) / SAMPLE_RATE, 1),
            "redone_at_30s_s": round((sum(encoded) - first) / SAMPLE_RATE, 1),
            "classes_s": {str(n // SAMPLE_RATE): len(v) for n, v in sorted(classes.items())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.dynamic_axis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--clips", type=int, default=None, help="a subset (all: 83)")
    p.add_argument("--settings", default="full,dynamic",
                   help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compute-type", default=None, help="default: int8 (cpu), float16 (cuda)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="CTranslate2 threads")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--language", default="en", help="'' to detect, as clients send")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/dynamic-axis-cpu.json"))
    args = p.parse_args(argv)
    args.compute_type = args.compute_type or ("float16" if args.device == "cuda" else "int8")
    settings = args.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        p.error(f"unknown settings {sorted(unknown)}")

    clips = select_clips(load_corpus(args.corpus), args.clips)
    windows = cut_corpus(clips)
    model_dir = resolve_model(args.model)
    out: dict[str, Any] = {
        "command": "python -m loadtest.dynamic_axis " + " ".join(sys.argv[1:] if argv is None
                                                                   else argv),
        "machine": machine_info(), "device": args.device, "compute_type": args.compute_type,
        "model": args.model, "batch": args.batch, "language": args.language or None,
        "normaliser": normaliser_name(), "clips": len(clips), "windows": len(windows),
        "audio_s": round(sum(c.duration_s for c in clips), 1),
        "window_audio_s": round(sum(cw.window.duration for cw in windows), 1), "settings": {}}
    reference: dict[str, str] | None = None
    for setting in settings:
        engine = make_engine(model_dir, setting, args)
        try:
            row = run_setting(engine, windows, args.batch, args.language or None)
        finally:
            engine.close()
        texts = row.pop("texts")
        wer = wer_by_group(clips, texts)
        row = {"wer_read_percent": wer["read_speech"]["wer_percent"],
               "wer_other_percent": wer["other_sets"]["wer_percent"],
               "wer_all_percent": wer["all"]["wer_percent"], **row}
        if reference is None:
            reference = texts
            row["reference"] = True
        else:
            changed = sorted(k for k in texts if texts[k].strip() != reference.get(k, "").strip())
            row["clips_changed"] = len(changed)
            row["changed"] = {k: {settings[0]: reference[k], setting: texts[k]} for k in changed}
        out["settings"][setting] = row
        print(json.dumps({setting: {k: v for k, v in row.items() if k != "changed"}}),
              flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
