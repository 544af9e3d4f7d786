"""Live WER against batch, pooled over runs of the live bench (loadtest/live.py ``--batch-wer``).

    python -m loadtest.live_report loadtest/results/live.json \
        loadtest/results/live-seed35.json loadtest/results/live-seed36.json

One run at N = 4 or 8 holds 20-40 utterances, and a few of the corpus's MFA clips (three-word
phrases such as "montreal uh uh uh uh uh uh forced aligner") move its WER by points; runs on
other stream orders (``--seed``) pooled give the comparison more words. Per N, word-weighted
over the runs (each run's WER times its reference words):

* ``live``: the sessions' completed text;
* ``turns_uploaded``: each turn the sessions finalised uploaded on its own: the same audio,
  read by the batch path, so live against it is what reading the turns live costs;
* ``clips``: each clip uploaded whole: against ``turns_uploaded``, what the client's turns cost
  (a pause of ``silence_duration_ms`` ends a turn, and each piece is read without the rest);
* ``streams``: each stream's audio (clips and pauses) as one upload.

Turn latency, pooled the same way (``--latency``): one run at 16 streams times ~113 turns, so
its p95 is the 6th slowest turn and moves by ~0.1-0.2 s from run to run on this host; runs on
other stream orders pooled give every turn of them (``turn_latencies`` in each result row).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loadtest.lib.stats import latency_summary

COLUMNS = ("live", "turns_uploaded", "clips", "streams")


def columns(r: dict[str, Any]) -> dict[str, float]:
    """One result row's four WERs (see the module doc)."""
    return {"live": r["wer_percent"], "turns_uploaded": r["turns_uploaded"]["wer_percent"],
            "clips": r["batch_wer_percent"], "streams": r["batch_stream_wer_percent"]}


def words(r: dict[str, Any]) -> int:
    return sum(int(g["words"]) for g in r["wer_by_set"].values())


def pooled(runs: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per N: the runs' WERs weighted by their reference words, and the words and runs."""
    acc: dict[int, dict[str, Any]] = {}
    for run in runs:
        for r in run["results"]:
            if "turns_uploaded" not in r:
                continue
            a = acc.setdefault(r["streams"], {c: 0.0 for c in COLUMNS} | {"words": 0, "runs": 0})
            w = words(r)
            for c, v in columns(r).items():
                a[c] += v * w
            a["words"] += w
            a["runs"] += 1
    return {n: {c: round(a[c] / a["words"], 1) for c in COLUMNS}
            | {"words": a["words"], "runs": a["runs"]} for n, a in sorted(acc.items())}


def pooled_latency(runs: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per N: p50 / p95 / max of every timed turn of the runs, and the turns and runs."""
    acc: dict[int, list[list[float]]] = {}
    for run in runs:
        for r in run["results"]:
            if "turn_latencies" in r:
                acc.setdefault(r["streams"], []).append([t[1] for t in r["turn_latencies"]])
    return {n: latency_summary([x for run in per_run for x in run]) | {"runs": len(per_run)}
            for n, per_run in sorted(acc.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--latency", action="store_true", help="turn latency pooled, not WER")
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in args.results]
    for p, run in zip(args.results, runs, strict=True):
        print(f"{p} (commit {run['commit']}, clean tree {run['clean_tree']})")
    if args.latency:
        print("| N | runs | turns | p50 | p95 | max |")
        print("| --- | --- | --- | --- | --- | --- |")
        for n, a in pooled_latency(runs).items():
            print(f"| {n} | {a['runs']} | {a['n']} | {a['p50_s']} s | {a['p95_s']} s | "
                  f"{a['max_s']} s |")
        return
    print("| N | runs | words | live | same turns uploaded | clips uploaded | streams uploaded |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, a in pooled(runs).items():
        print(f"| {n} | {a['runs']} | {a['words']} | "
              + " | ".join(f"{a[c]} %" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
