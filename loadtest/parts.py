"""A 20-minute upload split across prep processes against the unsplit one (issue 50 item 3).

    PYTHONPATH=$PWD .venv/bin/python -m loadtest.parts --out loadtest/results/parts.json

Two real services on the same upload (loadtest/lib/split.py: the corpus's read speech in turn,
0.8 s apart, so every clip's reference is known): one reads it whole (no part under an hour),
one in four parts on four prep processes (``--part-s 240``: three seams). The results file
holds both WERs, every seam's neighbouring words in both transcripts and their differences, and
each against the references there. ``--format mp3vbr`` sends it as a VBR MP3 (parts found by
demuxing: MP3's own seek is an estimate).

The issue's check: WER within 0.2 points, no word doubled or lost at a seam. ``targets`` says
whether each held; the WER difference is Whisper's window-grouping noise (loadtest/lib/split.py),
so the seams' neighbourhoods are what shows the split's joins. tests/test_parts_model.py runs
the same comparison on 8 minutes in every test run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.lib.common import machine_info
from loadtest.lib.corpus import load_corpus
from loadtest.lib.feed_audio import encode
from loadtest.lib.service import Server
from loadtest.lib.split import compare, read_speech_upload, seam_holds, seams


def transcribe(url: str, path: Path) -> tuple[dict[str, Any], float]:
    sent = time.monotonic()
    with httpx.Client(base_url=url, timeout=3600) as c, path.open("rb") as f:
        r = c.post("/transcribe", params={"wait": "true"},
                   data={"language": "en", "word_timestamps": "true"},
                   files={"file": (path.name, f)})
    r.raise_for_status()
    return dict(r.json()), time.monotonic() - sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--part-s", type=float, default=240.0, help="prep.part_s of the split service")
    p.add_argument("--format", default="wav16", choices=["wav16", "mp3", "mp3vbr", "flac", "m4a"],
                   help="the upload's format (loadtest/lib/feed_audio.py)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="batchscribe-parts-"))
    upload = work / "long.wav"
    placed = read_speech_upload(load_corpus(), upload, args.minutes)
    if args.format != "wav16":
        from app.audio import decode

        wav, upload = upload, work / f"long-{args.format}.x"
        encode(decode(wav, 3600.0), upload, args.format)
    runs: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, env in (("whole", {"BATCHSCRIBE_PREP__PART_S": "3600"}),
                      ("split", {"BATCHSCRIBE_PREP__WORKERS": str(args.parts),
                                 "BATCHSCRIBE_PREP__PART_S": str(args.part_s)})):
        srv = Server(work / name, env=env).start()
        try:
            results[name], took = transcribe(srv.url, upload)
        finally:
            srv.stop()
        log = srv.log_path.read_text(errors="replace")
        runs[name] = {"env": env, "status": results[name]["status"], "seconds": round(took, 1),
                      "split_logged": f'"parts": {args.parts}' in log}
        print(f"{name}: {results[name]['status']} in {took:.0f} s", flush=True)
    at = seams(upload, args.parts)
    cmp = compare(placed, results["whole"], results["split"], at)
    diff = cmp["wer_split_percent"] - cmp["wer_whole_percent"]
    out = {
        "commit": machine["git"], "clean_tree": machine["git_clean"], "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "upload_s": round(placed[-1][1], 1), "clips": len(placed), "runs": runs, **cmp,
        "targets": {
            "wer_within_0.2_points": abs(diff) <= 0.2,
            "wer_split_minus_whole_points": round(diff, 3),
            "no_word_doubled_or_lost_at_a_seam": all(seam_holds(s) for s in cmp["seams"]),
            "seams": len(at),
        },
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
