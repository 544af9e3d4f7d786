"""Diarization error rate of app/speakers on ../shared/corpus-diarization, and its CPU cost.

    .venv/bin/python -m loadtest.diarization --out loadtest/results/diarization.json

Every recording of the corpus manifest is decoded as the service decodes uploads
(``app.audio.decode``), diarized by ``Diarizer.diarize`` (fed in 60 s chunks, as the streaming
decoder will), written as RTTM, and scored by the corpus's own ``der.py`` (its ``der()``;
time-weighted totals as its ``--manifest`` mode): 0.25 s collar with overlap scored (the
corpus's recommended setting), collar 0 (strict), and 0.25 s with overlap skipped. Baselines:
one speaker over the reference speech (oracle speech activity, one label) and one speaker over
the whole file. CPU time is the process's (all threads) per recording, one torch thread as in
the service. A second pass runs all recordings at once: its batches mix recordings, and its
turns must equal the first pass's (batch composition does not change a result).

Then, unless ``--no-service``, what users get (``loadtest/lib/diarization_users.py``): the real
service, ``diarize=true`` on every recording and on its ``--excerpt-s`` excerpts, its turns
(``format=rttm``) and its segments' speakers scored alike (``as_users_get`` in the report;
RTTMs under ``<rttm-dir>/service/``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from loadtest.lib.common import ROOT, machine_info

DEFAULT_CORPUS = Path(os.environ.get("BATCHSCRIBE_DIARIZATION_CORPUS",
                                     ROOT.parent / "shared" / "corpus-diarization"))
SETTINGS = {"primary": (0.25, False), "strict": (0.0, False), "skip_overlap": (0.25, True)}


def load_der(corpus: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("corpus_der", corpus / "der.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def manifest(corpus: Path) -> list[dict[str, Any]]:
    path = corpus / "manifest.jsonl"
    if not path.is_file():
        raise SystemExit(f"no diarization corpus at {corpus} (--corpus)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"),
            "clean": git("status", "--porcelain", "--untracked-files=no") == ""}


def write_rttm(path: Path, uri: str, turns: Sequence[tuple[float, float, str]]) -> None:
    path.write_text("".join(f"SPEAKER {uri} 1 {s:.3f} {e - s:.3f} <NA> <NA> {k} <NA> <NA>\n"
                            for s, e, k in turns))


def score(der: ModuleType, items: list[dict[str, Any]], hyps: dict[str, list[Any]]
          ) -> dict[str, Any]:
    """Per recording and time-weighted totals for every scoring setting, der.py's numbers."""
    out: dict[str, Any] = {}
    for name, (collar, skip) in SETTINGS.items():
        per, tot = {}, {"total": 0.0, "miss": 0.0, "false_alarm": 0.0, "confusion": 0.0}
        for m in items:
            r = der.der(m["ref"], hyps[m["id"]], collar, skip, m["duration_s"])
            per[m["id"]] = {k: round(float(v), 4) for k, v in r.items()}
            for k in tot:
                tot[k] += r[k]
        errors = tot["miss"] + tot["false_alarm"] + tot["confusion"]
        out[name] = {"collar_s": collar, "skip_overlap": skip, "per_recording": per,
                     "total": {**{k: round(v, 3) for k, v in tot.items()},
                               "der": round(errors / tot["total"], 4)}}
    return out


