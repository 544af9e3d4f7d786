"""Word error rate for the tests: the project's one scorer (app.client.scoring), as a fraction."""

from __future__ import annotations

from app.client.scoring import normalise, wer_percent

__all__ = ["normalise", "wer"]


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus-level WER (errors over all reference words), the figure papers report."""
    percent = wer_percent(references, hypotheses)
    if percent is None:
        raise ValueError("no reference words to score against")
    return percent / 100.0
