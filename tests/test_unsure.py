"""Unsure windows search wider (``MODEL__UNSURE_BEAM_SIZE``), on the real model.

faster-whisper decodes every window at beam 5; the service's default beam is 1. Where the model
is sure the two agree; where it is not (average log-probability < -1 on speech, Whisper's own
fallback test) a window is decoded again at ``unsure_beam_size`` from the same 30 s encoder
output and keeps the likelier decode that does not loop. On the dynamic time axis an unsure
window is first redone at 30 s, so both axes read it alike. Like every other fallback, it is
per window: a window reads the same alone and in a batch.

Which windows are unsure depends on the host's int8 kernels (on one Xeon a 3.3 s Spanish clip
was, on an EPYC it was not), so the subjects are found, not named: every window of a third of
the multilingual corpus, translated to English at beam 1; the most unsure of them are tested.
The search translates only: measured on the EPYC, 9 of 18 windows translate unsure and none
transcribes unsure, and transcribing them all cost 26 of the module's ~110 CPU-s for no subject.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from app.audio import prepare
from app.audio.vad import SileroVad
from app.config import ModelSettings, Settings
from app.engine.decoding import degenerate, unsure
from app.engine.whisper import WhisperEngine
from app.windows import DecodeOptions, Prompt, Task, Window, WindowResult
from loadtest.lib.corpus import READ_SPEECH, Clip
from models.registry import resolve
from tests.conftest import multilingual_clips

pytestmark = pytest.mark.model


def make(time_axis: str, unsure_beam_size: int, loop_penalties: list[float] | None = None,
         ) -> WhisperEngine:
    s = Settings()
    extra = {} if loop_penalties is None else {"loop_penalties": loop_penalties}
    return WhisperEngine(resolve(s.model.name, s.model.cache_dir, True),
                         ModelSettings(num_workers=1, cpu_threads=2, time_axis=time_axis,
                                       unsure_beam_size=unsure_beam_size, **extra), s.model.name)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, WhisperEngine]]:
    out = {f"{axis}{beam}": make(axis, beam) for axis in ("dynamic", "full") for beam in (1, 5)}
    out["raw"] = make("full", 1, loop_penalties=[])  # the model's own decode, no fallback
    yield out
    for e in out.values():
        e.close()


def window(clip_id: str, language: str) -> Window:
    path = {c.id: c.path for c in multilingual_clips()}[clip_id]
    w = prepare(path, SileroVad(), 3600)[1][0]
    w.prompt = Prompt(language=language)
    return w


@pytest.fixture(scope="module")
def corpus_windows() -> list[tuple[str, Window]]:
    out = []
    # Every third clip of the 36: a third of the engine time (this module's set-up was the
    # suite's slowest), and still 7 of 12 windows translate unsure at beam 1 (on the EPYC)
    # where the tests need 3 (21 of 36 measured on all of them, 9 of 18 on every other one).
    for c in multilingual_clips()[::3]:
        for w in prepare(c.path, SileroVad(), 3600)[1]:
            w.prompt = Prompt(language=c.language)
            out.append((c.id, w))
    return out


@dataclass
class Subject:
    clip_id: str
    window: Window
    task: Task
    narrow: WindowResult  # beam 1, its fallback off
    wide: WindowResult  # beam 1 with the fallback to beam 5
    beam5: WindowResult  # beam 5 on Whisper's 30 s input, no fallback of any kind


# Of the windows unsure on both axes (9 were on the EPYC), the 3 most unsure: the tests need 3,
# and each subject costs two beam-5 decodes per axis (5 cost ~9 CPU-s more).
MOST_UNSURE = 3


def subjects(engines: dict[str, WhisperEngine], axis: str, windows: list[tuple[str, Window]],
             idx: list[int], narrow: list[WindowResult], beam5: dict[int, WindowResult],
             task: Task = "translate") -> list[Subject]:
    """``beam5``: the raw engine's beam-5 decodes by window index, filled here and shared by
    both axes (the raw engine is the same for both)."""
    opts = DecodeOptions(task=task)
    wide = engines[f"{axis}5"].transcribe_batch([windows[k][1] for k in idx], opts)
    todo = [k for k in idx if k not in beam5]
    beam5.update(zip(todo, engines["raw"].transcribe_batch(
        [windows[k][1] for k in todo], DecodeOptions(task=task, beam_size=5)), strict=True))
    return [Subject(windows[k][0], windows[k][1], task, narrow[k], w, beam5[k])
            for k, w in zip(idx, wide, strict=True)]


@pytest.fixture(scope="module")
def found(engines: dict[str, WhisperEngine], corpus_windows: list[tuple[str, Window]],
          ) -> dict[str, list[Subject]]:
    """The same windows on both axes: those unsure on both, the most unsure first (each axis's
    own 3 most unsure shared only 2 on a CI host, and the axes' test needs 3 in common)."""
    opts = DecodeOptions(task="translate")
    narrow = {axis: engines[f"{axis}1"].transcribe_batch([w for _, w in corpus_windows], opts)
              for axis in ("dynamic", "full")}
    both = [k for k in range(len(corpus_windows)) if all(unsure(n[k]) for n in narrow.values())]
    idx = sorted(both, key=lambda k: (max(n[k].avg_logprob for n in narrow.values()), k))
    beam5: dict[int, WindowResult] = {}
    return {axis: subjects(engines, axis, corpus_windows, idx[:MOST_UNSURE], narrow[axis], beam5)
            for axis in ("dynamic", "full")}


@pytest.mark.parametrize("axis", ["dynamic", "full"])
def test_an_unsure_window_keeps_the_likelier_decode_that_does_not_loop(
        found: dict[str, list[Subject]], axis: str) -> None:
    subs = found[axis]
    # Measured: 21 of the 36 windows translate unsure at beam 1 (EPYC, 1.4 s padding), 7 of
    # the 12 searched; the 3 most unsure on both axes are kept.
    assert len(subs) >= 3, [s.clip_id for s in subs]
    changed = 0
    for s in subs:
        assert s.wide.avg_logprob >= s.narrow.avg_logprob, s
        if not degenerate(s.beam5):  # (a beam-5 loop is decoded again with a penalty)
            likelier = s.beam5 if s.beam5.avg_logprob > s.narrow.avg_logprob else s.narrow
            assert s.wide.text == likelier.text, s
        if s.wide.text != s.narrow.text:
            assert s.wide.avg_logprob > s.narrow.avg_logprob and not degenerate(s.wide), s
            changed += 1
    assert changed >= 1, "no unsure window took the wider beam's decode"


def test_both_axes_read_an_unsure_window_alike(found: dict[str, list[Subject]]) -> None:
    """The dynamic axis redoes an unsure window at 30 s, where the full axis starts."""
    full = {(s.clip_id, s.task): s for s in found["full"]}
    both = [(s, full[s.clip_id, s.task]) for s in found["dynamic"] if (s.clip_id, s.task) in full]
    assert len(both) >= 3
    for d, f in both:
        assert (d.narrow.text, d.wide.text) == (f.narrow.text, f.wide.text), d.clip_id


@pytest.fixture(scope="module")
def companions() -> list[Window]:
    """Three other windows of other languages to share the batch (French, German, Italian)."""
    languages = {c.id: c.language or "" for c in multilingual_clips()}
    return [window(i, languages[i])
            for i in ("fleurs-fr-cuttledoc-005", "fleurs-de-cuttledoc-008",
                      "picovoice-it-leopard-test_it")]


@pytest.mark.parametrize("axis", ["dynamic", "full"])
def test_an_unsure_window_reads_the_same_in_a_batch(
        engines: dict[str, WhisperEngine], found: dict[str, list[Subject]],
        companions: list[Window], axis: str) -> None:
    s = next(s for s in found[axis] if s.wide.text != s.narrow.text)
    opts = DecodeOptions(task=s.task)
    batch = [s.window, *companions]
    together = engines[f"{axis}5"].transcribe_batch(batch, opts)
    assert together[0].text == s.wide.text
    alone = [engines[f"{axis}5"].transcribe_batch([x], opts)[0].text for x in batch[1:]]
    assert [r.text for r in together[1:]] == alone


def test_sure_windows_are_not_decoded_again(engines: dict[str, WhisperEngine],
                                            clips: list[Clip]) -> None:
    """Read English, where whisper-base is sure: the fallback changes nothing, on either axis."""
    vad = SileroVad()
    read = [c for c in clips if c.set in READ_SPEECH][:4]  # (8 cost twice as much, same show)
    batch = [x for c in read for x in prepare(c.path, vad, 3600)[1]][:4]
    for w in batch:
        w.prompt = Prompt(language="en")
    for axis in ("dynamic", "full"):
        off = engines[f"{axis}1"].transcribe_batch(batch, DecodeOptions())
        on = engines[f"{axis}5"].transcribe_batch(batch, DecodeOptions())
        assert not any(unsure(r) for r in off)
        assert [(r.text, r.avg_logprob) for r in on] == [(r.text, r.avg_logprob) for r in off]
