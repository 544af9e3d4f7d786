"""Diarization on the project's development set (``tests/data/diarization``), old and new side
by side: DER per recording (miss, false alarm, confusion), the speaker count found against the
truth, the tuning and held-out splits reported separately, and the CPU cost.

    .venv/bin/python -m loadtest.diarization_dev --out loadtest/results/diarization_dev.json

Every recording is decoded as the service decodes uploads, fed to ``Diarizer.diarize``'s
stream in 60 s chunks, and diarized twice in the same process, one torch thread: ``new`` (the
clustering with the segmentation-evidence merge, app/speakers/evidence.py) and ``old`` (the
same stream with ``evidence = False``: the clustering before issue 49). The model work is the
same in both; CPU is the process's CPU seconds (``time.process_time``, all threads) of each
whole diarization, so a shared machine's other load does not count. Scoring is
``../shared/corpus-diarization/der.py`` (0.25 s collar, overlap scored: ``primary``; collar 0:
``strict``). Per split: the time-weighted total, the mean and max of the per-recording DERs,
and how many recordings got a speaker count within one of the reference's. ``shared`` marks the
four recordings of ``../shared/corpus-diarization`` (part of the tuning split).

``count_margins``: per recording, the speaker count found when the clustering's cut moves
from 0.3 to 0.5 (3D-Speaker's 0.4 in the middle): how close each count decision was.

The acceptance bar of issue 49 is checked on the held-out split: mean DER <= 20 %, no
recording above 30 %, count within one on >= 80 % of recordings (``bar`` in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.diarization import DEFAULT_CORPUS, git_state, load_der, manifest, write_rttm
from loadtest.lib.common import ROOT, machine_info

DATASET = ROOT / "tests" / "data" / "diarization"
SETTINGS = {"primary": 0.25, "strict": 0.0}
VARIANTS = ("old", "new")
MARGIN_CUTS = (0.3, 0.35, 0.4, 0.45, 0.5)


async def diarize_all(items: list[dict[str, Any]], cache_dir: Path, chunk_s: float
                      ) -> dict[str, dict[str, Any]]:
    """{variant: {id: {"turns", "cpu_s"}}}, each recording diarized by both variants in turn."""
    import numpy as np
    import torch

    from app.speakers import Diarizer
    from app.speakers.models import SAMPLE_RATE

    torch.set_num_threads(1)  # as the service (model.torch_threads)
    diarizer = await asyncio.to_thread(Diarizer.load, cache_dir)
    diarizer.start()
    out: dict[str, dict[str, Any]] = {v: {} for v in VARIANTS}
    try:
        warm = np.zeros(SAMPLE_RATE * 12, dtype=np.float32)  # first calls allocate; not timed
        warm[::7] = 0.01
        await diarizer.diarize(warm)
        step = round(chunk_s * SAMPLE_RATE)
        for m in items:
            for variant in VARIANTS:
                c0 = time.process_time()
                stream = diarizer.stream()
                if variant == "old":  # the stream before issue 49
                    stream.evidence = False
                    stream.min_speaker_s = 0.0
                audio = m["audio"]
                for a in range(0, len(audio), step):
                    await stream.feed(audio[a: a + step], a / SAMPLE_RATE)
                turns = await stream.finish()
                out[variant][m["id"]] = {"turns": [tuple(t) for t in turns],
                                         "cpu_s": time.process_time() - c0,
                                         "stream": stream if variant == "new" else None}
    finally:
        await diarizer.stop()
    return out


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Time-weighted total, mean and max DER, and the count criterion, over ``rows``."""
    if not rows:
        return {}
    total = sum(r["reference_s"] for r in rows)
    errors = sum(r["miss_s"] + r["false_alarm_s"] + r["confusion_s"] for r in rows)
    ders = [r["der"] for r in rows]
    within = sum(abs(r["speakers_found"] - r["speakers"]) <= 1 for r in rows)
    return {"recordings": len(rows), "der_total": round(errors / total, 4),
            "der_mean": round(sum(ders) / len(ders), 4), "der_max": round(max(ders), 4),
            "count_within_one": within, "count_within_one_share": round(within / len(rows), 3),
            "count_exact": sum(r["speakers_found"] == r["speakers"] for r in rows)}