async def run(items: list[dict[str, Any]], cache_dir: Path, chunk_s: float) -> dict[str, Any]:
    import resource

    import numpy as np
    import torch

    from app.speakers import Diarizer

    torch.set_num_threads(1)  # as the service (model.torch_threads)
    t0 = time.monotonic()
    diarizer = await asyncio.to_thread(Diarizer.load, cache_dir)
    load_s = time.monotonic() - t0
    diarizer.start()
    try:
        warm = np.zeros(16_000 * 12, dtype=np.float32)  # first calls allocate; not timed
        warm[::7] = 0.01
        await diarizer.diarize(warm)
        seq: dict[str, Any] = {}
        for m in items:
            c0, w0 = time.process_time(), time.monotonic()
            turns = await diarizer.diarize(m["audio"], chunk_s=chunk_s)
            seq[m["id"]] = {"turns": turns, "cpu_s": time.process_time() - c0,
                            "wall_s": time.monotonic() - w0}
        calls0 = (diarizer.segmenter.calls, diarizer.segmenter.items,
                  diarizer.embedder.calls, diarizer.embedder.items)
        c0, w0 = time.process_time(), time.monotonic()
        together = await asyncio.gather(*(diarizer.diarize(m["audio"], chunk_s=chunk_s)
                                          for m in items))
        conc = {"cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - w0,
                "segmentation_calls": diarizer.segmenter.calls - calls0[0],
                "segmentation_windows": diarizer.segmenter.items - calls0[1],
                "embedding_calls": diarizer.embedder.calls - calls0[2],
                "embedding_crops": diarizer.embedder.items - calls0[3]}
        conc["same_turns_as_sequential"] = all(
            t == seq[m["id"]]["turns"] for m, t in zip(items, together, strict=True))
    finally:
        await diarizer.stop()
    return {"sequential": seq, "concurrent": conc, "load_s": round(load_s, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    from models.provision import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m loadtest.diarization", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--chunk-s", type=float, default=60.0, help="audio fed per feed() call")
    p.add_argument("--rttm-dir", type=Path, default=ROOT / "loadtest" / "results" / "diarization-rttm")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-service", action="store_true",
                   help="skip the service phase (DER of the turns and segments users get)")
    p.add_argument("--excerpt-s", type=float, default=15.0,
                   help="service phase: also excerpts this long (hop: half); 0: none")
    args = p.parse_args(argv)

    from app.audio import decode

    der = load_der(args.corpus)
    git = git_state()
    items = manifest(args.corpus)
    for m in items:
        m["path"] = args.corpus / m["file"]
        m["audio"] = decode(m["path"], 4 * 3600)
        m["ref"] = der.load_rttm(str(args.corpus / m["rttm"])).get(m["id"], [])
    result = asyncio.run(run(items, args.cache_dir, args.chunk_s))
    seq = result["sequential"]
    hyps = {i: [tuple(t) for t in r["turns"]] for i, r in seq.items()}
    args.rttm_dir.mkdir(parents=True, exist_ok=True)
    for i, turns in hyps.items():
        write_rttm(args.rttm_dir / f"{i}.rttm", i, turns)
    one_speech = {m["id"]: [(s, e, "one") for s, e, _ in m["ref"]] for m in items}
    one_file = {m["id"]: [(0.0, float(m["duration_s"]), "one")] for m in items}
    audio_s = sum(len(m["audio"]) / 16_000 for m in items)
    cpu_s = sum(r["cpu_s"] for r in seq.values())
    report = {
        "what": "app/speakers on corpus-diarization, scored by the corpus's der.py",
        "git": git, "machine": machine_info(), "corpus": str(args.corpus),
        "recordings": [m["id"] for m in items], "audio_s": round(audio_s, 2),
        "chunk_s": args.chunk_s, "torch_threads": 1,
        "scores": score(der, items, hyps),
        "baseline_one_speaker_on_reference_speech": score(der, items, one_speech),
        "baseline_one_speaker_whole_file": score(der, items, one_file),
        "speakers": {m["id"]: {"reference": m["speakers"],
                               "hypothesis": len({k for _, _, k in hyps[m["id"]]})} for m in items},
        "cost": {"cpu_s_per_audio_s": round(cpu_s / audio_s, 4),
                 "per_recording": {i: {"cpu_s": round(r["cpu_s"], 3), "wall_s": round(r["wall_s"], 3)}
                                   for i, r in seq.items()},
                 "concurrent_pass": {k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in result["concurrent"].items()},
                 "model_load_s": result["load_s"], "peak_rss_mb": result["peak_rss_mb"]},
        "rttm_dir": str(args.rttm_dir.relative_to(ROOT) if args.rttm_dir.is_relative_to(ROOT)
                        else args.rttm_dir),
    }
    if not args.no_service:
        from loadtest.lib import diarization_users

        report["as_users_get"] = diarization_users.run(der, items, args.excerpt_s,
                                                       args.rttm_dir / "service")
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for name in SETTINGS:
        s = report["scores"][name]
        per = ", ".join(f"{i} {100 * v['der']:.1f}" for i, v in s["per_recording"].items())
        print(f"DER {name}: total {100 * s['total']['der']:.2f}% ({per})")
    for b in ("baseline_one_speaker_on_reference_speech", "baseline_one_speaker_whole_file"):
        print(f"{b}: {100 * report[b]['primary']['total']['der']:.2f}%")
    if "as_users_get" in report:
        from loadtest.lib.diarization_users import summary

        print(summary(report["as_users_get"]))
    print(f"CPU {report['cost']['cpu_s_per_audio_s']} s per audio s; concurrent pass "
          f"{report['cost']['concurrent_pass']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
