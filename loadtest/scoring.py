"""WER with a Whisper-style normaliser, and latency statistics (percentiles, p50/p95/max).

Light like loadtest.common: the normaliser and jiwer are imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.common import READ_SPEECH, Clip

# ---- WER --------------------------------------------------------------------------------------
_MARKUP = re.compile(r"\[[^\]]*\]|<[^>]*>")  # MFA references carry [adif], <VOCNOISE>


def _builtin_normaliser() -> Callable[[str], str]:
    """Fallback when whisper-normalizer is missing: lower case, no punctuation, no markup.

    It does not rewrite numbers, so absolute WER is higher on clips with numbers than the
    Whisper normaliser gives; comparisons inside one run (service vs sequential) stay valid.
    """
    strip = re.compile(r"[^\w\s']|_")

    def norm(text: str) -> str:
        text = strip.sub(" ", text.lower().replace("-", " "))
        return " ".join(w.strip("'") for w in text.split() if w.strip("'"))

    return norm


def normaliser() -> tuple[str, Callable[[str], str]]:
    try:
        from whisper_normalizer.english import EnglishTextNormalizer
    except ImportError:
        return "builtin", _builtin_normaliser()
    return "whisper_normalizer.english", EnglishTextNormalizer()


_NORM: tuple[str, Callable[[str], str]] | None = None


def normalise(text: str) -> str:
    global _NORM
    if _NORM is None:
        _NORM = normaliser()
    return " ".join(_NORM[1](_MARKUP.sub(" ", text)).split())


def normaliser_name() -> str:
    normalise("")
    assert _NORM is not None
    return _NORM[0]


def wer_percent(references: Sequence[str], hypotheses: Sequence[str]) -> float | None:
    """Corpus-level WER in percent (errors over all reference words), None if nothing to score."""
    import jiwer

    pairs = [(normalise(r), normalise(h)) for r, h in zip(references, hypotheses, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        return None
    return round(100.0 * float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])), 3)


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
