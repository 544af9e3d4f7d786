"""What a CPU service costs to start and to keep, this tree against ``--base``, in one run.

For each tree, ``--repeats`` times, alternating trees: the real service (``python -m app``,
tcmalloc, the default settings) started cold (warm-up off) and warm (the default), its wall time
and CPU seconds to ready, then one short corpus clip (no language: detected), and its resident
memory (VmRSS, VmHWM) and whether torch is mapped into it. Then, once per tree, the whole English
corpus posted one clip at a time with no language (as users send), its WER and the clips whose
transcripts differ between the trees, and a first ``diarize=true`` job (its wall time includes
the lazy load of the speaker models, and with them torch where the engine has not imported it).

    python -m loadtest.start_cost --base 6d2ce73~1 --out loadtest/results/start-cost.json

``--gauge NAME=DIR``: also the corpus pass (only) on another source tree, e.g. this one with one
numeric detail changed, to see how far transcripts and WER move under a change that should not
matter; ``--gauge-note`` records what that tree is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from app.client.scoring import wer_percent
from loadtest.feed import base_tree
from loadtest.lib.common import ROOT, machine_info, proc_status_kb
from loadtest.lib.corpus import DEFAULT_CORPUS, load_corpus, shared
from loadtest.lib.probes import cpu_seconds
from loadtest.lib.service import Server

DIARIZATION_SAMPLE = shared("corpus-diarization") / "audio"


def post(url: str, path: Path, **form: str) -> dict[str, Any]:
    with path.open("rb") as f, httpx.Client(timeout=600) as c:
        r = c.post(url + "/transcribe", params={"wait": "true"}, data=form,
                   files={"file": (path.name, f)})
    r.raise_for_status()
    job: dict[str, Any] = r.json()
    return job


def text_of(job: dict[str, Any]) -> str:
    return str((job.get("result") or {}).get("text", "")).strip()


def one_start(tree: Path, work: Path, warm: bool, clip: Path) -> dict[str, Any]:
    srv = Server(work, cwd=tree, env={"PYTHONPATH": str(tree),
                                      "BATCHSCRIBE_MODEL__WARMUP": str(warm).lower()})
    t0 = time.monotonic()
    srv.start()
    try:
        assert srv.proc is not None
        pid = srv.proc.pid
        row: dict[str, Any] = {"warm": warm, "ready_s": round(time.monotonic() - t0, 2),
                               "cpu_at_ready_s": round(cpu_seconds(pid), 2)}
        t1 = time.monotonic()
        post(srv.url, clip)
        row["first_request_s"] = round(time.monotonic() - t1, 2)
        row["cpu_after_first_s"] = round(cpu_seconds(pid), 2)
        row["rss_mb"] = round((proc_status_kb(pid, "VmRSS") or 0) / 1024, 1)
        row["peak_rss_mb"] = round((proc_status_kb(pid, "VmHWM") or 0) / 1024, 1)
        row["torch_mapped"] = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        return row
    finally:
        srv.stop()


def corpus_pass(tree: Path, work: Path, diarize_file: Path | None) -> dict[str, Any]:
    srv = Server(work, cwd=tree, env={"PYTHONPATH": str(tree)}).start()
    try:
        texts = {c.id: text_of(post(srv.url, c.path)) for c in load_corpus(DEFAULT_CORPUS)}
        out: dict[str, Any] = {"texts": texts}
        if diarize_file is not None:
            t0 = time.monotonic()
            job = post(srv.url, diarize_file, diarize="true")
            out["first_diarize_job_s"] = round(time.monotonic() - t0, 2)
            out["first_diarize_speakers"] = len((job.get("result") or {}).get("speakers") or [])
        return out
    finally:
        srv.stop()


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    xs = [float(r[key]) for r in rows]
    return {"min": min(xs), "median": round(statistics.median(xs), 2), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-start-cost"))
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "start-cost.json")
    ap.add_argument("--gauge", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--gauge-note", default="")
    args = ap.parse_args(argv)
    trees = {"base": base_tree(args.base, args.work), "this": ROOT}
    clips = load_corpus(DEFAULT_CORPUS)
    short = sorted(clips, key=lambda c: c.duration_s)[len(clips) // 2].path
    diarize_file = next(iter(sorted(DIARIZATION_SAMPLE.glob("pyannote-sample.*"))), None)
    report: dict[str, Any] = {
        "command": "python -m loadtest.start_cost " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(), "base_commit": args.base, "repeats": args.repeats,
        "first_request_clip": short.name, "trees": {n: {"starts": []} for n in trees}}
    for k in range(args.repeats):
        for warm in (False, True):
            for name, tree in trees.items():
                row = one_start(tree, args.work / f"svc-{name}-{k}-{warm}", warm, short)
                report["trees"][name]["starts"].append(row)
                print(name, row, flush=True)
    for name, tree in trees.items():
        t = report["trees"][name]
        for warm in (False, True):
            rows = [r for r in t["starts"] if r["warm"] == warm]
            t["cold" if not warm else "warm"] = {
                key: summary(rows, key) for key in ("ready_s", "cpu_at_ready_s",
                                                    "cpu_after_first_s", "rss_mb", "peak_rss_mb")}
        t.update(corpus_pass(tree, args.work / f"corpus-{name}", diarize_file))
        t["corpus_wer_percent"] = wer_percent([c.reference for c in clips],
                                              [t["texts"][c.id] for c in clips])
        print(name, "WER", t["corpus_wer_percent"], flush=True)
    refs = [c.reference for c in clips]
    for name, tree in (g.split("=", 1) for g in args.gauge):
        texts = corpus_pass(Path(tree), args.work / f"corpus-{name}", None)["texts"]
        report.setdefault("gauges", {})[name] = {
            "tree": tree, "note": args.gauge_note, "texts": texts,
            "corpus_wer_percent": wer_percent(refs, [texts[c.id] for c in clips]),
            "clips_whose_text_differs": {
                n: sum(texts[c] != report["trees"][n]["texts"][c] for c in texts) for n in trees}}
        print(name, "WER", report["gauges"][name]["corpus_wer_percent"], flush=True)
    base_texts, this_texts = (report["trees"][n]["texts"] for n in ("base", "this"))
    report["corpus_clips"] = len(clips)
    report["clips_whose_text_differs"] = sorted(c for c in this_texts if this_texts[c] != base_texts[c])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
