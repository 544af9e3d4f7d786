"""Every clip again as inaudibly changed copies: per-language error with the decode's noise
averaged out (``python -m loadtest.multilingual --variants N``).

One decode of a clip is one draw. 5 ms of leading silence alone takes faster-whisper's error in
Russian (one 9-word clip) from 11.1 to 33.3 %, and on this corpus faster-whisper has more
errors than itself in 5-7 of the 11 languages after such a change (the ``fw_*`` controls). A
language with 1-2 clips is then decided by which way a word or two fell. Here each clip also
runs as ``N - 1`` copies: copy ``k`` is the clip's own 16-bit samples with +-1 least significant
bit of dither (seeded ``k``) and ``k`` ms of silence before it, written as a 16-bit PCM WAV that
both systems read as a client would send it. A language's error rate pools its clips' words
over all ``N`` versions, so a word that one system misreads on most versions of a clip counts,
and a word that flips on one version counts one ``N``-th. The clips stay the same; only the
decoder's noise is averaged.

Measured at 819fad9 with ``N = 8`` (ad hoc, before this module): one copy said the service
trails faster-whisper in ar, fr, ru and sv; over the eight versions ar was even and sv ahead,
and fr, ja and ru trailed, each because of one or two clips the service misreads on most
versions (``per_clip`` names them).
"""

from __future__ import annotations

import wave
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from app.client.scoring import units
from loadtest.lib.corpus import Clip
from loadtest.lib.mlresults import against, error_rates, language, score, summary

SEP = "~"  # a copy's id: <clip id>~<k>
KEYS = ("transcripts", "languages", "translations")
HOW = ("copy k of N-1: the clip's 16-bit samples +-1 LSB (seeded k) after k ms of silence, "
       "a 16-bit PCM WAV")


def shift(audio: np.ndarray, ms: float = 5.0) -> np.ndarray:
    """The same audio, starting ``ms`` later (zeros before it)."""
    return np.concatenate([np.zeros(round(16 * ms), dtype=audio.dtype), audio])


def dither(audio: np.ndarray, seed: int = 1234) -> np.ndarray:
    """The same audio +-1 least significant bit of 16-bit PCM (-90 dBFS), seeded."""
    rng = np.random.default_rng(seed)
    lsb = rng.integers(-1, 2, size=audio.shape).astype(audio.dtype) / 32768.0
    return audio + lsb


