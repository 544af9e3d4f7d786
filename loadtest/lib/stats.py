"""WER by corpus set, on the project's one scorer (app.client.scoring, shared with ``batchscribe
dataset`` and the tests), and latency statistics (percentiles, p50/p95/max).

Light like loadtest.lib.common: the normaliser and jiwer are imported on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.client.scoring import wer_percent
from loadtest.lib.corpus import READ_SPEECH, Clip


# ---- WER by corpus set ---------------------------------------------------------------------------
def wer_by_group(clips: Sequence[Clip], texts: dict[str, str]) -> dict[str, Any]:
    """WER on read speech (the comparable figure), on the other sets, and overall."""
    groups = {
        "read_speech": [c for c in clips if c.set in READ_SPEECH],
        "other_sets": [c for c in clips if c.set not in READ_SPEECH],
        "all": list(clips),
    }
    out: dict[str, Any] = {}
    for name, members in groups.items():
        scored = [c for c in members if c.id in texts]
        out[name] = {
            "wer_percent": wer_percent([c.reference for c in scored], [texts[c.id] for c in scored]),
            "clips": len(scored),
        }
    return out


# ---- statistics -------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(latencies: Sequence[float]) -> dict[str, Any]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {"n": len(latencies), "p50_s": r(percentile(latencies, 50)),
            "p95_s": r(percentile(latencies, 95)), "max_s": r(max(latencies) if latencies else None)}
