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
from app.engine.decoding import (
    Prompts,
    batch_rows,
    budget,
    degenerate,
    max_length,
    prefix_tokens,
    search_args,
    to_result,
    unsure,
)
from app.engine.device import resolve_compute_type, resolve_device, torch_device
from app.engine.language import LanguageDetector, Languages
from app.engine.mel import encoder_input
from app.windows import (
    N_SAMPLES,
    PAD_STEP_S,
    SAMPLE_RATE,
    DecodeOptions,
    Encoded,
    Task,
    Window,
    WindowResult,
)

log = logging.getLogger(__name__)


def padded_length(samples: int, margin: int) -> int:
    """Dynamic time axis: samples + margin, rounded up to a 5 s class, at most 30 s."""
    step = PAD_STEP_S * SAMPLE_RATE
    return min(N_SAMPLES, math.ceil((samples + margin) / step) * step)


def time_axis(settings: ModelSettings, device: str) -> str:
    """``auto``: dynamic on CPU (measured there), Whisper's full 30 s on CUDA (not measured)."""
    if settings.time_axis != "auto":
        return settings.time_axis
    return "full" if device == "cuda" else "dynamic"


def size_class(settings: ModelSettings, device: str) -> Callable[[Window], int] | None:
    """What the batcher should group by so a batch shares one padded length (None: duration)."""
    if time_axis(settings, device) != "dynamic":
        return None
    margin = int(settings.pad_margin_s * SAMPLE_RATE)
    return lambda w: padded_length(len(w.audio), margin)


