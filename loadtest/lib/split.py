"""A long upload read whole and read split across prep processes (issue 50 item 3): the upload,
the seams as the service finds them, and the comparison of the two transcripts.

Used by ``loadtest/parts.py`` (the issue's 20-minute check, a results file) and by
``tests/test_parts_model.py`` (the same comparison on 8 minutes in every test run).

The upload is the corpus's read speech in turn with 0.8 s of silence between clips, so every
clip's place and reference are known. Two figures:

* **At the seams**: the words within 4 s of each seam, in the whole and the split transcript:
  insertions and deletions between them (a word may be spelled differently: its window differs);
  and each transcript against the references of the clips within 4 s of the seam. A word lost
  or read twice at a seam is a deletion or insertion against the reference that the whole has
  not; a window that starts elsewhere can also read a word better: on an 8-minute MP3 the whole
  read "we desire and crease" where the split read the reference's "we desire increase".
  ``normalise`` expands "world's" to "world is", so "world's dew" against "worlds due" counts a
  deletion (6 minutes in 90 s parts, the seam at 294.8 s: a spelling, no word lost). A word
  count at a seam is Whisper's reading of different windows; the windows' samples are checked
  exactly in tests/test_parts.py.
* **Overall**: both transcripts' WER against the references. Every window after a seam groups
  speech differently (the cutter starts again there), and a grouping can make Whisper stop early
  or read a word differently anywhere in the upload: on 20 minutes the whole read 7.51 % against
  the split's 5.41 % (one unsplit window read 9 words of 71 and ended), on 8 minutes 5.04 %
  against 5.38 % (4 words of 1152, all away from the seams). The difference is that noise, not
  the seams; a part lost or read twice moves it by whole windows (~80 words of read speech each).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jiwer
import numpy as np

from app.audio import decode
from app.audio.parts import Part, PartStream, plan, splittable
from app.audio.vad import SileroVad
from app.client.scoring import normalise, wer_percent
from app.windows import SAMPLE_RATE, Window
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import READ_SPEECH, Clip

GAP_S = 0.8
SEAM_S = 4.0  # words this close to a seam are compared one by one
# Its audio is utterance -0001 ("NOR IS MISTER QUILTER'S MANNER..."), not the reference's -0000.
MISLABELLED = {"librispeech-1272-128104-0000"}
Placed = list[tuple[float, float, str]]  # (start, end, reference) of each clip in the upload


def read_speech_upload(clips: Sequence[Clip], path: Path, minutes: float) -> Placed:
    """The corpus's read speech in turn (0.8 s apart) to ``minutes``, as a 16 kHz WAV."""
    read = [c for c in clips if c.set in (*READ_SPEECH, "librivox_long")
            and c.id not in MISLABELLED]
    gap = np.zeros(int(GAP_S * SAMPLE_RATE), np.float32)
    parts: list[np.ndarray] = []
    placed: Placed = []
    at, i = 0, 0
    while at < minutes * 60 * SAMPLE_RATE:
        c = read[i % len(read)]
        a = decode(c.path, 3600.0)
        placed.append((at / SAMPLE_RATE, (at + a.size) / SAMPLE_RATE, c.reference))
        parts += [a, gap]
        at += a.size + gap.size
        i += 1
    write_wav16(path, np.concatenate(parts), SAMPLE_RATE)
    return placed


def side_by_side(path: Path, vad: SileroVad, parts: list[Part]) -> tuple[list[Window],
                                                                          list[PartStream]]:
    """Every part stepped in turn, each part's seam relayed to the part before it (as
    app/audio/procs/feed.py does across processes)."""
    streams = [PartStream(path, vad, 7200.0, 60.0, p) for p in parts]
    out: list[list[Window]] = [[] for _ in parts]
    while not all(s.done for s in streams):
        for k, s in enumerate(streams):
            if not s.done and not s.waiting:
                out[k] += s.read_chunk().windows
        for j in range(len(streams) - 1):
            if streams[j].end_known:
                continue
            m = j + 1
            while m < len(streams) and streams[m].seam == -1:
                m += 1
            if m == len(streams):
                streams[j].stop_at(None)
            elif streams[m].seam is not None:
                streams[j].stop_at(streams[m].seam)
    return [w for ws in out for w in ws], streams


