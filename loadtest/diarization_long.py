"""Three-minute conversations assembled from ``../shared/corpus`` voices, through the diarizer:
the long-audio path (spectral clustering, 40 crops and up) with a known speaker count.

    .venv/bin/python -m loadtest.diarization_long

No real recording of minutes with a reference was found for ``tests/data/diarization`` (see
docs/speakers.md), so this is the check of that path: 2, 3, 4 and 5 voices from different
recordings (different readers and channels, as meeting voices are not), turns of 1.5-6 s
taken in order from each voice's clips, 0.2 s apart, fed in 60 s chunks like an upload.
It reports the speaker count found against the truth and the DER (0.25 s collar; the
reference marks each piece whole, so pauses inside a clip count as missed speech and the
confusion is the figure to read). Nothing here was used to choose a parameter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.diarization import DEFAULT_CORPUS, load_der
from loadtest.lib.common import ROOT

CORPUS = ROOT.parent / "shared" / "corpus"
SR = 16_000
# One voice each: clips of one reader or speaker per entry.
VOICES = {
    "ljspeech": [f"ljspeech-LJ001-{k:04d}" for k in (1, 3, 5, 7, 9, 10, 12, 14, 15)],
    "librispeech-1088": ["librispeech-1088-134315-0000"],
    "librispeech-2412": ["librispeech-2412-153948-0000"],
    "earnings22": ["earnings22-1_4482311_3_62"],
    "librivox-sonnet": ["librivox-shakespeare-sonnet-1"],
    "mfa": ["mfa-acoustic_corpus"],
    "jfk": ["jfk-inaugural-1961"],
    "librispeech-1272": ["librispeech-1272-128104-0004-8k"],
}


def voice(corpus: Path, files: dict[str, str], name: str) -> np.ndarray:
    from app.audio import decode

    x = np.concatenate([decode(corpus / files[i], 3600) for i in VOICES[name]])
    out: np.ndarray = x / max(float(np.abs(x).max()), 1e-6) * 0.5
    return out


def conversation(corpus: Path, files: dict[str, str], speakers: int, seconds: float,
                 seed: int) -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    rng = np.random.default_rng(seed)
    names = [str(v) for v in rng.choice(list(VOICES), speakers, replace=False)]
    sources = {v: voice(corpus, files, v) for v in names}
    pos = dict.fromkeys(names, 0)
    parts: list[np.ndarray] = []
    ref: list[tuple[float, float, str]] = []
    t, prev = 0.0, ""
    while t < seconds:
        v = str(rng.choice([u for u in names if u != prev]))
        prev = v
        a = pos[v]
        b = min(a + int(rng.uniform(1.5, 6.0) * SR), len(sources[v]))
        if b - a < SR // 2:  # the voice's clips are used up: start them again
            pos[v] = 0
            continue
        pos[v] = b
        parts += [sources[v][a:b], np.zeros(int(0.2 * SR), np.float32)]
        ref.append((t, t + (b - a) / SR, v))
        t += (b - a) / SR + 0.2
    return np.concatenate(parts).astype(np.float32), ref


async def run(corpus: Path, cache_dir: Path, seconds: float) -> list[dict[str, Any]]:
    import torch

    from app.speakers import Diarizer

    torch.set_num_threads(1)
    files = {d["id"]: d["file"] for d in map(json.loads,
                                             (corpus / "manifest.jsonl").read_text().splitlines())}
    der = load_der(DEFAULT_CORPUS)
    d = await asyncio.to_thread(Diarizer.load, cache_dir)
    d.start()
    rows = []
    try:
        for seed, k in enumerate((2, 3, 4, 5)):
            audio, ref = conversation(corpus, files, k, seconds, seed + 7)
            turns = await d.diarize(audio)
            r = der.der(ref, [tuple(t) for t in turns], 0.25, False, len(audio) / SR)
            rows.append({"voices": k, "found": len({t.speaker for t in turns}),
                         "duration_s": round(len(audio) / SR, 1), "crops": turns.crops,
                         "der": round(float(r["der"]), 4), "miss_s": round(float(r["miss"]), 2),
                         "false_alarm_s": round(float(r["false_alarm"]), 2),
                         "confusion_s": round(float(r["confusion"]), 2)})
            print(rows[-1], flush=True)
    finally:
        await d.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from models.provision import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m loadtest.diarization_long", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = asyncio.run(run(args.corpus, args.cache_dir, args.seconds))
    if args.out:
        args.out.write_text(json.dumps({"conversations": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
