"""The project's one scorer: WER (or CER) with a Whisper-style normaliser, named in every result.

Used by ``batchscribe dataset`` (per utterance and over a manifest), the benchmarks
(loadtest.scoring) and the tests (tests/wer.py), so a WER means the same thing everywhere.
Light: jiwer and the normalisers are imported on first use, nothing of the service is.

* English: whisper_normalizer's ``EnglishTextNormalizer`` (Whisper's own: lower case, no
  punctuation, numbers and spellings made consistent), after stripping ``[..]`` / ``<..>``
  markup (MFA references carry ``[adif]``, ``<VOCNOISE>``).
* Other languages: Whisper's ``BasicTextNormalizer`` (lower case, no punctuation or symbols).
* Chinese, Japanese, Korean (and Cantonese): CER, not WER: their text has no spaces between
  words, so a "word" would be a whole sentence. Spaces are removed before counting characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_MARKUP = re.compile(r"\[[^\]]*\]|<[^>]*>")
CER_LANGUAGES = frozenset({"zh", "ja", "ko", "yue"})
Normaliser = Callable[[str], str]


def _builtin_normaliser() -> Normaliser:
    """Fallback when whisper-normalizer is missing: lower case, no punctuation, no markup.

    It does not rewrite numbers, so absolute WER is higher on clips with numbers than the
    Whisper normaliser gives; comparisons inside one run (service vs sequential) stay valid.
    """
    strip = re.compile(r"[^\w\s']|_")

    def norm(text: str) -> str:
        text = strip.sub(" ", text.lower().replace("-", " "))
        return " ".join(w.strip("'") for w in text.split() if w.strip("'"))

    return norm


def _make(kind: str) -> tuple[str, Normaliser]:
    try:
        if kind == "english":
            from whisper_normalizer.english import EnglishTextNormalizer

            return "whisper_normalizer.english", EnglishTextNormalizer()
        from whisper_normalizer.basic import BasicTextNormalizer

        return "whisper_normalizer.basic", BasicTextNormalizer()
    except ImportError:
        return "builtin", _builtin_normaliser()


_NORMS: dict[str, tuple[str, Normaliser]] = {}


def _norm(kind: str) -> tuple[str, Normaliser]:
    if kind not in _NORMS:
        _NORMS[kind] = _make(kind)
    return _NORMS[kind]


def kind_of(language: str | None) -> str:
    """``english`` for en or an unknown language (the corpus and most datasets), else ``basic``."""
    return "english" if (language or "en").lower() in ("en", "english") else "basic"


def normalise(text: str, language: str | None = None) -> str:
    norm = _norm(kind_of(language))[1]
    return " ".join(norm(_MARKUP.sub(" ", text)).split())


def normaliser_name(language: str | None = None) -> str:
    return _norm(kind_of(language))[0]


def wer_percent(references: Sequence[str], hypotheses: Sequence[str]) -> float | None:
    """Corpus-level English WER in percent (errors over all reference words), None if nothing
    to score. The benchmarks' and the tests' figure."""
    import jiwer

    pairs = [(normalise(r), normalise(h)) for r, h in zip(references, hypotheses, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        return None
    return round(100.0 * float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])), 3)


@dataclass(frozen=True)
class Score:
    """One utterance: ``errors`` (substitutions + deletions + insertions) over ``units``
    reference words (or characters, for ``metric == "cer"``)."""

    metric: str  # "wer" | "cer"
    errors: int
    units: int
    normaliser: str

    @property
    def percent(self) -> float:
        return round(100.0 * (self.errors / self.units), 3)  # jiwer's order of operations


def score(reference: str, hypothesis: str, language: str | None) -> Score | None:
    """The utterance's WER (CER for zh/ja/ko/yue); None when the normalised reference is empty.

    For English this is exactly :func:`wer_percent` of the one pair."""
    import jiwer

    lang = (language or "").lower()
    ref, hyp = normalise(reference, lang), normalise(hypothesis, lang)
    name = normaliser_name(lang)
    if lang in CER_LANGUAGES:
        ref, hyp = ref.replace(" ", ""), hyp.replace(" ", "")
        if not ref:
            return None
        chars = jiwer.process_characters(ref, hyp)
        return Score("cer", chars.substitutions + chars.deletions + chars.insertions, len(ref), name)
    if not ref:
        return None
    words = jiwer.process_words(ref, hyp)
    return Score("wer", words.substitutions + words.deletions + words.insertions,
                 len(ref.split()), name)


@dataclass
class Total:
    """Corpus-level figure of one metric and normaliser: errors over all reference units (the
    figure papers report), not a mean of per-utterance rates."""

    metric: str
    normaliser: str
    utterances: int = 0
    errors: int = 0
    units: int = 0

    @property
    def percent(self) -> float | None:
        return round(100.0 * (self.errors / self.units), 3) if self.units else None

    def as_dict(self) -> dict[str, object]:
        return {"metric": self.metric, "normaliser": self.normaliser, "percent": self.percent,
                "utterances": self.utterances, "errors": self.errors, "units": self.units}


def total(scores: Sequence[Score]) -> list[Total]:
    """One :class:`Total` per (metric, normaliser) among ``scores``."""
    out: dict[tuple[str, str], Total] = {}
    for s in scores:
        t = out.setdefault((s.metric, s.normaliser), Total(s.metric, s.normaliser))
        t.utterances += 1
        t.errors += s.errors
        t.units += s.units
    return list(out.values())