def score(der: Any, items: list[dict[str, Any]], hyps: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, collar in SETTINGS.items():
        rows = []
        for m in items:
            turns = hyps[m["id"]]["turns"]
            r = der.der(m["ref"], turns, collar, False, m["duration_s"])
            rows.append({"id": m["id"], "split": m["split"], "shared": bool(m.get("shared")),
                         "der": round(float(r["der"]), 4), "reference_s": round(r["total"], 3),
                         "miss_s": round(r["miss"], 3), "false_alarm_s": round(r["false_alarm"], 3),
                         "confusion_s": round(r["confusion"], 3), "speakers": m["speakers"],
                         "speakers_found": len({k for _, _, k in turns}),
                         "cpu_s": round(hyps[m["id"]]["cpu_s"], 3)})
        out[name] = {"collar_s": collar, "per_recording": rows,
                     "tune": summarise([r for r in rows if r["split"] == "tune"]),
                     "heldout": summarise([r for r in rows if r["split"] == "heldout"]),
                     "shared": summarise([r for r in rows if r["shared"]])}
    return out


def margins(items: list[dict[str, Any]], hyps: dict[str, Any]) -> dict[str, Any]:
    """How close each recording's speaker count was: the count found when the clustering's
    cut (3D-Speaker's 0.4 average cosine) moves by up to 0.1 either way, the rest unchanged
    (the same embeddings and windows, re-clustered: ``SpeakerStream._result``)."""
    from app.speakers import cluster

    out: dict[str, Any] = {}
    saved = cluster.AHC_COS
    try:
        for m in items:
            stream = hyps[m["id"]]["stream"]
            row = {}
            for cut in MARGIN_CUTS:
                cluster.AHC_COS = cut
                row[f"{cut:.2f}"] = len({t.speaker for t in stream._result()})
            out[m["id"]] = {"speakers": m["speakers"], "crops": len(stream.crops),
                            "found_at_cut": row}
    finally:
        cluster.AHC_COS = saved
    return out


def bar(s: dict[str, Any]) -> dict[str, Any]:
    """Issue 49's acceptance bar on a split's primary summary."""
    return {"mean_der_le_20pct": s["der_mean"] <= 0.20, "max_der_le_30pct": s["der_max"] <= 0.30,
            "count_within_one_ge_80pct": s["count_within_one_share"] >= 0.8}


def print_scores(report: dict[str, Any], systems: Sequence[str]) -> None:
    """Each system's DER per recording and per split, and its CPU, one line each."""
    for v in systems:
        prim = report["scores"][v]["primary"]
        for r in prim["per_recording"]:
            print(f"{v:8s} {r['split']:7s} {r['id']:24s} DER {100 * r['der']:5.1f}% (miss "
                  f"{r['miss_s']:.2f} fa {r['false_alarm_s']:.2f} conf {r['confusion_s']:.2f} s) "
                  f"speakers {r['speakers']} found {r['speakers_found']} cpu {r['cpu_s']:.2f} s")
        for split in ("tune", "heldout", "shared"):
            if s := prim[split]:
                print(f"{v:8s} {split}: total {100 * s['der_total']:.2f}% mean "
                      f"{100 * s['der_mean']:.2f}% max {100 * s['der_max']:.1f}% count within "
                      f"one {s['count_within_one']}/{s['recordings']}")
        print(f"{v:8s} CPU {report['cpu_s_per_audio_s'][v]} s per audio s")


def main(argv: Sequence[str] | None = None) -> int:
    from models.provision import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m loadtest.diarization_dev", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", type=Path, default=DATASET)
    p.add_argument("--scorer", type=Path, default=DEFAULT_CORPUS,
                   help="folder holding der.py (the shared diarization corpus)")
    p.add_argument("--split", choices=("tune", "heldout", "all"), default="all",
                   help="which recordings to run (tune while tuning: the held-out split is "
                        "evaluated once per design decision)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--chunk-s", type=float, default=60.0)
    p.add_argument("--rttm-dir", type=Path, default=None, help="write <variant>/<id>.rttm here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from app.audio import decode

    der = load_der(args.scorer)
    git = git_state()
    items = [m for m in manifest(args.dataset) if args.split in ("all", m["split"])]
    for m in items:
        m["audio"] = decode(args.dataset / m["file"], 4 * 3600)
        m["ref"] = der.load_rttm(str(args.dataset / m["rttm"])).get(m["id"], [])
    hyps = asyncio.run(diarize_all(items, args.cache_dir, args.chunk_s))
    audio_s = sum(len(m["audio"]) / 16_000 for m in items)
    report: dict[str, Any] = {
        "what": "app/speakers on tests/data/diarization, old and new clustering side by side",
        "git": git, "machine": machine_info(), "dataset": str(args.dataset), "split": args.split,
        "audio_s": round(audio_s, 2), "chunk_s": args.chunk_s, "torch_threads": 1,
        "scores": {v: score(der, items, hyps[v]) for v in VARIANTS},
        "cpu_s_per_audio_s": {v: round(sum(h["cpu_s"] for h in hyps[v].values()) / audio_s, 4)
                              for v in VARIANTS}}
    report["count_margins"] = margins(items, hyps["new"])
    for h in hyps["new"].values():
        h.pop("stream")
    if args.split in ("all", "heldout"):
        report["bar"] = {v: bar(report["scores"][v]["primary"]["heldout"]) for v in VARIANTS}
    if args.rttm_dir:
        for v in VARIANTS:
            (args.rttm_dir / v).mkdir(parents=True, exist_ok=True)
            for i, h in hyps[v].items():
                write_rttm(args.rttm_dir / v / f"{i}.rttm", i, h["turns"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_scores(report, VARIANTS)
    for i, r in report["count_margins"].items():
        print(f"count margins {i:24s} truth {r['speakers']} crops {r['crops']:3d} found at cut "
              + " ".join(f"{c}:{k}" for c, k in r["found_at_cut"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
