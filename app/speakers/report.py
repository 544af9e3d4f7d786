"""What a diarized result says about its speakers beyond the segments: the turns themselves (in
the JSON and as RTTM), whether the caller's speaker count was met, and how sure each name is.

The diarizer answers with :class:`SpeakerTurns`: its turns (a ``list[Turn]``, so everything that
takes turns takes it) carrying what the result must report and only the stream knows: the
bounds it was held to, how much speech it had to cluster, and the named-speaker matches. It
travels from the stream through the job's work (app/jobs/work.py) to
:func:`app.speakers.assign.assign_speakers` unchanged. The result's turns are rendered as RTTM
by app/results/formats.py (``to_rttm``).

Why say when a count was not met: ``num_speakers`` is a constraint, and the clustering honours
it, but it can only group the 1.5 s crops of speech it has: 4 speakers asked of 2 s of speech
(two crops) cannot be 4. The result then says so (``diarization.met`` false, and why) instead
of quietly answering with fewer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.speakers.cluster import SpeakerBounds
from app.speakers.turns import Turn


@dataclass(frozen=True)
class NameMatch:
    """One known speaker's reference against the recording's speakers."""

    name: str
    speaker: str | None  # the diarized speaker it names (None: no speaker similar enough)
    similarity: float  # cosine of the reference's voice and the best speaker's, -1..1
    threshold: float

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "matched": self.speaker is not None,
                "similarity": round(self.similarity, 3), "threshold": self.threshold}


class SpeakerTurns(list[Turn]):
    """Turns, and what the stream knows about them (see the module's docstring)."""

    def __init__(self, turns: Iterable[Turn] = (), bounds: SpeakerBounds | None = None,
                 crops: int = 0, speech_s: float = 0.0, names: Sequence[NameMatch] = ()) -> None:
        super().__init__(turns)
        self.bounds = bounds or SpeakerBounds()
        self.crops = crops  # 1.5 s crops the clustering had
        self.speech_s = speech_s  # seconds of speech they were cut from
        self.names = list(names)


def count_report(turns: Sequence[Turn]) -> dict[str, Any]:
    """``diarization`` of a result: speakers found, the bounds asked, met or not and why."""
    found = len({t.speaker for t in turns})
    out: dict[str, Any] = {"speakers": found}
    b = turns.bounds if isinstance(turns, SpeakerTurns) else SpeakerBounds()
    asked = {k: v for k, v in (("num_speakers", b.num_speakers), ("min_speakers", b.min_speakers),
                               ("max_speakers", b.max_speakers)) if v is not None}
    if asked:
        lo = b.num_speakers or b.min_speakers or 1
        hi = b.num_speakers or b.max_speakers or found
        out["asked"] = asked
        out["met"] = lo <= found <= hi
        if not out["met"]:
            crops = turns.crops if isinstance(turns, SpeakerTurns) else 0
            speech = turns.speech_s if isinstance(turns, SpeakerTurns) else 0.0
            what = ", ".join(f"{k}={v}" for k, v in asked.items())
            why = (f"only {crops} crop(s) of 1.5 s in {speech:.1f} s of speech, and each speaker "
                   "needs one" if crops < lo else "the other groups had no speech of their own")
            out["note"] = (f"{what} was asked, but the audio supports {found} speaker(s): {why}")
    if isinstance(turns, SpeakerTurns) and turns.names:
        out["known_speakers"] = [m.public() for m in turns.names]
    return out


def turn_dicts(turns: Sequence[Turn], rename: dict[str, str]) -> list[dict[str, Any]]:
    return [{"start": round(t.start, 3), "end": round(t.end, 3),
             "speaker": rename.get(t.speaker, t.speaker)} for t in sorted(turns)]