class WhisperEngine:
    """One resident WhisperModel, ``num_workers`` concurrent batches."""

    def __init__(self, model_path: str, settings: ModelSettings, model_name: str) -> None:
        import torch

        # faster-whisper's class, not whisperx's subclass: the engine uses only what the base
        # defines (encode, the CTranslate2 model, tokenizer, prompts). whisperx.asr imports
        # transformers and pyannote.audio: 10.5 s against 0.3 s here (cold), and pyannote's
        # torchcodec warns that it finds no FFmpeg; a GPU image need not carry either.
        from faster_whisper import WhisperModel

        # Mel is computed with torch; keep its pool small so it never fights CTranslate2's.
        torch.set_num_threads(settings.torch_threads)
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
        self._prompts = Prompts(self.model)
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
        self._penalties = tuple(settings.loop_penalties)
        self._wide = settings.unsure_beam_size
        self._limit = int(self.model.max_length)
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
            for k, r in zip(idx, self._transcribe(part, options, n), strict=True):
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

    def _transcribe(self, windows: Sequence[Window], options: DecodeOptions, n: int,
                    languages: Languages | None = None) -> list[WindowResult]:
        enc, langs = self._encode(windows, n, languages)
        if options.detect_only:
            return [WindowResult.detection(lang, prob) for lang, prob in langs]
        out = self._decode(windows, enc, langs, options, n)
        return self._redo_degenerate(windows, out, langs, options, n)

    def _redo_degenerate(self, windows: Sequence[Window], out: list[WindowResult],
                         languages: Languages, options: DecodeOptions,
                         n: int) -> list[WindowResult]:
        if n < N_SAMPLES:
            # Safety net for the shortened axis: redo at the full 30 s windows whose decode looks
            # degenerate by Whisper's own fallback rules (a loop compresses > 2.4; a
            # low-confidence decode of real speech). The redo is the full axis's own decode, its
            # wider beam for unsure windows included (:meth:`_widen`), so both axes read such a
            # window alike. Running the redo straight at the wider beam lost the 30 s decode at
            # the request's beam: a Chinese clip translated to "4035-1-7-7-8-8-8-8-..." at beam
            # 5 (a loop short enough to compress < 2.4) where beam 1 reads a sentence. Language
            # stays the one already decided.
            redo = [k for k, r in enumerate(out)
                    if (degenerate(r) or unsure(r)) and not r.doubtful]
            if redo:
                again = self._transcribe([windows[k] for k in redo], options, N_SAMPLES,
                                         [languages[k] for k in redo])
                for k, r in zip(redo, again, strict=True):
                    out[k] = r
        return out

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

        ``redo=False``: Whisper's fallbacks (the 30 s redo of a looping or unsure window on the
        shortened axis, ``_widen`` and ``_unloop`` at 30 s) are left out of this call; such a
        window comes back as its first pass marked ``redo``, for :meth:`redo` in a call of its
        own. Measured beside a 20-minute upload (loadtest/results/stall.json): a decoder batch
        of 8 plain windows took 1.25 s, 7 plain and one looping clip 8.23 s; every window of the
        batch waited for the loop's fallbacks."""
        n = encoded[0].samples
        if any(e.samples != n for e in encoded):
            raise ValueError("a decoder batch needs one padded length")
        languages = [(e.language, e.language_probability) for e in encoded]
        out = self._decode(windows, _stacked(encoded), languages, options, n, fallback=redo)
        if not redo:
            for r in out:
                r.redo = self._needs_redo(r, options, n)
            return out
        return self._redo_degenerate(windows, out, languages, options, n)

    def redo(self, windows: Sequence[Window], encoded: Sequence[Encoded],
             options: DecodeOptions) -> list[WindowResult]:
        """The fallbacks :meth:`decode` left out (``redo=False``): the same text as a decode
        with them (a decode is deterministic, so the first pass repeats exactly). Windows
        shorter than 30 s are encoded again at 30 s (a live final: at the engine's margin, see
        :meth:`_redo_length`); 30 s ones decode from their encoder output."""
        languages = [(e.language, e.language_probability) for e in encoded]
        out: list[WindowResult | None] = [None] * len(windows)
        for k, (w, e) in enumerate(zip(windows, encoded, strict=True)):
            if e.samples == N_SAMPLES:
                [out[k]] = self._decode([w], _stacked([e]), [languages[k]], options, N_SAMPLES)
            elif (n := self._redo_length(w, e.samples)) < N_SAMPLES:
                enc, langs = self._encode([w], n, [languages[k]])
                [out[k]] = self._decode([w], enc, langs, options, n, fallback=True, anywhere=True)
            else:
                [out[k]] = self._transcribe([w], options, n, [languages[k]])
        return [r for r in out if r is not None]

    def _redo_length(self, window: Window, samples: int) -> int:
        """Where a window's redo is encoded: 30 s, except a window padded under the engine's own
        margin (a live final, ``pad_margin_s``), which is read as the engine pads it, with
        Whisper's fallbacks (:meth:`_widen`, :meth:`_unloop`) run at that length and no 30 s
        step (:meth:`redo`). A live final's redo is on its turn's latency, and the 30 s step
        was most of it: at 16 live streams beside a long upload (engine trace, 9363db1), 20 of
        129 finals were redone, 12.0 worker-seconds in all; those that went on to 30 s took
        0.9-1.6 s each, and redone finals were 4 of the 5 slowest (turn p95 1.67 s). With the
        fallbacks at the engine's margin: 21 redos, 5.1 worker-seconds, none over 0.7 s, p95
        1.17 s; 17 of the 20 texts matched the 30 s ones, the other three were short turns of
        near-silence or hesitation where the 30 s read was no safer ("here." read "Thank you."
        at 30 s, "Thanks for watching." at 10 s); live WER: loadtest/README.md."""
        own = padded_length(len(window.audio), self._margin)
        if window.pad_margin_s is not None and samples < own < N_SAMPLES:
            return own
        return N_SAMPLES

    def _needs_redo(self, r: WindowResult, options: DecodeOptions, n: int) -> bool:
        """Would a decode with fallbacks have decoded this window again (see :meth:`decode`)?"""
        if r.doubtful:
            return False
        if n < N_SAMPLES:
            return degenerate(r) or unsure(r)  # as _redo_degenerate
        if options.temperature != 0:
            return False
        widen = unsure(r) and not degenerate(r) and options.beam_for(r.language) < self._wide
        return widen or (degenerate(r) and bool(self._penalties))

    # ---- the model calls --------------------------------------------------------------------
    def _encode(self, windows: Sequence[Window], n: int,
                languages: Languages | None = None) -> tuple[Any, Languages]:
        feats = encoder_input([w.audio for w in windows], n, self.n_mels, self._mel_device)
        encoder_output = self.model.model.encode(feats)
        return encoder_output, languages or self._detector.languages(windows, encoder_output, n)

    def _decode(self, windows: Sequence[Window], encoder_output: Any, languages: Languages,
                options: DecodeOptions, n: int, fallback: bool = True, anywhere: bool = False
                ) -> list[WindowResult]:
        """Windows whose languages ask for different beams (:meth:`DecodeOptions.beam_for`)
        decode in one generate per beam, from the same encoder output. The batcher sized the
        batch for ``beam_size``; on a GPU a wider beam's windows go in parts of ``batch x
        beam_size // beam``, so a call never holds more decoder states than the batch was
        sized for (as :meth:`_widen`). On CPU they stay one call, as measured there: states
        cost host memory only, and beam 5 for the non-English windows took 3-11 % more engine
        time than beam 1 at batch 8."""
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
                for k, r in zip(part, self._decode_one(
                        [windows[k] for k in part], rows, [languages[k] for k in part],
                        replace(options, beam_size=beam, other_beam_size=None), n, fallback,
                        anywhere),
                        strict=True):
                    out[k] = r
        return [r for r in out if r is not None]

    def _decode_one(self, windows: Sequence[Window], encoder_output: Any, languages: Languages,
                    options: DecodeOptions, n: int, fallback: bool = True, anywhere: bool = False
                    ) -> list[WindowResult]:
        task = options.task
        prompts = [self._prompts.tokens(w.prompt, lang, task)
                   for w, (lang, _) in zip(windows, languages, strict=True)]
        budgets = [budget(w.duration, self._tokens_per_s, self._limit) for w in windows]
        results = self._generate(encoder_output, prompts, options, budgets)
        out = [self._result(res, lang, prob, task, options, b, p)
               for (lang, prob), res, b, p in zip(languages, results, budgets, prompts,
                                                  strict=True)]
        # A window that used its budget without looping holds dense speech (a script whose
        # words take many tokens each), not a loop: decode it again at the model's limit.
        full = [k for k, r in enumerate(out)
                if len(r.tokens) >= budgets[k] and budgets[k] < self._limit // 2
                and not degenerate(r)]
        limits = [self._limit // 2] * len(out)
        for k, r in zip(full, self._again(encoder_output, full, prompts, limits, languages,
                                          options), strict=True):
            out[k] = r
        if (n == N_SAMPLES or anywhere) and options.temperature == 0 and fallback:
            self._widen(encoder_output, prompts, budgets, languages, options, out)
            self._unloop(encoder_output, prompts, budgets, languages, options, out)
        if options.word_timestamps:
            from app.engine.words import align  # imports torch-free numpy code only when asked

            tokenizers = {lang: self._prompts.tokenizer(lang, task) for lang, _ in languages}
            aligned = align(self.model.model, encoder_output, windows, out, tokenizers)
            for r, words in zip(out, aligned, strict=True):
                r.words = words
        return out

    def _widen(self, encoder_output: Any, prompts: list[list[int]], budgets: list[int],
               languages: Languages, options: DecodeOptions, out: list[WindowResult]) -> None:
        """Windows still unsure at 30 s (:func:`unsure`), decoded again at ``unsure_beam_size``
        from the same encoder output, keeping the decode of higher average log-probability that
        does not loop (faster-whisper's rule among its fallbacks: the best below the compression
        threshold). The dynamic axis's 30 s redo (:meth:`_redo_degenerate`) comes here too.
        Never more decoder states than the batch had: groups of ``batch * beam // wide``."""
        if options.beam_size >= self._wide:
            return
        todo = [k for k, r in enumerate(out) if unsure(r) and not degenerate(r) and not r.doubtful]
        wide = replace(options, beam_size=self._wide)
        step = max(1, len(out) * options.beam_size // self._wide)
        for i in range(0, len(todo), step):
            part = todo[i:i + step]
            for k, r in zip(part, self._again(encoder_output, part, prompts, budgets, languages,
                                              wide), strict=True):
                if r.avg_logprob > out[k].avg_logprob and not degenerate(r):
                    out[k] = r  # a loop scores high (measured -0.3 against -1.66): never it

    def _unloop(self, encoder_output: Any, prompts: list[list[int]], budgets: list[int],
                languages: Languages, options: DecodeOptions, out: list[WindowResult]) -> None:
        """Windows that still loop at Whisper's 30 s, decoded again with a repetition penalty.

        faster-whisper falls back to sampling at rising temperatures; sampling draws from each
        CTranslate2 worker thread's own generator, so a window's text would depend on what ran
        on that thread before it. A repetition penalty is deterministic and per window, and
        breaks the loops too (measured: a 15 s Japanese clip translated as "a ship of
        shipwrecked ships, ..." to the decode cap at beam 1 and 5; at 1.1 it is a sentence;
        over the 12 translated clips chrF rose 35.1 -> 37.9 at beam 1, 36.8 -> 40.3 at beam 5).
        Each of ``loop_penalties`` is tried on the windows the one before left looping; a
        window keeps the decode that compresses least."""
        loops = [k for k, r in enumerate(out) if degenerate(r) and not r.doubtful]
        for penalty in self._penalties:
            if not loops:
                return
            again = self._again(encoder_output, loops, prompts, budgets, languages, options,
                                repetition_penalty=penalty)
            for k, r in zip(loops, again, strict=True):
                if r.compression_ratio < out[k].compression_ratio:
                    out[k] = r
            loops = [k for k in loops if degenerate(out[k])]

    def _again(self, encoder_output: Any, idx: list[int], prompts: list[list[int]],
               budgets: list[int], languages: Languages, options: DecodeOptions,
               **extra: Any) -> list[WindowResult]:
        """Windows ``idx`` of a decoded batch, decoded again from its encoder output."""
        if not idx:
            return []
        results = self._generate(batch_rows(encoder_output, idx), [prompts[k] for k in idx],
                                 options, [budgets[k] for k in idx], **extra)
        out = []
        for k, res in zip(idx, results, strict=True):
            lang, prob = languages[k]
            out.append(self._result(res, lang, prob, options.task, options, budgets[k],
                                    prompts[k]))
        return out

    def _result(self, res: Any, lang: str, prob: float | None, task: Task,
                options: DecodeOptions, cut: int, prompt: list[int]) -> WindowResult:
        """A window's result; one that continued a prefix (``Prompt.prefix``) and reads as a
        loop or unsure is marked ``doubtful`` and left to its caller, who holds the audio
        without the context: no fallback here (measured offline on the corpus clips the live
        VAD splits: 3 of 16 continued turns looped, "... ... ...", each read well alone)."""
        tok = self._prompts.tokenizer(lang, task)
        pre = prefix_tokens(prompt, tok)
        r = to_result(res, lang, prob, tok, options, cut, pre)
        r.doubtful = bool(pre) and (degenerate(r) or unsure(r))
        return r

    def _generate(self, encoder_output: Any, prompts: list[list[int]], options: DecodeOptions,
                  budgets: list[int], **extra: Any) -> list[Any]:
        """One ``generate`` per position of <|startoftranscript|> in the prompts.

        CTranslate2 takes one prompt per batch item but requires the start token at the same
        position in all of them ("To work around this limitation, simply adapt the number of
        previous text tokens in each batch"). Languages and task sit after it, so windows of
        any languages always share a call; windows whose initial prompt and hotwords differ
        in token count go in separate calls of the same engine call."""
        sot = self._prompts.sot
        groups: dict[int, list[int]] = {}
        for k, p in enumerate(prompts):
            groups.setdefault(p.index(sot), []).append(k)
        out: list[Any] = [None] * len(prompts)
        for idx in groups.values():
            part = [prompts[k] for k in idx]
            length = max_length([budgets[k] for k in idx], part, self._limit)
            results = self.model.model.generate(
                batch_rows(encoder_output, idx), part, length_penalty=1, max_length=length,
                suppress_blank=True, suppress_tokens=[-1], return_scores=True,
                return_no_speech_prob=True, **search_args(options), **extra,
            )
            for k, r in zip(idx, results, strict=True):
                out[k] = r
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
