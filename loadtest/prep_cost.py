"""Prep's CPU per upload, by kind of file: what the service's probe and one prep process spend
on a file before its windows reach the engine (the probe, the check for parts, decode, Silero,
the cut), in CPU seconds of one process, this tree against ``--base`` in one run.

    python -m loadtest.prep_cost --base 786af5f --out loadtest/results/prep-cost.json

Kinds: the corpus's WAV clips, its FLAC clips (each request's probe and prep, one after
another), and a 20-minute 16 kHz WAV (``loadtest/lib/feed_audio.py``, as the feed bench posts
it). Each tree runs in a process of its own (``PYTHONPATH`` = the tree), the trees in turn
``--repeats`` times, so the host's drift falls on both; per kind the best and the median of the
repeats. CPU time, not wall time: it is what a busy prep process (or the GPU host's many) runs
out of. No model: prep only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.feed import base_tree, tree_env
from loadtest.lib.common import ROOT, machine_info
from loadtest.lib.corpus import load_corpus
from loadtest.lib.feed_audio import uploads

CHILD = """
import json, sys, time
from pathlib import Path
from app.audio import prepare
from app.audio.media import probe
from app.audio.parts import splittable
from app.audio.vad import SileroVad
kinds = json.loads(sys.argv[1])
vad = SileroVad()
prepare(Path(kinds[next(iter(kinds))][0]), vad, 7200)  # the model loaded, the code warm
out = {}
for kind, paths in kinds.items():
    t = time.process_time()
    for p in map(Path, paths):
        probe(p, 7200)
        if kind == "long":
            splittable(p)  # a long upload's check for parts, in the prep process
        prepare(p, vad, 7200)
    out[kind] = (time.process_time() - t) / len(paths)
print(json.dumps(out))
"""


def run_tree(tree: Path, kinds: dict[str, list[str]]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kinds)], cwd=tree,
                         env=tree_env(tree), check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-prep-cost"))
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "prep-cost.json")
    args = ap.parse_args(argv)
    clips = load_corpus()
    kinds = {
        "wav_clips": [str(c.path) for c in clips if c.path.suffix == ".wav"],
        "flac_clips": [str(c.path) for c in clips if c.path.suffix == ".flac"],
        "long": [str(p) for p in uploads(clips, args.work / "audio", 1, 20.0, "wav16")],
    }
    trees = {"base": base_tree(args.base, args.work), "this": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    t0 = time.monotonic()
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, kinds))
    summary = {name: {kind: {"best_ms": round(1000 * min(r[kind] for r in rs), 2),
                             "median_ms": round(1000 * statistics.median(r[kind] for r in rs), 2)}
                      for kind in kinds}
               for name, rs in runs.items()}
    report: dict[str, Any] = {
        "command": "python -m loadtest.prep_cost " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "base_commit": args.base,
        "files": {kind: len(paths) for kind, paths in kinds.items()},
        "what": "CPU ms per file of one process: probe + (long: parts check) + prepare",
        "summary": summary, "runs": runs, "wall_s": round(time.monotonic() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"prep_cost: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
