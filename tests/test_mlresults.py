"""The multilingual harness's controls and comparison (``loadtest.multilingual``,
``loadtest.lib.mlresults``): the controls change audio by what they say and nothing more, and the
comparison names the languages a system trails in; the copies of ``--variants`` are the clip
changed by what they say, and a language is scored over all versions of its clips. The harness
itself runs the real model (``python -m loadtest.multilingual``); these check the pieces its
verdicts rest on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from loadtest.lib import mlvariants
from loadtest.lib.corpus import Clip
from loadtest.lib.mlresults import against
from loadtest.lib.mlvariants import dither, shift, write_pcm16

LSB = 1 / 32768


def audio() -> np.ndarray:
    t = np.arange(16000, dtype=np.float32) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_shift_prepends_five_ms_of_silence_and_keeps_the_audio() -> None:
    a = audio()
    out = shift(a)
    assert out.dtype == a.dtype
    assert len(out) == len(a) + 80  # 5 ms at 16 kHz: half of Whisper's 10 ms mel hop
    assert not out[:80].any()
    assert np.array_equal(out[80:], a)


def test_dither_moves_every_sample_by_at_most_one_lsb_the_same_way_each_run() -> None:
    a = audio()
    out = dither(a)
    assert out.dtype == a.dtype and out.shape == a.shape
    diff = out.astype(np.float64) - a
    assert np.abs(diff).max() <= LSB * 1.001
    assert (np.abs(diff) > LSB / 2).mean() > 0.5  # most samples moved: -1, 0 or +1 LSB each
    assert np.array_equal(dither(a), out)
    assert not np.array_equal(dither(a, seed=7), out)


def test_against_names_the_languages_a_system_trails_and_leads_in() -> None:
    base = {"per_lang": {"fr": 20.0, "ru": 11.1, "de": 10.0, "ko": None},
            "mean_err_lang": 13.7, "mean_err_clip": 14.0, "mean_err_lang_no_numbers": 13.7,
            "lid": 100.0, "chrf": 40.0, "bleu": 10.0}
    s = {"per_lang": {"fr": 21.5, "ru": 11.1, "de": 8.0, "ko": 5.0},
         "mean_err_lang": 13.5, "mean_err_clip": 13.0, "mean_err_lang_no_numbers": 13.5,
         "lid": 100.0, "chrf": 41.0, "bleu": 9.0}
    d = against(s, base)
    assert d["trails_in"] == ["fr"]
    assert d["ahead_in"] == ["de"]
    assert d["per_lang"] == {"fr": 1.5, "ru": 0.0, "de": -2.0, "ko": None}
    assert d["chrf"] == 1.0 and d["bleu"] == -1.0


def clip(tmp_path: Path, clip_id: str = "x-fr-1", language: str = "fr",
         reference: str = "les deux autres sont situés au bord de la mer jaune") -> Clip:
    path = tmp_path / f"{clip_id}.wav"
    write_pcm16(path, audio())
    return Clip(clip_id, path, 1.0, reference, "test", language=language)


def test_copies_are_the_clip_k_ms_later_and_dithered_as_16_bit_files(tmp_path: Path) -> None:
    from faster_whisper import decode_audio

    c = clip(tmp_path)
    out = mlvariants.copies([c], 4, tmp_path)
    assert [v.id for v in out] == ["x-fr-1~1", "x-fr-1~2", "x-fr-1~3"]
    original = decode_audio(str(c.path))
    for k, v in enumerate(out, start=1):
        got = decode_audio(str(v.path))  # what a client uploads and both systems read
        assert len(got) == len(original) + 16 * k and not got[:16 * k].any()
        assert np.array_equal(got, shift(dither(original, seed=k), ms=k))
        assert np.abs(got[16 * k:].astype(np.float64) - original).max() <= LSB * 1.001
        assert v.language == c.language and v.reference == c.reference
        assert v.duration_s == round(len(got) / 16000, 3)
    assert not np.array_equal(decode_audio(str(out[0].path))[16:], decode_audio(str(out[1].path))[32:])


def test_a_language_is_scored_over_every_version_of_its_clips(tmp_path: Path) -> None:
    fr, de = clip(tmp_path), clip(tmp_path, "x-de-1", "de", "das ist ein kurzer satz")
    extra = [replace(c, id=f"{c.id}~{k}") for c in (fr, de) for k in (1, 2, 3)]
    right = {c.id: c.reference for c in (fr, de, *extra)}
    # one word wrong on one version of the French clip, and on all four of the German one
    svc = {**right, "x-fr-1~2": right["x-fr-1"].replace("jaune", "zone"),
           **{i: "das ist ein langer satz" for i in right if i.startswith("x-de")}}
    base = {"fw_default": {"transcripts": {i: right[i] for i in ("x-fr-1", "x-de-1")}},
            "http": {"transcripts": {i: svc[i] for i in ("x-fr-1", "x-de-1")}}}
    more = {n: {"transcripts": {c.id: t[c.id] for c in extra}}
            for n, t in (("fw_default", right), ("http", svc))}
    v = mlvariants.pooled([fr, de], extra, base, more, 4)
    assert v["decodes_per_system"] == 8
    http = v["systems"]["http"]
    assert http["per_clip"] == {"x-fr-1": {"errors": 1, "units": 44},
                                "x-de-1": {"errors": 4, "units": 20}}
    assert http["summary"]["per_lang"] == {"de": 20.0, "fr": round(100 / 44, 2)}
    assert v["systems"]["fw_default"]["summary"]["per_lang"] == {"de": 0.0, "fr": 0.0}
    assert v["against_fw_default"]["http"]["trails_in"] == ["de", "fr"]
    assert http["transcripts"] == more["http"]["transcripts"]  # each copy's text is kept
    md = "\n".join(mlvariants.markdown(v, [fr, de]))
    assert "x-de-1 4 against 0 of 20" in md and "x-fr-1 1 against 0 of 44" in md


def test_versions_are_paired_and_their_consensus_scored(tmp_path: Path) -> None:
    """Each version of a clip is paired with faster-whisper's same version (a sign test per
    language), and each clip's medoid over its versions is scored: a word misread on one
    version of four drops out of the consensus, one misread on all four stays."""
    fr, de = clip(tmp_path), clip(tmp_path, "x-de-1", "de", "das ist ein kurzer satz")
    extra = [replace(c, id=f"{c.id}~{k}") for c in (fr, de) for k in (1, 2, 3)]
    right = {c.id: c.reference for c in (fr, de, *extra)}
    svc = {**right, "x-fr-1~2": right["x-fr-1"].replace("jaune", "zone"),
           **{i: "das ist ein langer satz" for i in right if i.startswith("x-de")}}
    base = {n: {"transcripts": {i: t[i] for i in ("x-fr-1", "x-de-1")}}
            for n, t in (("fw_default", right), ("http", svc))}
    more = {n: {"transcripts": {c.id: t[c.id] for c in extra}}
            for n, t in (("fw_default", right), ("http", svc))}
    v = mlvariants.pooled([fr, de], extra, base, more, 4)
    paired = v["against_fw_default"]["http"]["paired"]
    assert paired["de"] == {"worse": 4, "better": 0, "same": 0, "sign_p": 0.125}
    assert paired["fr"] == {"worse": 1, "better": 0, "same": 3, "sign_p": 1.0}
    assert v["systems"]["http"]["consensus"]["per_lang"] == {"de": 20.0, "fr": 0.0}
    assert v["systems"]["fw_default"]["consensus"]["per_lang"] == {"de": 0.0, "fr": 0.0}
    md = "\n".join(mlvariants.markdown(v, [fr, de]))
    assert "de 4 worse / 0 better / 0 same, p = 0.12" in md
    assert "`http` 11.1 → 10.0" in md  # (20 + 100/44 %) / 2 languages, then the medoids


def test_medoid_is_the_version_the_others_agree_with() -> None:
    assert mlvariants.medoid(["一二三四", "一二三五", "一二三四", "六二三四"], "ja") == "一二三四"
    assert mlvariants.medoid(["a b c", "a x c", "a b c d"], "fr") == "a b c"
