"""DER of what ``diarize=true`` gives users, through the real service: its turns (``GET
/jobs/{id}/result?format=rttm``) and its segments' speakers, scored alike: all segments
(what the JSON gives: the speaker timeline, with empty text where no words were recognised)
and those with text only (what subtitles and OpenAI's ``diarized_json`` show).

Part of ``python -m loadtest.diarization`` (``--no-service`` skips it). A real ``python -m app``
is started (the models of the environment: whisper-base here, the speaker models on CPU); every
recording is posted as a user would (``POST /transcribe?wait=true``, ``diarize=true``, no
language given), and so are its excerpts of ``--excerpt-s`` seconds (hop: half of that; the
reference cropped alike): short excerpts of 2-4 speakers are where the clustering used to
collapse to one speaker, so they are the cross-check for recordings nobody here has. Scoring
is the corpus's ``der.py`` (0.25 s collar, overlap scored, time-weighted, as the main bench).
A recording "collapsed" when the reference has 3+ speakers of >= 1 s and the answer one.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from loadtest.lib.common import write_wav16
from loadtest.lib.service import Server

SAMPLE_RATE = 16_000
TIMEOUT_S = 900.0


def excerpts(items: list[dict[str, Any]], length_s: float, folder: Path) -> list[dict[str, Any]]:
    """Excerpts of ``length_s`` every ``length_s / 2`` of each recording, written as WAV."""
    out: list[dict[str, Any]] = []
    if length_s <= 0:
        return out
    for m in items:
        start = 0.0
        while start + length_s <= float(m["duration_s"]) + 1e-6:
            end = start + length_s
            uri = f"{m['id']}@{start:g}-{end:g}"
            path = folder / f"{uri}.wav"
            write_wav16(path, m["audio"][int(start * SAMPLE_RATE): int(end * SAMPLE_RATE)])
            ref = [(max(s, start) - start, min(e, end) - start, k) for s, e, k in m["ref"]
                   if min(e, end) > max(s, start)]
            out.append({"id": uri, "path": path, "duration_s": length_s, "ref": ref})
            start += length_s / 2
    return out


Answer = tuple[list[Any], list[Any], list[Any], dict[str, Any]]


def diarize(client: httpx.Client, path: Path) -> Answer:
    """(turns from the RTTM, segments' (start, end, speaker), those with text, the result's
    diarization)."""
    with path.open("rb") as f:
        r = client.post("/transcribe", params={"wait": "true"}, data={"diarize": "true"},
                        files={"file": (path.name, f)})
    r.raise_for_status()
    job = r.json()
    if job["status"] != "done":
        raise RuntimeError(f"{path.name}: job {job['status']}: {job.get('error')}")
    rttm = client.get(f"/jobs/{job['id']}/result", params={"format": "rttm"})
    rttm.raise_for_status()
    turns = [(float(p[3]), float(p[3]) + float(p[4]), p[7])
             for p in (line.split() for line in rttm.text.splitlines())]
    result = job["result"]
    named = [s for s in result["segments"] if s.get("speaker")]
    segments = [(float(s["start"]), float(s["end"]), s["speaker"]) for s in named]
    texts = [(float(s["start"]), float(s["end"]), s["speaker"]) for s in named if s["text"]]
    return turns, segments, texts, result.get("diarization") or {}


def collapsed(ref: list[Any], hyp: list[Any]) -> bool:
    time: Counter[str] = Counter()
    for s, e, k in ref:
        time[k] += e - s
    return sum(v >= 1.0 for v in time.values()) >= 3 and len({k for *_, k in hyp}) <= 1


def score_set(der: ModuleType, items: list[dict[str, Any]], hyps: dict[str, list[Any]]
              ) -> dict[str, Any]:
    """der.py at 0.25 s collar, overlap scored: per recording and the time-weighted total."""
    per, tot = {}, {"total": 0.0, "miss": 0.0, "false_alarm": 0.0, "confusion": 0.0}
    for m in items:
        r = der.der(m["ref"], hyps[m["id"]], 0.25, False, float(m["duration_s"]))
        per[m["id"]] = {k: round(float(v), 4) for k, v in r.items()}
        for k in tot:
            tot[k] += float(r[k])
    errors = tot["miss"] + tot["false_alarm"] + tot["confusion"]
    return {"per_recording": per, "der": round(errors / tot["total"], 4) if tot["total"] else None,
            "collapsed": sorted(m["id"] for m in items if collapsed(m["ref"], hyps[m["id"]]))}


def run(der: ModuleType, items: list[dict[str, Any]], excerpt_s: float, rttm_dir: Path,
        env: dict[str, str] | None = None) -> dict[str, Any]:
    """Both sets through one service; ``items`` need ``id``, ``audio``, ``ref``, ``file``."""
    with tempfile.TemporaryDirectory(prefix="diarization-users-") as tmp:
        folder = Path(tmp)
        full = [{**m, "path": Path(m["path"])} for m in items]
        parts = excerpts(items, excerpt_s, folder)
        server = Server(folder / "server", env=env or {}).start()
        answers: dict[str, Answer] = {}
        try:
            with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
                for m in full + parts:
                    answers[m["id"]] = diarize(client, m["path"])
        finally:
            server.stop()
    (rttm_dir / "segments").mkdir(parents=True, exist_ok=True)
    for m in full:
        turns, segments, _, _ = answers[m["id"]]
        for path, rows in ((rttm_dir / f"{m['id']}.rttm", turns),
                           (rttm_dir / "segments" / f"{m['id']}.rttm", segments)):
            path.write_text("".join(f"SPEAKER {m['id']} 1 {s:.3f} {e - s:.3f} <NA> <NA> {k} "
                                    "<NA> <NA>\n" for s, e, k in rows))
    out: dict[str, Any] = {}
    for name, group in (("recordings", full), (f"excerpts_{excerpt_s:g}s", parts)):
        if not group:
            continue
        out[name] = {
            "turns": score_set(der, group, {i: a[0] for i, a in answers.items()}),
            "segments": score_set(der, group, {i: a[1] for i, a in answers.items()}),
            "segments_with_text": score_set(der, group, {i: a[2] for i, a in answers.items()}),
            "speakers": {m["id"]: {"reference": len({k for *_, k in m["ref"]}),
                                   "turns": len({k for *_, k in answers[m["id"]][0]}),
                                   "segments": len({k for *_, k in answers[m["id"]][1]})}
                         for m in group},
        }
    return out


def summary(res: dict[str, Any]) -> str:
    lines = []
    for name, r in res.items():
        per = ", ".join(f"{i} {100 * r['turns']['per_recording'][i]['der']:.1f}/"
                        f"{100 * r['segments']['per_recording'][i]['der']:.1f}"
                        for i in r["turns"]["per_recording"])
        lines.append(f"as users get it, {name}: turns {100 * r['turns']['der']:.2f}%, segments "
                     f"{100 * r['segments']['der']:.2f}% (with text: "
                     f"{100 * r['segments_with_text']['der']:.2f}%), collapsed "
                     f"{json.dumps(r['turns']['collapsed'])} (turns/segments: {per})")
    return "\n".join(lines)
