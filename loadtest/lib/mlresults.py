"""The multilingual harness's tables (``loadtest.multilingual``) over the project's one scorer
(app/client/scoring.py: the multilingual corpus README's normalisation, CER for zh/ja/ko).

- Error rate per clip and per language, pooled over the language's clips (errors / reference
  units): the language's metric (CER for zh, ja, ko; WER for the others) and both WER and CER for
  every language (ar: prefer the CER). The five clips whose references write numbers in a
  different form from Whisper are scored with the others and also left out (``*_no_numbers``).
- Language identification: the share of clips whose detected language is the manifest's.
- Translation to English: the scorer's chrF (primary) and BLEU over the clips that have a
  reference translation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.client import scoring
from loadtest.lib.corpus import Clip

NUMBER_CLIPS = frozenset({  # references write numbers differently from Whisper (README)
    "fleurs-fr-cuttledoc-006", "fleurs-pt-cuttledoc-006", "fleurs-zh-1883",
    "fleurs-zh-1805-1830-concat", "nst-sv-se10x016-08071999-1334_u0016002",
})


def language(clip: Clip) -> str:
    return clip.language or "en"


def _rate(clips: Sequence[Clip], texts: dict[str, str], metric: str) -> dict[str, Any]:
    """Errors over reference units (percent, 2 decimals) of ``clips`` in ``metric``."""
    scores = [s for c in clips
              if (s := scoring.score(c.reference, texts[c.id], language(c), metric)) is not None]
    errors, units = sum(s.errors for s in scores), sum(s.units for s in scores)
    return {"rate": round(100.0 * errors / units, 2) if units else None, "errors": errors,
            "units": units}


def metric(lang: str) -> str:
    return scoring.metric_of(lang)


def clip_rates(clip: Clip, text: str) -> dict[str, Any]:
    wer = _rate([clip], {clip.id: text}, "wer")
    cer = _rate([clip], {clip.id: text}, "cer")
    return {"wer": wer["rate"], "cer": cer["rate"], "primary": metric(language(clip)),
            "error": cer["rate"] if metric(language(clip)) == "cer" else wer["rate"]}


def error_rates(clips: Sequence[Clip], texts: dict[str, str]) -> dict[str, Any]:
    """Per language (pooled over its clips), with and without the number clips, and means."""
    out: dict[str, Any] = {}
    for name, keep in (("all", lambda c: True), ("no_numbers", lambda c: c.id not in NUMBER_CLIPS)):
        per: dict[str, Any] = {}
        for lang in sorted({language(c) for c in clips}):
            cs = [c for c in clips if language(c) == lang and c.id in texts and keep(c)]
            if not cs:
                continue
            wer, cer = _rate(cs, texts, "wer"), _rate(cs, texts, "cer")
            per[lang] = {"clips": len(cs), "wer": wer["rate"], "cer": cer["rate"],
                         "metric": metric(lang),
                         "error": cer["rate"] if metric(lang) == "cer" else wer["rate"],
                         "errors": (cer if metric(lang) == "cer" else wer)["errors"],
                         "units": (cer if metric(lang) == "cer" else wer)["units"]}
        scored = [c for c in clips if c.id in texts and keep(c)]
        per_clip = [clip_rates(c, texts[c.id])["error"] for c in scored]
        out[name] = {
            "per_language": per,
            "mean_over_languages": _mean([v["error"] for v in per.values()]),
            "mean_over_clips": _mean([x for x in per_clip if x is not None]),
            "pooled_errors_over_units": round(100.0 * sum(v["errors"] for v in per.values())
                                              / max(1, sum(v["units"] for v in per.values())), 2),
        }
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


def language_accuracy(clips: Sequence[Clip], languages: dict[str, str]) -> dict[str, Any]:
    scored = [c for c in clips if c.id in languages]
    wrong = {c.id: {"expected": language(c), "detected": languages[c.id]}
             for c in scored if languages[c.id] != language(c)}
    return {"accuracy": round(100.0 * (len(scored) - len(wrong)) / max(1, len(scored)), 2),
            "clips": len(scored), "wrong": wrong}


def translation_scores(clips: Sequence[Clip], texts: dict[str, str]) -> dict[str, Any]:
    """The scorer's chrF and BLEU over the clips with a reference translation, per clip too."""
    cs = [c for c in clips if c.translation and c.id in texts]
    if not cs:
        return {"clips": 0, "chrf": None, "bleu": None}
    got = scoring.translation_scores([c.translation or "" for c in cs], [texts[c.id] for c in cs])
    return {**got, "per_clip_chrf": dict(zip([c.id for c in cs], got["per_clip_chrf"], strict=True))}


def score(clips: Sequence[Clip], out: dict[str, Any]) -> dict[str, Any]:
    """Scores of one system's output: ``{"transcripts": {id: text}, "languages": {id: code},
    "translations": {id: text}}`` (any may be missing)."""
    s: dict[str, Any] = {}
    if out.get("transcripts"):
        s["errors"] = error_rates(clips, out["transcripts"])
    if out.get("languages"):
        s["language_id"] = language_accuracy(clips, out["languages"])
    if out.get("translations"):
        s["translation"] = translation_scores(clips, out["translations"])
    return s


