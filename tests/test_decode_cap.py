"""The decode length cap (``MODEL__MAX_TOKENS_PER_S``) and the loop fallback
(``MODEL__LOOP_PENALTIES``), on the real model and corpus audio.

A decoder that loops ("uh, uh, uh, ...") runs to the model's 224 tokens, and its whole batch
waits on it. The cap stops it after a length set by the audio's duration; a window that fills
the cap *without* looping is dense speech and is decoded again at the model's own limit, so no
real text is ever cut. A window still looping at 30 s is decoded again with a repetition
penalty; both are per window, so a window's text does not depend on its batch mates.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from app.audio import prepare
from app.audio.vad import SileroVad
from app.config import ModelSettings, Settings
from app.engine.decoder import Fallback, fallback_for
from app.engine.whisper import WhisperEngine
from app.windows import TOKEN_SLACK, DecodeOptions, Prompt, Window, WindowResult
from loadtest.lib.corpus import READ_SPEECH, Clip
from models.registry import resolve

LOOPING_CLIP = "mfa-mfa_uhuh"  # 5.8 s of "uh, uh": whisper-base loops on it at any padding
EN = DecodeOptions()


def make_engine(tokens_per_s: float, fallback: bool = True) -> WhisperEngine:
    """``fallback=False``: neither loop penalties nor the unsure window's wider beam."""
    s = Settings()
    penalties = s.model.loop_penalties
    return WhisperEngine(resolve(s.model.name, s.model.cache_dir, True),
                         ModelSettings(num_workers=1, cpu_threads=2, max_tokens_per_s=tokens_per_s,
                                       loop_penalties=penalties if fallback else [],
                                       unsure_beam_size=s.model.unsure_beam_size if fallback
                                       else 1), s.model.name)