def write_pcm16(path: Path, audio: np.ndarray, rate: int = 16000) -> None:
    pcm = np.clip(np.round(audio.astype(np.float64) * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())


def copies(clips: Sequence[Clip], n: int, folder: Path) -> list[Clip]:
    """``n - 1`` changed copies of every clip, written into ``folder`` (the originals not
    included). The samples are faster-whisper's ``decode_audio`` of the clip (16 kHz mono, the
    16-bit values the service decodes too), so the copies differ from it by what they say."""
    from faster_whisper import decode_audio

    out = []
    for c in clips:
        audio = decode_audio(str(c.path))
        for k in range(1, n):
            path = folder / f"{c.id}{SEP}{k}.wav"
            x = shift(dither(audio, seed=k), ms=k)
            write_pcm16(path, x)
            out.append(replace(c, id=f"{c.id}{SEP}{k}", path=path,
                               duration_s=round(len(x) / 16000, 3)))
    return out


def merged(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """One system's outputs on the clips and on their copies, as one output."""
    return {k: {**base.get(k, {}), **more.get(k, {})} for k in KEYS}


def origin(clip_id: str) -> str:
    return clip_id.split(SEP, 1)[0]


def per_clip(clips: Sequence[Clip], every: Sequence[Clip], texts: dict[str, str]
             ) -> dict[str, dict[str, int]]:
    """Each clip's errors and reference units summed over its versions (its language's
    metric)."""
    out = {}
    for c in clips:
        versions = [v for v in every if origin(v.id) == c.id]
        lang = error_rates(versions, texts)["all"]["per_language"].get(language(c))
        if lang:
            out[c.id] = {"errors": lang["errors"], "units": lang["units"]}
    return out


def _errors(clip: Clip, text: str) -> int:
    """One decode's errors on its clip (the language's metric)."""
    lang = error_rates([clip], {clip.id: text})["all"]["per_language"].get(language(clip))
    return int(lang["errors"]) if lang else 0


def paired(every: Sequence[Clip], texts: dict[str, str], base: dict[str, str]
           ) -> dict[str, dict[str, Any]]:
    """Per language, each version of each clip as a pair (``texts`` against ``base``): how many
    had more errors, fewer, the same, and a two-sided sign test over the untied pairs.

    The versions of one clip are not independent draws (the copies of a clip share its words),
    so the p-value is a lower bound on what an independent sample would give: a gap it does not
    call significant is not one an honest reading can call a difference."""
    from scipy.stats import binomtest

    counts: dict[str, list[int]] = {}
    for c in every:
        d = _errors(c, texts.get(c.id, "")) - _errors(c, base.get(c.id, ""))
        row = counts.setdefault(language(c), [0, 0, 0])
        row[0 if d > 0 else 1 if d < 0 else 2] += 1
    out = {}
    for lang, (worse, better, same) in sorted(counts.items()):
        p = binomtest(worse, worse + better).pvalue if worse + better else 1.0
        out[lang] = {"worse": worse, "better": better, "same": same, "sign_p": round(float(p), 4)}
    return out


def medoid(texts: Sequence[str], language: str) -> str:
    """The version whose units (words, or characters for zh/ja/ko) are nearest, by edit
    distance summed over the others, to all the others: what the versions agree on."""
    from rapidfuzz.distance import Levenshtein

    seqs = [units(t, language) for t in texts]
    costs = [sum(Levenshtein.distance(u, v) for v in seqs) for u in seqs]
    return texts[costs.index(min(costs))]


def consensus(clips: Sequence[Clip], every: Sequence[Clip], texts: dict[str, str]
              ) -> dict[str, Any]:
    """Each clip's medoid transcript over its versions, scored: what averaging out the input's
    noise (test-time augmentation) would buy. A misread that recurs on most versions stays."""
    chosen = {c.id: medoid([texts.get(v.id, "") for v in every if origin(v.id) == c.id],
                           language(c)) for c in clips}
    s = summary(score(clips, {"transcripts": chosen}))
    return {k: s[k] for k in ("mean_err_lang", "mean_err_clip", "per_lang")}


def pooled(clips: Sequence[Clip], extra: Sequence[Clip], outs: dict[str, dict[str, Any]],
           more: dict[str, dict[str, Any]], n: int) -> dict[str, Any]:
    """Every system of ``more`` scored over the clips and their copies together."""
    every = [*clips, *extra]
    systems: dict[str, Any] = {}
    for name, out in more.items():
        both = merged(outs[name], out)
        systems[name] = {"summary": summary(score(every, both)),
                         "per_clip": per_clip(clips, every, both["transcripts"]),
                         "consensus": consensus(clips, every, both["transcripts"]),
                         "wall_s": out.get("wall_s"),
                         **{k: out.get(k, {}) for k in KEYS}}  # the copies' own outputs
    result: dict[str, Any] = {"n": n, "how": HOW, "decodes_per_system": len(every),
                              "systems": systems}
    if "fw_default" in systems:
        base = systems["fw_default"]["summary"]
        fw = merged(outs["fw_default"], more["fw_default"])["transcripts"]
        result["against_fw_default"] = {
            k: {**against(v["summary"], base),
                "paired": paired(every, merged(outs[k], more[k])["transcripts"], fw)}
            for k, v in systems.items() if k != "fw_default"}
    return result


def markdown(v: dict[str, Any], clips: Sequence[Clip]) -> list[str]:
    names = list(v["systems"])
    summ = {k: s["summary"] for k, s in v["systems"].items()}
    langs = sorted({language(c) for c in clips})
    lines = ["", f"Over {v['n']} versions of every clip ({v['decodes_per_system']} decodes per "
             f"system; {v['how']}): error % pooled over a language's clips and versions.", "",
             "| lang | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for lang in langs:
        lines.append(f"| {lang} | " + " | ".join(
            _fmt(summ[n]["per_lang"].get(lang)) for n in names) + " |")
    for label, key in (("mean error over languages", "mean_err_lang"),
                       ("language ID %", "lid"), ("translation chrF", "chrf")):
        lines.append(f"| **{label}** | " + " | ".join(_fmt(summ[n][key]) for n in names) + " |")
    cons = {n: s.get("consensus") for n, s in v["systems"].items()}
    if all(cons.values()):
        lines += ["", "Each clip's consensus over its versions (the medoid transcript: what "
                  "averaging out the input's noise would buy), mean error over languages: "
                  + "; ".join(f"`{n}` {_fmt(summ[n]['mean_err_lang'])} → "
                              f"{_fmt(c['mean_err_lang'])}" for n, c in cons.items() if c) + "."]
    for n, d in v.get("against_fw_default", {}).items():
        trail = d["trails_in"]
        lines += ["", f"- `{n}` over the versions: mean error {_fmt(d['mean_err_lang'], True)}, chrF "
                  f"{_fmt(d['chrf'], True)}; more errors in {', '.join(trail) or 'no language'}, "
                  f"fewer in {', '.join(d['ahead_in']) or 'no language'}."]
        sign = [f"{lang} {p['worse']} worse / {p['better']} better / {p['same']} same, "
                f"p = {p['sign_p']:.2f}" for lang, p in d.get("paired", {}).items()
                if lang in trail or p["sign_p"] < 0.05]
        if sign:
            lines.append("  - versions paired with faster-whisper's, sign test (versions of a clip "
                         "are not independent, so p is a lower bound): " + "; ".join(sign))
        for lang in trail:
            worse = [f"{cid} {v['systems'][n]['per_clip'][cid]['errors']} against "
                     f"{v['systems']['fw_default']['per_clip'][cid]['errors']} of "
                     f"{v['systems'][n]['per_clip'][cid]['units']}"
                     for cid in sorted(v["systems"][n]["per_clip"])
                     if _lang(clips, cid) == lang and v["systems"][n]["per_clip"][cid]["errors"]
                     > v["systems"]["fw_default"]["per_clip"][cid]["errors"]]
            lines.append(f"  - {lang}: clips with more errors over the versions: "
                         + ("; ".join(worse) or "none"))
    return lines


def _lang(clips: Sequence[Clip], clip_id: str) -> str | None:
    return next((language(c) for c in clips if c.id == clip_id), None)


def _fmt(x: Any, sign: bool = False) -> str:
    return "–" if x is None else (f"{x:+.1f}" if sign else f"{x:.1f}")
