"""The project's one scorer: WER (or CER) with a named normaliser, and chrF/BLEU for
translations.

Used by ``batchscribe dataset`` (per utterance and over a manifest), the benchmarks (loadtest:
WER by corpus set, the multilingual harness's per-language tables) and the tests (tests/wer.py),
so a WER means the same thing everywhere. Light: jiwer, the normalisers and sacrebleu are
imported on first use, nothing of the service is.

* English: whisper_normalizer's ``EnglishTextNormalizer`` (Whisper's own: lower case, no
  punctuation, numbers and spellings made consistent), after stripping ``[..]`` / ``<..>``
  markup (MFA references carry ``[adif]``, ``<VOCNOISE>``).
* Other languages: the rules of the shared multilingual corpus's README: Unicode NFKC, lower
  case, every punctuation character (category P*: ``¿ ¡ « » „ “ ” 。 、 ， 「 」``) a space,
  whitespace collapsed. Accents and other marks are kept (they carry meaning; Whisper's
  ``BasicTextNormalizer`` blanks every mark, category M, which splits Devanagari or Thai words
  apart); in Arabic its diacritics (harakat, superscript alef, tatweel) are stripped and the
  alef forms أ إ آ ٱ unified to ا.
* Chinese, Japanese, Korean (and Cantonese): CER, not WER: their text has no spaces between
  words, so a "word" would be a whole sentence. Spaces are removed before counting characters.
* Translations to English: sacrebleu's corpus-level chrF (the primary figure) and BLEU on the
  raw text (sacrebleu's own tokenisation, case kept).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_MARKUP = re.compile(r"\[[^\]]*\]|<[^>]*>")
CER_LANGUAGES = frozenset({"zh", "ja", "ko", "yue"})
Normaliser = Callable[[str], str]
_AR_DIACRITICS = re.compile("[\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06ed\u0640]")
_AR_ALEF = str.maketrans({"أ": "ا", "إ": "ا", "آ": "ا", "ٱ": "ا"})


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


def unicode_basic(text: str) -> str:
    """The non-English rule (module docstring) for every language but Arabic."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join("".join(" " if unicodedata.category(ch).startswith("P") else ch
                            for ch in text).split())


def _arabic(text: str) -> str:
    return " ".join(_AR_DIACRITICS.sub("", unicode_basic(text)).translate(_AR_ALEF).split())


def _make(kind: str) -> tuple[str, Normaliser]:
    if kind == "arabic":
        return "unicode_basic+arabic", _arabic
    if kind == "basic":
        return "unicode_basic", unicode_basic
    try:
        from whisper_normalizer.english import EnglishTextNormalizer

        return "whisper_normalizer.english", EnglishTextNormalizer()
    except ImportError:
        return "builtin", _builtin_normaliser()


_NORMS: dict[str, tuple[str, Normaliser]] = {}


def _norm(kind: str) -> tuple[str, Normaliser]:
    if kind not in _NORMS:
        _NORMS[kind] = _make(kind)
    return _NORMS[kind]


def kind_of(language: str | None) -> str:
    """``english`` for en or an unknown language (the corpus and most datasets), ``arabic`` for
    ar, else ``basic``."""
    lang = (language or "en").lower()
    return "english" if lang in ("en", "english") else "arabic" if lang == "ar" else "basic"


def metric_of(language: str | None) -> str:
    """``cer`` for zh/ja/ko/yue, else ``wer``."""
    return "cer" if (language or "").lower() in CER_LANGUAGES else "wer"


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


def units(text: str, language: str | None, metric: str | None = None) -> list[str]:
    """What ``text`` is scored in: its normalised words, or for ``cer`` (by default zh/ja/ko/yue)
    its characters, spaces removed."""
    norm = normalise(text, language)
    return list(norm.replace(" ", "")) if (metric or metric_of(language)) == "cer" else norm.split()


def score(reference: str, hypothesis: str, language: str | None,
          metric: str | None = None) -> Score | None:
    """The utterance's WER (CER for zh/ja/ko/yue, or as ``metric`` says); None when the
    normalised reference is empty.

    For English this is exactly :func:`wer_percent` of the one pair."""
    import jiwer

    lang = (language or "").lower()
    metric = metric or metric_of(lang)
    ref, hyp = units(reference, lang, metric), units(hypothesis, lang, metric)
    if not ref:
        return None
    name = normaliser_name(lang)
    if metric == "cer":
        chars = jiwer.process_characters("".join(ref), "".join(hyp))
        return Score("cer", chars.substitutions + chars.deletions + chars.insertions, len(ref), name)
    words = jiwer.process_words(" ".join(ref), " ".join(hyp))
    return Score("wer", words.substitutions + words.deletions + words.insertions, len(ref), name)


def translation_scores(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, Any]:
    """Translations against one reference each: corpus chrF and BLEU (None for none), and each
    pair's sentence chrF. Needs sacrebleu (the test extras)."""
    import sacrebleu

    if not references:
        return {"clips": 0, "chrf": None, "bleu": None, "per_clip_chrf": []}
    hyps = [h.strip() for h in hypotheses]
    refs = [list(references)]
    return {"clips": len(hyps), "chrf": round(sacrebleu.corpus_chrf(hyps, refs).score, 2),
            "bleu": round(sacrebleu.corpus_bleu(hyps, refs).score, 2),
            "per_clip_chrf": [round(sacrebleu.sentence_chrf(h, [r]).score, 1)
                              for h, r in zip(hyps, references, strict=True)]}


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
