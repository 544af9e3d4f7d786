"""A fake engine for unit tests of the batcher and for fault injection (never for accuracy)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from app.engine import EngineInfo
from app.windows import SAMPLE_RATE, DecodeOptions, Encoded, Prompt, Window, WindowResult, Word

BOUND = 30  # seconds: a bound on waits so a broken batcher fails the test instead of hanging it


async def gather(futs: list[asyncio.Future]) -> list:
    return await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), BOUND)


F = TypeVar("F", bound="FakeEngine")


class Rig(Generic[F]):
    """A batcher on fake engines, wired as the service wires it (``make_pool`` and
    ``make_batcher``): the rig of the batcher's, stages', urgency, placement and live decoding
    tests. ``fakes[k]`` is engine ``k``; ``retired`` the worker counts the pool took out."""

    def __init__(self, fakes: Sequence[F], **batcher: Any) -> None:
        from app.config import BatcherSettings, Settings
        from app.engine.placement import make_pool
        from app.jobs.pipeline import make_batcher
        from app.metrics import Metrics

        self.fakes = list(fakes)
        self.metrics = Metrics()
        self.pool = make_pool(self.fakes)
        self.batcher = make_batcher(Settings(batcher=BatcherSettings(**batcher)), self.pool,
                                    self.metrics)
        self.retired: list[int] = []
        retire = self.pool.on_remove

        def removed(n: int) -> None:
            self.retired.append(n)
            if retire is not None:
                retire(n)

        self.pool.on_remove = removed

    @property
    def fake(self) -> F:
        return self.fakes[0]

    async def blocker(self, seconds: float = 2.0, tag: int = 999) -> list[asyncio.Future[Any]]:
        """Close the gate and park one window of ``seconds`` (job ``blocker``) inside the
        engine, so the next ones queue up; :meth:`release` lets it go."""
        self.fake.gate.clear()
        futs = self.batcher.submit("blocker", [tagged_window(tag, seconds)], DecodeOptions())
        await self.hold()
        return futs

    async def hold(self, n: int = 1) -> None:
        """Wait until ``n`` more engine calls are parked inside the (closed) gate."""
        for _ in range(n):
            await asyncio.to_thread(self.fake.entered.acquire, True, BOUND)

    def release(self) -> None:
        self.fake.gate.set()

    async def run(self, n: int, job: str = "j") -> list[Any]:
        """``n`` windows of one job through the batcher: their results (or exceptions)."""
        return await gather(self.batcher.submit(job, [tagged_window(i) for i in range(n)],
                                                DecodeOptions()))

    def sizes(self) -> list[int]:
        """The size of each batch the (unstaged) engine ran, in order."""
        return [len(tags) for _, tags in self.fake.batches]

    def tags(self, k: int = 0) -> list[int]:
        """Every window engine ``k`` ran, in order."""
        return [t for _, tags in self.fakes[k].batches for t in tags]

    def calls(self, stage: str | None = None) -> list[list[int]]:
        """The windows of each call of a staged engine (of ``stage`` only, if given)."""
        fake = self.fake
        assert isinstance(fake, FakeStagedEngine)
        return [tags for s, tags in fake.calls if stage in (None, s)]

    def shed(self) -> float:
        """Interim reads the batcher shed."""
        return float(self.metrics.interim_shed._value.get())


class Rigs:
    """The rigs a test made (started), stopped at teardown with every gate open: the
    ``rigs`` fixture (tests/conftest.py)."""

    def __init__(self) -> None:
        self._made: list[Rig[Any]] = []

    def make(self, *fakes: F, **batcher: Any) -> Rig[F]:
        """A started :class:`Rig` on ``fakes``; ``batcher`` as BatcherSettings' fields."""
        rig = Rig(fakes, **batcher)
        rig.batcher.start()
        self._made.append(rig)
        return rig

    async def stop(self) -> None:
        for rig in self._made:
            for fake in rig.fakes:
                fake.gate.set()
                if isinstance(fake, FakeStagedEngine):
                    fake.redo_gate.set()
            await rig.batcher.stop(5)
            rig.pool.close()


def tagged_window(tag: int, seconds: float = 2.0, start: float = 0.0,
                  prompt: Prompt | None = None) -> Window:
    """A window whose first sample encodes ``tag`` so results can be traced to their window."""
    audio = np.zeros(max(1, int(seconds * SAMPLE_RATE)), dtype=np.float32)
    audio[0] = tag / 1e6
    return Window(audio, start, start + seconds, prompt or Prompt(language="en"))


def tag_of(w: Window) -> int:
    return round(float(w.audio[0]) * 1e6)


