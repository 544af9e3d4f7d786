"""Word error rate with a Whisper-style English normaliser on both sides."""

from __future__ import annotations

import re

import jiwer
from whisper_normalizer.english import EnglishTextNormalizer

_normalise = EnglishTextNormalizer()
_MARKUP = re.compile(r"\[[^\]]*\]|<[^>]*>")  # MFA references carry [adif], <VOCNOISE>


def normalise(text: str) -> str:
    return " ".join(_normalise(_MARKUP.sub(" ", text)).split())


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus-level WER (errors over all reference words), the figure papers report."""
    pairs = [(normalise(r), normalise(h)) for r, h in zip(references, hypotheses, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))