def seams(path: Path, parts: int) -> list[float]:
    """Where the service splits ``path`` into ``parts`` (the same search, run here), seconds."""
    duration = splittable(path)
    assert duration is not None, f"{path} is not splittable"
    _, streams = side_by_side(path, SileroVad(), plan(duration, parts))
    return [s.seam / SAMPLE_RATE for s in streams[1:] if s.seam]


def words_in(result: dict[str, Any], start: float, end: float) -> str:
    return " ".join(w["word"] for w in result["result"]["words"]
                    if start <= (w["start"] + w["end"]) / 2 < end)


def differences(whole: dict[str, Any], split: dict[str, Any],
                at: Sequence[float]) -> list[dict[str, Any]]:
    """Where the two transcripts' words differ (lower case, punctuation stripped): the whole
    one's time there, both readings, and how far the nearest seam is."""
    def words(result: dict[str, Any]) -> list[tuple[str, float]]:
        out = []
        for w in result["result"]["words"]:
            text = "".join(ch for ch in w["word"].lower() if ch.isalnum() or ch == "'")
            if text:
                out.append((text, float(w["start"])))
        return out

    a, b = words(whole), words(split)
    ops = difflib.SequenceMatcher(None, [w for w, _ in a], [w for w, _ in b], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in ops.get_opcodes():
        if tag == "equal":
            continue
        t = a[i1][1] if i1 < len(a) else a[-1][1]
        out.append({"at_s": round(t, 2), "whole": " ".join(w for w, _ in a[i1:i2]),
                    "split": " ".join(w for w, _ in b[j1:j2]),
                    "nearest_seam_s": round(min((abs(t - x) for x in at), default=0.0), 1)})
    return out


def seam_holds(seam: dict[str, Any]) -> bool:
    """No word lost or read twice at a seam (one of :func:`compare`'s ``seams``): the words
    near it are the same in both transcripts, or the split has no more insertions and no more
    deletions against the reference than the whole."""
    if seam["insertions"] == seam["deletions"] == 0:
        return True
    ours, theirs = seam["against_reference"]["split"], seam["against_reference"]["whole"]
    return bool(ours["insertions"] <= theirs["insertions"]
                and ours["deletions"] <= theirs["deletions"])


def compare(placed: Placed, whole: dict[str, Any], split: dict[str, Any],
            at: Sequence[float]) -> dict[str, Any]:
    """Both transcripts' WER (percent) and, per seam, the words near it: their differences, and
    each transcript's insertions and deletions against the references of the clips there."""
    refs = " ".join(r for _, _, r in placed)
    near = []
    for seam in at:
        a = normalise(words_in(whole, seam - SEAM_S, seam + SEAM_S))
        b = normalise(words_in(split, seam - SEAM_S, seam + SEAM_S))
        diff = jiwer.process_words(a or "-", b or "-")
        around = [(s, e, r) for s, e, r in placed if s < seam + SEAM_S and e > seam - SEAM_S]
        lo, hi = around[0][0] - GAP_S / 2, around[-1][1] + GAP_S / 2
        ref = normalise(" ".join(r for _, _, r in around))
        vs_ref = {}
        for name, result in (("whole", whole), ("split", split)):
            d = jiwer.process_words(ref, normalise(words_in(result, lo, hi)) or "-")
            vs_ref[name] = {"insertions": d.insertions, "deletions": d.deletions,
                            "substitutions": d.substitutions}
        near.append({"seam_s": round(seam, 2), "whole": a, "split": b,
                     "insertions": diff.insertions, "deletions": diff.deletions,
                     "substitutions": diff.substitutions, "clips_s": [round(lo, 2), round(hi, 2)],
                     "against_reference": vs_ref})
    return {"reference_words": len(refs.split()),
            "wer_whole_percent": wer_percent([refs], [whole["result"]["text"]]),
            "wer_split_percent": wer_percent([refs], [split["result"]["text"]]),
            "seams": near, "differences": differences(whole, split, at)}