def summary(s: dict[str, Any]) -> dict[str, Any]:
    """One line per system: mean error, per-language errors, language ID, chrF/BLEU."""
    e = s.get("errors", {}).get("all", {})
    t = s.get("translation", {})
    return {"mean_err_lang": e.get("mean_over_languages"), "mean_err_clip": e.get("mean_over_clips"),
            "mean_err_lang_no_numbers": s.get("errors", {}).get("no_numbers", {})
            .get("mean_over_languages"),
            "per_lang": {k: v["error"] for k, v in e.get("per_language", {}).items()},
            "lid": s.get("language_id", {}).get("accuracy"), "chrf": t.get("chrf"),
            "bleu": t.get("bleu")}


def paired_bootstrap(clips: Sequence[Clip], a: dict[str, Any], b: dict[str, Any],
                     n: int = 1000, seed: int = 0) -> dict[str, Any]:
    """How sure is "a is at least as good as b"? Clips resampled with replacement ``n`` times:
    corpus chrF of the translations, and the pooled error rate (errors over reference units,
    each clip in its language's metric) of the transcripts. 95% interval of a - b and the share
    of resamples where a is not worse."""
    import random

    import sacrebleu

    rng = random.Random(seed)
    out: dict[str, Any] = {}
    tc = [c for c in clips if c.translation and c.id in a.get("translations", {})
          and c.id in b.get("translations", {})]
    if tc:
        deltas = []
        for _ in range(n):
            pick = [rng.choice(tc) for _ in tc]
            refs = [[c.translation or "" for c in pick]]
            deltas.append(sacrebleu.corpus_chrf([a["translations"][c.id] for c in pick], refs).score
                          - sacrebleu.corpus_chrf([b["translations"][c.id] for c in pick], refs).score)
        out["chrf"] = _interval(deltas, higher_is_better=True)
    ec = [c for c in clips if c.id in a.get("transcripts", {}) and c.id in b.get("transcripts", {})]
    if ec:
        counts = {}
        for c in ec:
            m = metric(language(c))
            ra, rb = _rate([c], a["transcripts"], m), _rate([c], b["transcripts"], m)
            counts[c.id] = (ra["errors"], rb["errors"], ra["units"])
        deltas = []
        for _ in range(n):
            pick = [rng.choice(ec) for _ in ec]
            units = max(1, sum(counts[c.id][2] for c in pick))
            deltas.append(100.0 * sum(counts[c.id][0] - counts[c.id][1] for c in pick) / units)
        out["pooled_error"] = _interval(deltas, higher_is_better=False)
        out["clips_better_same_worse"] = [sum(v[0] < v[1] for v in counts.values()),
                                          sum(v[0] == v[1] for v in counts.values()),
                                          sum(v[0] > v[1] for v in counts.values())]
    return out


def _interval(deltas: list[float], higher_is_better: bool) -> dict[str, Any]:
    xs = sorted(deltas)
    ok = sum((d >= 0) if higher_is_better else (d <= 0) for d in xs)
    return {"delta_p2.5": round(xs[int(0.025 * len(xs))], 2),
            "delta_median": round(xs[len(xs) // 2], 2),
            "delta_p97.5": round(xs[int(0.975 * len(xs)) - 1], 2),
            "share_not_worse": round(ok / len(xs), 3)}


def spread(clips: Sequence[Clip], n: int) -> list[Clip]:
    """``n`` clips spread over the languages (a smoke subset): languages by clip count, taken
    alternately from the most and the least represented end, one clip each per round, clips with
    an English translation first (so a small subset still translates)."""
    by_lang: dict[str, list[Clip]] = {}
    for c in sorted(clips, key=lambda c: (c.translation is None, c.id)):
        by_lang.setdefault(language(c), []).append(c)
    langs = sorted(by_lang, key=lambda k: (-len(by_lang[k]), k))
    order = [langs[i // 2] if i % 2 == 0 else langs[-1 - i // 2] for i in range(len(langs))]
    out: list[Clip] = []
    while len(out) < min(n, len(clips)):
        for lang in order:
            if by_lang[lang] and len(out) < n:
                out.append(by_lang[lang].pop(0))
    return sorted(out, key=lambda c: (language(c), c.id))


def against(s: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``s`` minus ``base`` (both from :func:`summary`): error points per language and on the
    mean (negative: fewer errors), language-ID points, chrF and BLEU points (positive: better);
    the languages where ``s`` has more errors (``trails_in``) and fewer (``ahead_in``)."""
    def sub(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a - b, 2)

    per = {k: sub(v, base["per_lang"].get(k)) for k, v in s["per_lang"].items()}
    return {"per_lang": per,
            "trails_in": sorted(k for k, d in per.items() if d is not None and d > 0),
            "ahead_in": sorted(k for k, d in per.items() if d is not None and d < 0),
            **{k: sub(s[k], base[k]) for k in ("mean_err_lang", "mean_err_clip",
                                               "mean_err_lang_no_numbers", "lid", "chrf", "bleu")}}
