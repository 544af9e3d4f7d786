"""faster-whisper's ``WhisperModel`` on CTranslate2, batched: the resident model behind the engine seam.

CTranslate2 runs ``num_workers`` batches concurrently, one per dedicated thread (see
:class:`app.engine.placement.EngineRunner`). One call: mel for the batch (one torch op), the
encoder once, the language detected from that same encoder output for windows that have none,
then one decoder batch in which every window has its own prompt (language, initial prompt,
hotwords: :mod:`app.engine.decoding`). Detection therefore costs one decoder step on an encoder
output the transcription needed anyway, at the window's own (dynamic) length, instead of a
separate 30 s call per upload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from app.config import ModelSettings
from app.engine import EngineInfo
from app.engine.decoder import Fallback, WindowDecoder, fallback_for
from app.engine.decoding import batch_rows, budget
from app.engine.device import resolve_compute_type, resolve_device, torch_device
from app.engine.language import LanguageDetector, Languages
from app.engine.mel import encoder_input
from app.engine.threads import limit_pools
from app.windows import (
    N_SAMPLES,
    PAD_STEP_S,
    SAMPLE_RATE,
    DecodeOptions,
    Encoded,
    Window,
    WindowResult,
)

log = logging.getLogger(__name__)


def padded_length(samples: int, margin: int) -> int:
    """Dynamic time axis: samples + margin, rounded up to a 5 s class, at most 30 s."""
    step = PAD_STEP_S * SAMPLE_RATE
    return min(N_SAMPLES, math.ceil((samples + margin) / step) * step)


def time_axis(settings: ModelSettings, device: str) -> str:
    """``auto``: the dynamic axis on every device, where it keeps accuracy. Measured on the
    corpus through this engine (loadtest/results/dynamic-axis-cpu.json: 83 clips, 88 windows,
    int8): WER 13.18 % dynamic against 13.25 % on the 30 s axis (read speech 5.63 % both) for
    61 % of the encoder's padded seconds; without the 30 s redo of looping or unsure windows
    13.25 %, so the redo is what keeps it. A window's accuracy at its padded length is the
    model's, not the device's: a GPU runs the same decode in float16 (scripts/gpu-check's
    ``time_axes`` step measures it there). On a GPU the encoder and the decoder's cross-
    attention both shrink with the axis (the bare encoder ran 551 windows/s at 30 s and 3,430
    at 10 s on the H200: loadtest/results/gpu-h200.json); the batcher groups a batch by padded
    length (:func:`size_class`), so one call still holds one length."""
    if settings.time_axis != "auto":
        return settings.time_axis
    return "dynamic"


def size_class(settings: ModelSettings, device: str) -> Callable[[Window], int] | None:
    """What the batcher should group by so a batch shares one padded length (None: duration)."""
    if time_axis(settings, device) != "dynamic":
        return None
    margin = int(settings.pad_margin_s * SAMPLE_RATE)
    return lambda w: padded_length(len(w.audio), margin)


class WhisperEngine:
    """One resident WhisperModel, ``num_workers`` concurrent batches."""

    def __init__(self, model_path: str, settings: ModelSettings, model_name: str) -> None:
        # faster-whisper's class, not whisperx's subclass: the engine uses only what the base
        # defines (encode, the CTranslate2 model, tokenizer, prompts). whisperx.asr imports
        # transformers and pyannote.audio: 10.5 s against 0.3 s here (cold), and pyannote's
        # torchcodec warns that it finds no FFmpeg; a GPU image need not carry either.
        from faster_whisper import WhisperModel

        # torch (the mel on a GPU, pyannote, the speakers) and numpy's BLAS (the mel on the CPU)
        # kept small so they never fight CTranslate2's threads (app/engine/threads.py).
        limit_pools(settings.torch_threads)
        # app.engine.loading.engine_settings resolves every "auto" before the service calls
        # this; resolving here again keeps direct callers (tests, benchmarks) working.
        device = resolve_device(settings.device)
        index = settings.device_index if device == "cuda" else 0
        compute_type = resolve_compute_type(settings.compute_type, device, index)
        workers = settings.num_workers or (2 if device == "cuda" else _cpu_count())
        self.model = WhisperModel(
            model_path,
            device=device,
            device_index=index,  # engine k: GPU k
            compute_type=compute_type,
            cpu_threads=settings.cpu_threads,
            num_workers=workers,
            local_files_only=settings.local_files_only,
        )
        # The model's own mel bins (128 for large-v3 and turbo), not the folder's preprocessor
        # file (faster-whisper assumes 80 without one).
        self.n_mels = int(getattr(self.model.model, "n_mels", 0)
                          or self.model.feat_kwargs.get("feature_size") or 80)
        self._device = device
        self._mel_device = torch_device(device, index)
        self._detector = LanguageDetector(self.model, device, self.n_mels, self._mel_device)
        self.dynamic = time_axis(settings, device) == "dynamic"
        self._margin = int(settings.pad_margin_s * SAMPLE_RATE)
        self._tokens_per_s = settings.max_tokens_per_s
        self._decoder = WindowDecoder(self.model, int(self.model.max_length),
                                      tuple(settings.loop_penalties), settings.unsure_beam_size)
        self.info = EngineInfo(model_name, device, compute_type, workers, index)
        log.info("engine ready: %s", self.info)

    def padded_samples(self, window: Window) -> int:
        """How far a window is zero-padded: 30 s, or its length + margin in 5 s steps.

        Whisper was trained on 30 s inputs, but CTranslate2's encoder takes fewer frames and
        costs about linearly in them; with a few seconds of trailing silence the decoder
        behaves as on 30 s (with under ~2 s it loops)."""
        if not self.dynamic:
            return N_SAMPLES
        margin = self._margin if window.pad_margin_s is None else \
            int(window.pad_margin_s * SAMPLE_RATE)
        return padded_length(len(window.audio), margin)

    # ---- one call ---------------------------------------------------------------------------
    def transcribe_batch(
        self, windows: Sequence[Window], options: DecodeOptions
    ) -> list[WindowResult]:
        """On CPU, windows of one padded length share a call: a batch that mixes a 3 s clip with
        a 28 s one runs as two sub-batches rather than padding all to 30 s (the encoder is ~3/4
        of a batch's time there and scales with the padded length). On a GPU one call pads the
        batch to its longest window: a decoder step costs about the same at any batch size."""
        out: list[WindowResult | None] = [None] * len(windows)
        for n, idx in sorted(self._classes(windows).items()):
            part = [windows[k] for k in idx]
            for k, r in zip(idx, self._run(part, options, n), strict=True):
                out[k] = r
        return [r for r in out if r is not None]

    def _classes(self, windows: Sequence[Window]) -> dict[int, list[int]]:
        """Indices of the windows by padded length: one encoder shape per call."""
        lengths = [self.padded_samples(w) for w in windows]
        if self._device != "cpu":
            return {max(lengths): list(range(len(windows)))}
        classes: dict[int, list[int]] = {}
        for k, n in enumerate(lengths):
            classes.setdefault(n, []).append(k)
        return classes

    def _run(self, windows: Sequence[Window], options: DecodeOptions, n: int,
             languages: Languages | None = None) -> list[WindowResult]:
        """Encode at ``n``, then decode with every fallback (or stop at the language)."""
        enc, langs = self._encode(windows, n, languages)
        if options.detect_only:
            return [WindowResult.detection(lang, prob) for lang, prob in langs]
        return self._decode(windows, enc, langs, options, n)

    # ---- the two stages, apart (see Encoded) --------------------------------------------------
    @property
    def staged(self) -> bool:
        """Encoder outputs can wait in host memory between stages (CPU: they already live there)."""
        return self.info.device == "cpu"

    def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        """Stage 1: every window's encoder output and language, one call per padded length."""
        out: list[Encoded | None] = [None] * len(windows)
        for n, idx in self._classes(windows).items():
            enc, languages = self._encode([windows[k] for k in idx], n)
            rows = np.asarray(enc)  # a view of CTranslate2's CPU buffer; rows keep it alive
            for j, k in enumerate(idx):
                out[k] = Encoded(n, rows[j], *languages[j])
        return [e for e in out if e is not None]

    def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
               options: DecodeOptions, redo: bool = True) -> list[WindowResult]:
        """Stage 2: one decoder batch over windows encoded by any earlier calls (one length).

        ``redo=False``: Whisper's fallbacks (:func:`app.engine.decoder.fallback_for`) are left
        out of this call; a window the rule names comes back as its first pass marked ``redo``,
        for :meth:`redo` in a call of its own. Measured beside a 20-minute upload
        (loadtest/results/stall.json): a decoder batch of 8 plain windows took 1.25 s, 7 plain
        and one looping clip 8.23 s; every window of the batch waited for the loop's
        fallbacks."""
        n = encoded[0].samples
        if any(e.samples != n for e in encoded):
            raise ValueError("a decoder batch needs one padded length")
        languages = [(e.language, e.language_probability) for e in encoded]
        return self._decode(windows, _stacked(encoded), languages, options, n, fallback=redo)

    def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
             options: DecodeOptions) -> list[WindowResult]:
        """The fallbacks :meth:`decode` left out (``redo=False``): the same text as a decode
        with them (a decode is deterministic, so the first pass repeats exactly). A window
        encoded below its final length (:meth:`final_samples`) is encoded again there; one at
        it decodes from its encoder output."""
        out: list[WindowResult] = []
        for w, e in zip(windows, encoded, strict=True):
            language = [(e.language, e.language_probability)]
            final = self.final_samples(w)
            if e.samples >= final:
                out += self._decode([w], _stacked([e]), language, options, e.samples)
            else:
                out += self._run([w], options, final, language)
        return out

    def final_samples(self, window: Window) -> int:
        """Where a window's fallbacks run: Whisper's 30 s, except a window padded under the
        engine's own margin (a live turn, ``pad_margin_s``), whose fallbacks run at the length
        the engine's margin gives it, with no 30 s step. A live final's redo is on its turn's
        latency, and the 30 s step was most of it: at 16 live streams beside a long upload
        (engine trace, 9363db1), 20 of 129 finals were redone, 12.0 worker-seconds in all;
        those that went on to 30 s took 0.9-1.6 s each, and redone finals were 4 of the 5
        slowest (turn p95 1.67 s). With the fallbacks at the engine's margin: 21 redos, 5.1
        worker-seconds, none over 0.7 s, p95 1.17 s; 17 of the 20 texts matched the 30 s ones,
        the other three were short turns of near-silence or hesitation where the 30 s read was
        no safer ("here." read "Thank you." at 30 s, "Thanks for watching." at 10 s); live
        WER: loadtest/README.md."""
        if not self.dynamic or window.pad_margin_s is None:
            return N_SAMPLES
        own = padded_length(len(window.audio), self._margin)
        return own if self.padded_samples(window) < own < N_SAMPLES else N_SAMPLES

    # ---- the model calls --------------------------------------------------------------------
    def _encode(self, windows: Sequence[Window], n: int,
                languages: Languages | None = None) -> tuple[Any, Languages]:
        """The encoder output of a batch. On CPU each window is encoded alone and the outputs
        stacked for the decoder: the encoder costs the same per window in a call of one as of
        several (and gives the same values), but its memory grows with the call (+81 MB for
        one 30 s window, +189 MB for two), while what batching buys is in the decoder. On a
        lone 20-minute upload's windows, 2 workers x 1 thread, calls of 2 windows: 30.8-34.7x
        real time at +430 MB above the loaded model encoded together, 32.1-32.5x at +294 MB
        one by one (``python -m loadtest.long_alone``, loadtest/results/long-alone.json)."""
        if self._device == "cpu" and len(windows) > 1:
            import ctranslate2

            rows = [np.asarray(self.model.model.encode(
                encoder_input([w.audio], n, self.n_mels, self._mel_device))) for w in windows]
            encoder_output = ctranslate2.StorageView.from_array(np.concatenate(rows))
        else:
            feats = encoder_input([w.audio for w in windows], n, self.n_mels, self._mel_device)
            encoder_output = self.model.model.encode(feats)
        return encoder_output, languages or self._detector.languages(windows, encoder_output, n)

    def _decode(self, windows: Sequence[Window], encoder_output: Any, languages: Languages,
                options: DecodeOptions, n: int, fallback: bool = True) -> list[WindowResult]:
        """Every window decoded from an encoder output of padded length ``n``, then Whisper's
        fallbacks by the one rule (:func:`app.engine.decoder.fallback_for`): those at the final
        length inside each beam's call (:meth:`_decode_part`), then windows below it encoded
        again at their final length and decoded there (:attr:`Fallback.AXIS`). ``fallback``
        False: none of them; each window the rule names is marked ``redo``.

        Windows whose languages ask for different beams (:meth:`DecodeOptions.beam_for`)
        decode in one generate per beam, from the same encoder output. The batcher sized the
        batch for ``beam_size``; on a GPU a wider beam's windows go in parts of ``batch x
        beam_size // beam``, so a call never holds more decoder states than the batch was
        sized for (as :meth:`WindowDecoder.widen`). On CPU they stay one call, as measured
        there: states cost host memory only, and beam 5 for the non-English windows took 3-11 %
        more engine time than beam 1 at batch 8."""
        below = [n < self.final_samples(w) for w in windows]
        beams = [options.beam_for(lang) for lang, _ in languages]
        out: list[WindowResult | None] = [None] * len(windows)
        for beam in sorted(set(beams)):
            idx = [k for k, b in enumerate(beams) if b == beam]
            step = len(idx)
            if self._device != "cpu" and beam > options.beam_size:
                step = max(1, len(windows) * options.beam_size // beam)
            for i in range(0, len(idx), step):
                part = idx[i:i + step]
                rows = (encoder_output if len(part) == len(beams)
                        else batch_rows(encoder_output, part))
                for k, r in zip(part, self._decode_part(
                        [windows[k] for k in part], rows, [languages[k] for k in part],
                        replace(options, beam_size=beam, other_beam_size=None),
                        [below[k] for k in part], fallback),
                        strict=True):
                    out[k] = r
        done = [r for r in out if r is not None]
        steps = [self._fallback(r, b, options, low) for r, b, low in zip(done, beams, below,
                                                                        strict=True)]
        if not fallback:
            for r, step_ in zip(done, steps, strict=True):
                r.redo = step_ is not None
            return done
        axis = [k for k, step_ in enumerate(steps) if step_ is Fallback.AXIS]
        if axis:
            self._redo_axis(windows, languages, options, done, axis)
        return done

    def _redo_axis(self, windows: Sequence[Window], languages: Languages, options: DecodeOptions,
                   out: list[WindowResult], idx: list[int]) -> None:
        """:attr:`Fallback.AXIS`: windows ``idx`` encoded again at their final length and
        decoded there, their fallbacks included (the language stays the one decided)."""
        finals: dict[int, list[int]] = {}
        for k in idx:
            finals.setdefault(self.final_samples(windows[k]), []).append(k)
        for final, part in finals.items():
            again = self._run([windows[k] for k in part], options, final,
                              [languages[k] for k in part])
            for k, r in zip(part, again, strict=True):
                out[k] = r

    def _fallback(self, r: WindowResult, beam: int, options: DecodeOptions,
                  below_final: bool) -> Fallback | None:
        return fallback_for(r, beam, options.temperature, below_final, self._decoder.wide,
                            self._decoder.penalties)

    def _decode_part(self, windows: Sequence[Window], encoder_output: Any, languages: Languages,
                     options: DecodeOptions, below: list[bool], fallback: bool
                     ) -> list[WindowResult]:
        """One beam's windows: the first pass, :attr:`Fallback.WIDEN` and
        :attr:`Fallback.UNLOOP` for those at their final length, then word alignment."""
        task = options.task
        dec = self._decoder
        prompts = [dec.prompts.tokens(w.prompt, lang, task)
                   for w, (lang, _) in zip(windows, languages, strict=True)]
        budgets = [budget(w.duration, self._tokens_per_s, dec.limit) for w in windows]
        out = dec.first_pass(encoder_output, prompts, budgets, languages, options)
        if fallback and not all(below):
            steps = [self._fallback(r, options.beam_size, options, low)
                     for r, low in zip(out, below, strict=True)]
            dec.widen(encoder_output, prompts, budgets, languages, options, out,
                      [k for k, s in enumerate(steps) if s is Fallback.WIDEN])
            dec.unloop(encoder_output, prompts, budgets, languages, options, out,
                       [k for k, s in enumerate(steps) if s is Fallback.UNLOOP])
        if options.word_timestamps:
            from app.engine.words import align  # imports torch-free numpy code only when asked

            tokenizers = {lang: dec.prompts.tokenizer(lang, task) for lang, _ in languages}
            aligned = align(self.model.model, encoder_output, windows, out, tokenizers)
            for r, words in zip(out, aligned, strict=True):
                r.words = words
        return out

    def close(self) -> None:
        del self.model


def _stacked(encoded: Sequence[Encoded]) -> Any:
    """Encoder outputs kept in host memory, as one batch for the decoder."""
    import ctranslate2

    return ctranslate2.StorageView.from_array(np.stack([e.features for e in encoded]))


def _cpu_count() -> int:
    import os

    return max(1, len(os.sched_getaffinity(0)))