@pytest.fixture(scope="module")
def uncapped() -> Iterator[WhisperEngine]:
    """No cap and no fallback: a loop runs to the model's limit."""
    eng = make_engine(0.0, fallback=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def looping() -> Iterator[WhisperEngine]:
    """The default cap, no fallback: a loop is cut at its window's budget and kept."""
    eng = make_engine(Settings().model.max_tokens_per_s, fallback=False)
    yield eng
    eng.close()


def windows_of(clip: Clip, prompt: Prompt | None = None) -> list[Window]:
    windows = prepare(clip.path, SileroVad(), 3600)[1]
    for w in windows:
        w.prompt = prompt or Prompt(language="en")
    return windows


@pytest.fixture(scope="module")
def loop_window(clips: list[Clip]) -> Window:
    (clip,) = [c for c in clips if c.id == LOOPING_CLIP]
    (window,) = windows_of(clip)
    return window


@pytest.fixture(scope="module")
def capped_alone(looping: WhisperEngine, loop_window: Window) -> WindowResult:
    """The looping window decoded alone under the default cap, no fallback (two tests read it:
    its 127 tokens cost ~3.5 CPU-s)."""
    return looping.transcribe_batch([loop_window], EN)[0]


@pytest.mark.model
def test_a_looping_decode_stops_at_the_cap(uncapped: WhisperEngine, loop_window: Window,
                                           capped_alone: WindowResult) -> None:
    window = loop_window
    loop = uncapped.transcribe_batch([window], EN)[0]
    assert loop.compression_ratio > 2.4 and len(loop.tokens) == 224  # the premise: it loops

    capped = capped_alone
    cap = math.ceil(Settings().model.max_tokens_per_s * window.duration) + TOKEN_SLACK
    assert len(capped.tokens) == cap  # cut at the window's own budget
    assert capped.compression_ratio > 2.4  # still flagged as the loop it is
    assert loop.text.startswith(capped.text[:40])  # the same loop, cut shorter


# ~70 tokens: longer than twice a short window's budget, where CTranslate2's own limit (max_length
# minus the prompt) is the tighter one.
LONG_PROMPT = ("A reading from a book in the public domain, recorded by volunteers. The reader "
               "speaks clearly, at an even pace, with full sentences, proper punctuation and "
               "capital letters, and no abbreviations; names of people and places are spelled out "
               "as they appear in the text of the chapter.")


@pytest.mark.model
@pytest.mark.parametrize("prompt", [None, LONG_PROMPT], ids=["no-prompt", "long-prompt"])
def test_speech_that_fills_the_cap_is_decoded_again_in_full(uncapped: WhisperEngine,
                                                            clips: list[Clip],
                                                            prompt: str | None) -> None:
    """At 0.5 tokens/s read speech fills its cap (~20 tokens) without looping; each such window
    is redone at the model's limit, so the transcripts equal the uncapped ones."""
    opts = DecodeOptions()
    picked = sorted((c for c in clips if c.set in READ_SPEECH), key=lambda c: c.id)[::3][:8]
    every = [w for c in picked for w in windows_of(c, Prompt(language="en", initial_prompt=prompt))]
    full = uncapped.transcribe_batch(every, opts)
    dense = [k for k, (w, r) in enumerate(zip(every, full, strict=True))
             if len(r.tokens) > math.ceil(0.5 * w.duration) + TOKEN_SLACK]
    assert len(dense) >= 4
    windows = [every[k] for k in dense]
    tight = make_engine(0.5)
    try:
        assert [r.text for r in tight.transcribe_batch(windows, opts)] == [full[k].text
                                                                           for k in dense]
    finally:
        tight.close()


@pytest.mark.model
def test_a_looping_window_reads_the_same_alone_and_beside_a_long_window(
        looping: WhisperEngine, engine: WhisperEngine, clips: list[Clip], loop_window: Window,
        capped_alone: WindowResult) -> None:
    """The budget is the window's own: batched beside a 25-30 s window (whose budget is ~5x
    larger, so the call runs longer), the looping clip is cut where it is cut alone. With the
    loop fallback (the service's default), it is decoded again with a repetition penalty, and
    that too is the window's own: the same text alone and batched, and no longer a loop."""
    window = loop_window
    read = sorted((c for c in clips if c.set in READ_SPEECH), key=lambda c: c.duration_s)
    longest = max((w for c in read[-3:] for w in windows_of(c)),  # (not the VAD of every clip)
                  key=lambda w: w.duration)
    assert longest.duration > 20
    alone = capped_alone
    beside = looping.transcribe_batch([longest, window], EN)[1]
    assert alone.compression_ratio > 2.4  # the premise: it loops
    assert beside.text == alone.text and beside.tokens == alone.tokens

    fixed = engine.transcribe_batch([window], EN)[0]
    fixed_beside = engine.transcribe_batch([longest, window], EN)
    assert fixed.compression_ratio <= 2.4 and fixed.text.strip()
    assert fixed_beside[1].text == fixed.text and fixed_beside[1].tokens == fixed.tokens
    assert fixed_beside[0].text == looping.transcribe_batch([longest], EN)[0].text  # untouched


@pytest.mark.parametrize("bad", ["[1.0]", "[0.9, 1.3]", "[1.1, 4]"])
def test_loop_penalties_that_cannot_break_a_loop_are_refused(
        bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repetition penalty of 1 or less changes nothing (CTranslate2 scales a repeated token's
    logit by it), and one far above the defaults mangles words: the setting refuses both."""
    from pydantic import ValidationError

    monkeypatch.setenv("BATCHSCRIBE_MODEL__LOOP_PENALTIES", bad)
    with pytest.raises(ValidationError, match="loop_penalties"):
        Settings()
    monkeypatch.setenv("BATCHSCRIBE_MODEL__LOOP_PENALTIES", "[1.1, 1.3]")
    assert Settings().model.loop_penalties == [1.1, 1.3]
    monkeypatch.setenv("BATCHSCRIBE_MODEL__LOOP_PENALTIES", "[]")
    assert Settings().model.loop_penalties == []


def result(compression: float = 1.5, logprob: float = -0.3, no_speech: float = 0.1,
           doubtful: bool = False) -> WindowResult:
    return WindowResult(text="x", language="en", language_probability=None, avg_logprob=logprob,
                        no_speech_prob=no_speech, compression_ratio=compression,
                        doubtful=doubtful)


@pytest.mark.parametrize("r, beam, temperature, below, want", [
    (result(), 1, 0.0, True, None),  # sure: nothing, on either side of the final length
    (result(), 1, 0.0, False, None),
    (result(compression=3.0), 1, 0.0, True, Fallback.AXIS),  # a loop below the final length
    (result(logprob=-1.5), 5, 0.0, True, Fallback.AXIS),  # unsure, whatever its beam
    (result(logprob=-1.5, no_speech=0.9), 1, 0.0, True, None),  # silence, not unsure speech
    (result(compression=3.0), 1, 0.0, False, Fallback.UNLOOP),
    (result(compression=3.0, logprob=-1.5), 1, 0.0, False, Fallback.UNLOOP),  # a loop first
    (result(logprob=-1.5), 1, 0.0, False, Fallback.WIDEN),
    (result(logprob=-1.5), 5, 0.0, False, None),  # already at unsure_beam_size
    (result(compression=3.0), 1, 0.4, False, None),  # sampling takes no fallback at its length
    (result(compression=3.0), 1, 0.4, True, Fallback.AXIS),  # ... but goes to 30 s below it
    (result(compression=3.0, doubtful=True), 1, 0.0, True, None),  # its caller decodes again
])
def test_the_one_fallback_rule(r: WindowResult, beam: int, temperature: float, below: bool,
                               want: Fallback | None) -> None:
    """What a decode asks for next (app/engine/decoder.py): the rule the engine runs inside a
    decode and marks ``redo`` by, unit-tested without the model."""
    assert fallback_for(r, beam, temperature, below, wide=5, penalties=(1.1, 1.3)) is want


def test_no_penalties_leave_a_loop_as_it_is() -> None:
    assert fallback_for(result(compression=3.0), 1, 0.0, False, wide=5, penalties=()) is None
