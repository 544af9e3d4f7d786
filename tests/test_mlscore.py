"""The multilingual harness's controls and comparison (``loadtest.multilingual``,
``loadtest.mlscore``): the controls change audio by what they say and nothing more, and the
comparison names the languages a system trails in. The harness itself runs the real model
(``python -m loadtest.multilingual``); these check the pieces its verdicts rest on.
"""

from __future__ import annotations

import numpy as np

from loadtest.mlscore import against
from loadtest.multilingual import dither, shift

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