def language_of(w: Window) -> tuple[str, float | None]:
    """What the real engine would use: the window's language, else its upload's choice (the
    fake "detects" English, p=0.99), else its own detection."""
    if w.prompt.language:
        return w.prompt.language, None
    if w.prompt.choice is not None:
        return w.prompt.choice.decide("en", 0.99)
    return "en", 0.99


class FakeEngine:
    """Records every batch; ``fail`` decides per batch whether to raise (fault injection)."""

    def __init__(self, workers: int = 1, fail: Callable[[Sequence[Window]], None] | None = None):
        self.info = EngineInfo("fake", "cpu", "int8", workers)
        self.batches: list[tuple[DecodeOptions, list[int]]] = []
        self.fail = fail
        self.gate = threading.Event()  # cleared: batches block until the test opens the gate
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.started: list[int] = []  # each batch's size as it entered, before the gate
        self._lock = threading.Lock()

    def transcribe_batch(self, windows: Sequence[Window], options: DecodeOptions) -> list[WindowResult]:
        with self._lock:
            self.started.append(len(windows))
        self.entered.release()
        self.gate.wait(60)
        with self._lock:
            self.batches.append((options, [tag_of(w) for w in windows]))
        if self.fail:
            self.fail(windows)
        if options.detect_only:
            return [WindowResult.detection(*language_of(w)) for w in windows]
        return [
            WindowResult(text=f"w{tag_of(w)}", language=language_of(w)[0],
                         language_probability=language_of(w)[1],
                         avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=1.0,
                         temperature=options.temperature,
                         # One word spanning the window, so word-timestamp paths run too.
                         words=[Word(f" w{tag_of(w)}", w.start, w.end, 1.0, [tag_of(w)])]
                         if options.word_timestamps else None)
            for w in windows
        ]

    def close(self) -> None:
        pass


class FakeStagedEngine(FakeEngine):
    """A fake whose encoder and decoder run as separate calls (the CPU engine's two stages).

    ``calls`` records ("encode" | "decode" | "run", tags) in order; a window's padded length is
    its duration rounded up to 5 s, as the dynamic time axis's classes are.
    """

    staged = True

    def __init__(self, workers: int = 1, fail: Callable[[str, Sequence[Window]], None] | None = None):
        super().__init__(workers)
        self.calls: list[tuple[str, list[int]]] = []
        self.stage_fail = fail
        self.loops: set[int] = set()  # tags whose decode asks for Whisper's 30 s fallback
        self.redo_gate = threading.Event()  # cleared: redo calls block until the test opens it
        self.redo_gate.set()

    def padded_samples(self, window: Window) -> int:
        step = 5 * SAMPLE_RATE
        return -(-len(window.audio) // step) * step

    def _enter(self, stage: str, windows: Sequence[Window]) -> None:
        self.entered.release()
        self.gate.wait(60)
        with self._lock:
            self.calls.append((stage, [tag_of(w) for w in windows]))
        if self.stage_fail:
            self.stage_fail(stage, windows)

    def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        self._enter("encode", windows)
        return [Encoded(self.padded_samples(w), np.array([tag_of(w)], np.float32),
                        *language_of(w)) for w in windows]

    def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
               options: DecodeOptions, redo: bool = True) -> list[WindowResult]:
        """A window in ``loops`` reads "redo<tag>" after its fallback: inside this call with
        ``redo`` (the engine's default), else marked for :meth:`redo`, reading "w<tag>"."""
        assert len({e.samples for e in encoded}) == 1, "a decoder batch mixes padded lengths"
        assert [int(e.features[0]) for e in encoded] == [tag_of(w) for w in windows]
        self._enter("decode", windows)
        out = [WindowResult(text=f"w{tag_of(w)}", language=e.language, language_probability=None,
                            avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=1.0)
               for w, e in zip(windows, encoded, strict=True)]
        for w, r in zip(windows, out, strict=True):
            if tag_of(w) in self.loops:
                r.text, r.redo = (f"redo{tag_of(w)}", False) if redo else (r.text, True)
        return out

    def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
             options: DecodeOptions) -> list[WindowResult]:
        self._enter("redo", windows)
        self.redo_gate.wait(60)
        return [WindowResult(text=f"redo{tag_of(w)}", language=e.language,
                             language_probability=None, avg_logprob=-0.1, no_speech_prob=0.0,
                             compression_ratio=1.0) for w, e in zip(windows, encoded, strict=True)]

    def transcribe_batch(self, windows: Sequence[Window], options: DecodeOptions) -> list[WindowResult]:
        self._enter("run", windows)
        return [WindowResult(text=f"w{tag_of(w)}", language=language_of(w)[0],
                             language_probability=None, avg_logprob=-0.1, no_speech_prob=0.0,
                             compression_ratio=1.0) for w in windows]
