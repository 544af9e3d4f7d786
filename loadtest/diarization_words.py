"""Do Whisper's words cover the speech the diarizer misses? (issue 49)

    .venv/bin/python -m loadtest.diarization_words --out loadtest/results/diarization_words.json

The idea checked: a diarize job is always decoded with word timestamps, so words recognised
where no speaker turn is could be evidence of speech the segmentation model called silence
(EN2003a's quiet speaker, EN2006a's 2.6 s heard by no window), and become turns of the nearest
speaker. Before building that into ``app/speakers``, this measures whether the words are there.

Every recording of ``tests/data/diarization`` (``--split``, the tuning split by default), and
its excerpts of ``--excerpt-s`` seconds (hop: half; the reference cropped alike), is posted to a
real ``python -m app`` as a user would (``diarize=true``, ``word_timestamps=true``, no
language). On the result's own turns and words, per recording, on 10 ms frames, scored frames
only (outside der.py's 0.25 s collar around every reference boundary):

- ``missed_s``: reference speech where no turn is (the miss words could recover; the rest of
  der.py's miss is overlap, a second speaker under a turn, which a word cannot signal);
- ``missed_in_words_s``: of that, the part inside some word's [start, end];
- ``missed_heard_by_vad_s``: of that, the part the service's Silero VAD (its own settings, so
  what reached Whisper) calls speech;
- ``words_outside_turns_s`` and ``..._not_speech_s``: word time where no turn is, and the part
  of it that is no reference speech (what turning words into speech would add as false alarm).

And der.py's DER (0.25 s collar, overlap scored) of the turns as they are and of the turns with
words added as turns of the word's speaker (the nearest turn's, as ``assign_speakers`` names it):
every word; words capped at ``CAP_S`` (Whisper's word ends run long); capped, probability >=
``MIN_P``. Totals are time-weighted per set (recordings, each excerpt length).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.diarization import DEFAULT_CORPUS, git_state, load_der, manifest
from loadtest.lib.common import ROOT, machine_info

DATASET = ROOT / "tests" / "data" / "diarization"
FRAME_S = 0.01  # der.py's resolution
COLLAR_S = 0.25  # der.py's primary setting
CAP_S = 0.5  # a word's span at most this long in the capped variants
MIN_P = 0.5  # ... and at least this probability in the last one
TIMEOUT_S = 900.0

Span = tuple[float, float]
Labelled = tuple[float, float, str]


def frames(spans: Iterable[Sequence[Any]], n: int) -> np.ndarray:
    """(n,) bool: the 10 ms frames inside any of ``spans`` ((start, end, ...) in seconds)."""
    m = np.zeros(n, dtype=bool)
    for s in spans:
        a, b = max(0, round(float(s[0]) / FRAME_S)), round(float(s[1]) / FRAME_S)
        m[a:b] = True
    return m


def scored(ref: Sequence[Labelled], n: int, collar: float = COLLAR_S) -> np.ndarray:
    """(n,) bool: frames der.py scores (none within ``collar`` of a reference boundary)."""
    out = np.ones(n, dtype=bool)
    for s, e, _ in ref:
        for b in (s, e):
            out[max(0, round((b - collar) / FRAME_S)): max(0, round((b + collar) / FRAME_S))] = False
    return out


def coverage(ref: Sequence[Labelled], turns: Sequence[Labelled], words: Sequence[dict[str, Any]],
             duration: float, vad: Sequence[Span] = ()) -> dict[str, float]:
    """Seconds (scored frames) of reference speech where no turn is, and how much of it words
    and the VAD cover; word time outside the turns, and how much of it is no speech."""
    n = int(np.ceil(duration / FRAME_S)) + 1
    speech, hyp, ok = frames(ref, n), frames(turns, n), scored(ref, n)
    said = frames([(w["start"], w["end"]) for w in words], n)
    missed = speech & ~hyp & ok
    outside = said & ~hyp & ok
    out = {"reference_s": float(speech.sum()), "missed_s": float(missed.sum()),
           "missed_in_words_s": float((missed & said).sum()),
           "missed_heard_by_vad_s": float((missed & frames(vad, n)).sum()),
           "words_outside_turns_s": float(outside.sum()),
           "words_outside_turns_not_speech_s": float((outside & ~speech).sum())}
    return {k: round(v * FRAME_S, 2) for k, v in out.items()}


def with_words(turns: Sequence[Labelled], words: Sequence[dict[str, Any]], cap: float | None,
               min_p: float = 0.0) -> list[Labelled]:
    """``turns`` plus every word as a turn of its ``speaker`` ([start, min(end, start + cap)]),
    words under ``min_p`` (or without a speaker or a span) left out."""
    out = [(float(s), float(e), str(k)) for s, e, k in turns]
    for w in words:
        s, e = float(w["start"]), float(w["end"])
        if cap is not None:
            e = min(e, s + cap)
        p = w.get("probability")
        if e > s and w.get("speaker") and (p is None or p >= min_p):
            out.append((s, e, str(w["speaker"])))
    return sorted(out)


VARIANTS = {"turns": None, "turns+words": (None, 0.0), f"turns+words<={CAP_S}s": (CAP_S, 0.0),
            f"turns+words<={CAP_S}s,p>={MIN_P}": (CAP_S, MIN_P)}


def analyse(der: Any, item: dict[str, Any], result: dict[str, Any], vad: Sequence[Span]
            ) -> dict[str, Any]:
    """One recording's coverage and the DER of each variant."""
    turns = [(float(t["start"]), float(t["end"]), str(t["speaker"])) for t in result["turns"]]
    words = result.get("words") or []
    row: dict[str, Any] = {"id": item["id"], "split": item.get("split", ""),
                           **coverage(item["ref"], turns, words, item["duration_s"], vad),
                           "der": {}}
    for name, how in VARIANTS.items():
        hyp = turns if how is None else with_words(turns, words, *how)
        r = der.der(item["ref"], hyp, COLLAR_S, False, item["duration_s"])
        row["der"][name] = {k: round(float(r[k]), 3) for k in ("der", "total", "miss",
                                                                "false_alarm", "confusion")}
    return row


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Coverage seconds summed, DER time-weighted, over ``rows``."""
    keys = [k for k, v in rows[0].items() if k.endswith("_s") and isinstance(v, float)]
    out: dict[str, Any] = {"recordings": len(rows),
                           **{k: round(sum(r[k] for r in rows), 2) for k in keys}}
    for name in VARIANTS:
        d = [r["der"][name] for r in rows]
        total = sum(x["total"] for x in d)
        parts = {k: round(sum(x[k] for x in d), 2) for k in ("miss", "false_alarm", "confusion")}
        out[name] = {"der": round(sum(parts.values()) / total, 4), **parts}
    return out


def run_service(items: Sequence[dict[str, Any]], folder: Path) -> dict[str, dict[str, Any]]:
    """Every item (``id``, ``path``) through one real service: {id: the job's result}."""
    import httpx

    from loadtest.lib.service import Server

    server = Server(folder / "server").start()
    out: dict[str, dict[str, Any]] = {}
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
            for m in items:
                with Path(m["path"]).open("rb") as f:
                    r = client.post("/transcribe", params={"wait": "true"},
                                    data={"diarize": "true", "word_timestamps": "true"},
                                    files={"file": (Path(m["path"]).name, f)})
                r.raise_for_status()
                job = r.json()
                if job["status"] != "done":
                    raise RuntimeError(f"{m['id']}: job {job['status']}: {job.get('error')}")
                out[m["id"]] = job["result"]
    finally:
        server.stop()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.diarization_words", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", type=Path, default=DATASET)
    p.add_argument("--scorer", type=Path, default=DEFAULT_CORPUS,
                   help="folder holding der.py (the shared diarization corpus)")
    p.add_argument("--split", choices=("tune", "heldout", "all"), default="tune")
    p.add_argument("--excerpt-s", default="15,20",
                   help="also excerpts this long, comma-separated (hop: half); '' for none")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from app.audio import decode
    from app.audio.vad import SileroVad
    from loadtest.lib.diarization_users import excerpts

    der = load_der(args.scorer)
    items = [m for m in manifest(args.dataset) if args.split in ("all", m["split"])]
    for m in items:
        m["path"] = args.dataset / m["file"]
        m["audio"] = decode(m["path"], 4 * 3600)
        m["ref"] = der.load_rttm(str(args.dataset / m["rttm"])).get(m["id"], [])
    lengths = [float(x) for x in args.excerpt_s.split(",") if x.strip()]
    vad = SileroVad()
    report: dict[str, Any] = {"what": __doc__.split("\n")[0], "git": git_state(),
                              "machine": machine_info(), "split": args.split,
                              "collar_s": COLLAR_S, "sets": {}}
    with tempfile.TemporaryDirectory(prefix="diarization-words-") as tmp:
        sets = {"recordings": items}
        for length in lengths:
            sets[f"excerpts_{length:g}s"] = excerpts(items, length, Path(tmp))
        everything = [m for group in sets.values() for m in group]
        results = run_service(everything, Path(tmp))
        for name, group in sets.items():
            rows = []
            for m in group:
                audio = m.get("audio")
                if audio is None:
                    audio = decode(m["path"], 4 * 3600)
                row = analyse(der, m, results[m["id"]], vad.speech(audio))
                row["split"] = m.get("split") or m["id"].split("@")[0]
                rows.append(row)
            report["sets"][name] = {"per_recording": rows, "total": totals(rows)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, s in report["sets"].items():
        print(f"== {name}")
        for r in s["per_recording"] + [{"id": "TOTAL", **s["total"]}]:
            ders = " ".join(f"{k} {100 * (r['der'][k] if 'der' in r else r[k])['der']:.1f}"
                            for k in VARIANTS)
            print(f"{r['id']:34s} missed {r['missed_s']:5.2f} in words "
                  f"{r['missed_in_words_s']:4.2f} vad {r['missed_heard_by_vad_s']:4.2f} | words "
                  f"outside turns {r['words_outside_turns_s']:4.2f} (no speech "
                  f"{r['words_outside_turns_not_speech_s']:4.2f}) | DER % {ders}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
