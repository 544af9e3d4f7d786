"""What semantic_vad's judge sees: the read of a turn up to each pause, on the corpus clips.

Each clip (up to 60 s, with 1 s of silence before and 2.5 s after) goes through the live
turn detector at OpenAI's server_vad defaults, pause edges at 200 ms of quiet (the service's
``early_final_ms``). At every pause the turn so far is read as the session's early final
reads it (whisper-base, no language, 3 s pad margin), and
:func:`app.live.turns.sounds_finished` judges the text. Each pause is counted by what it was:

* ``split``: server_vad's 500 ms ended the turn there and the clip's speech went on after;
  semantic_vad keeps the turn open where the read is left open;
* ``end``: the clip's last pause (its speech is over); a read left open there makes the turn
  wait for eagerness's timeout;
* ``short``: speech came back before server_vad's 500 ms (one turn either way).

    python -m loadtest.live_pauses [--out loadtest/results/live-pauses.json]

In-process on this machine's CPU (one thread): under a minute for the 81 clips.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib.common import machine_info
from loadtest.lib.corpus import load_corpus


def pauses(audio: np.ndarray, turns: Any) -> list[tuple[int, int, str]]:
    """(turn start, pause, kind) for each pause edge: kind as in the module doc."""
    edges = []
    for i in range(0, audio.size, 1600):  # the bench's 100 ms appends
        edges += turns.feed(audio[i:i + 1600])
    out, start = [], 0
    for k, e in enumerate(edges):
        if e.kind == "start":
            start = e.at
        elif e.kind == "pause":
            after = [x.kind for x in edges[k + 1:] if x.kind in ("resume", "stop", "start")]
            kind = "short" if after[:1] == ["resume"] else "split" if "start" in after else "end"
            out.append((start, e.at, kind))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/live-pauses.json"))
    ap.add_argument("--language", default=None, help="what the client says (default: none)")
    args = ap.parse_args()
    from app.audio import decode
    from app.audio.vad import SileroVad
    from app.config import ModelSettings, Settings
    from app.engine.whisper import WhisperEngine
    from app.live.decoding import LiveOptions
    from app.live.turns import SileroTurns, VadRules, sounds_finished
    from app.windows import SAMPLE_RATE, DecodeOptions
    from models.registry import resolve

    s = Settings()
    engine = WhisperEngine(resolve(s.model.name, s.model.cache_dir, True),
                           ModelSettings(num_workers=1, cpu_threads=1), s.model.name)
    vad, rules = SileroVad(), VadRules(0.5, 300, 500, 29.5, early_final_ms=200)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for c in load_corpus():
        if c.duration_s > 60 or c.set == "commonvoice_single_word":
            continue
        audio = np.concatenate([np.zeros(SAMPLE_RATE, np.float32), decode(c.path, 120.0),
                                np.zeros(SAMPLE_RATE * 5 // 2, np.float32)])
        for start, at, kind in pauses(audio, SileroTurns(vad.probability_stream(), rules)):
            [r] = engine.transcribe_batch([LiveOptions(args.language).window(audio[start:at], 3.0)],
                                          DecodeOptions())
            rows.append({"clip": c.id, "set": c.set, "pause_s": round(at / SAMPLE_RATE, 2),
                         "kind": kind, "text": r.text.strip(),
                         "finished": sounds_finished(r.text)})
    engine.close()
    counts = Counter((r["kind"], "finished" if r["finished"] else "open") for r in rows)
    summary = {kind: {"pauses": counts[(kind, "finished")] + counts[(kind, "open")],
                      "read_open": counts[(kind, "open")]} for kind in ("split", "end", "short")}
    machine = machine_info()
    args.out.write_text(json.dumps({
        "commit": machine["git"], "clean_tree": machine["git_clean"], "machine": machine,
        "language": args.language,
        "seconds": round(time.monotonic() - t0), "summary": summary, "pauses": rows},
        indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
