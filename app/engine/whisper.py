"""whisperx's batched ``WhisperModel`` on CTranslate2: the resident model behind the engine seam.

CTranslate2 runs ``num_workers`` batches concurrently, one per dedicated thread (see
:class:`app.engine.placement.EngineRunner`).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from app.config import ModelSettings
from app.engine import EngineInfo
from app.engine.device import resolve_compute_type, resolve_device
from app.windows import (
    N_SAMPLES,
    PAD_STEP_S,
    SAMPLE_RATE,
    TOKEN_SLACK,
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


def size_class(settings: ModelSettings) -> Callable[[Window], int] | None:
    """What the batcher should group by so a batch shares one padded length (None: duration)."""
    if settings.time_axis != "dynamic":
        return None
    margin = int(settings.pad_margin_s * SAMPLE_RATE)
    return lambda w: padded_length(len(w.audio), margin)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class WhisperEngine:
    """whisperx's batched WhisperModel, one resident copy, ``num_workers`` concurrent batches."""

    def __init__(self, model_path: str, settings: ModelSettings, model_name: str) -> None:
        import torch
        from faster_whisper.tokenizer import Tokenizer
        from whisperx.asr import WhisperModel

        # Mel is computed with torch; keep its pool small so it never fights CTranslate2's.
        torch.set_num_threads(settings.torch_threads)
        device = resolve_device(settings.device)
        compute_type = resolve_compute_type(settings.compute_type, device)
        workers = settings.num_workers or (1 if device == "cuda" else _cpu_count())
        self.model = WhisperModel(
            model_path,
            device=device,
            device_index=settings.device_index if device == "cuda" else 0,  # engine k: GPU k
            compute_type=compute_type,
            cpu_threads=settings.cpu_threads,
            num_workers=workers,
            local_files_only=settings.local_files_only,
        )
        self._tokenizer_cls = Tokenizer
        self._n_mels = int(self.model.feat_kwargs.get("feature_size") or 80)
        self._margin = (
            int(settings.pad_margin_s * SAMPLE_RATE) if settings.time_axis == "dynamic" else None
        )
        self._tokens_per_s = settings.max_tokens_per_s
        self.info = EngineInfo(model_name, device, compute_type, workers)
        log.info("engine ready: %s", self.info)

    def _tokenizer(self, language: str | None, task: Task) -> Any:
        multilingual = self.model.model.is_multilingual
        return self._tokenizer_cls(
            self.model.hf_tokenizer, multilingual, task=task,
            language=language if multilingual else "en",
        )

    def padded_samples(self, window: Window, options: DecodeOptions) -> int:
        """How far a window is zero-padded: 30 s, or its length + margin in 5 s steps.

        Whisper was trained on 30 s inputs, but CTranslate2's encoder takes fewer frames and
        costs about linearly in them; with a few seconds of trailing silence the decoder
        behaves as on 30 s (with under ~2 s it loops). Language detection keeps 30 s.
        """
        if self._margin is None or options.language is None:
            return N_SAMPLES
        return padded_length(len(window.audio), self._margin)

    def transcribe_batch(
        self, windows: Sequence[Window], options: DecodeOptions
    ) -> list[WindowResult]:
        # Windows of one padded length share an encoder call and a decode. A batch that mixes
        # a 3 s clip with a 28 s one runs as two sub-batches rather than padding all to 30 s:
        # on CPU the encoder is ~3/4 of a batch's time and scales with the padded length,
        # while splitting only costs the decoder some of its (smaller) batching gain.
        out: list[WindowResult | None] = [None] * len(windows)
        for n, idx in sorted(self._classes(windows, options).items()):
            for k, r in zip(idx, self._transcribe_padded([windows[k] for k in idx], options, n),
                            strict=True):
                out[k] = r
        return [r for r in out if r is not None]

    def _classes(self, windows: Sequence[Window], options: DecodeOptions) -> dict[int, list[int]]:
        """Indices of the windows by padded length: one encoder shape per call."""
        classes: dict[int, list[int]] = {}
        for k, w in enumerate(windows):
            classes.setdefault(self.padded_samples(w, options), []).append(k)
        return classes

    def _transcribe_padded(
        self, windows: Sequence[Window], options: DecodeOptions, n: int
    ) -> list[WindowResult]:
        return self._redo_degenerate(windows, self._transcribe(windows, options, n), options, n)

    def _redo_degenerate(self, windows: Sequence[Window], out: list[WindowResult],
                         options: DecodeOptions, n: int) -> list[WindowResult]:
        if n < N_SAMPLES:
            # Safety net for the shortened axis: redo, at the full 30 s, windows whose decode
            # looks degenerate by Whisper's own fallback rules (a loop compresses > 2.4; a
            # low-confidence decode of real speech). Rare, so it costs little.
            redo = [k for k, r in enumerate(out)
                    if _degenerate(r) or (r.avg_logprob < -1.0 and r.no_speech_prob < 0.6)]
            if redo:
                again = self._transcribe([windows[k] for k in redo], options, N_SAMPLES)
                for k, r in zip(redo, again, strict=True):
                    out[k] = r
        return out

    # ---- the two stages, apart (see Encoded) --------------------------------------------------
    @property
    def staged(self) -> bool:
        """Encoder outputs can wait in host memory between stages (CPU: they already live there)."""
        return self.info.device == "cpu"

    def encode(self, windows: Sequence[Window], options: DecodeOptions) -> list[Encoded]:
        """Stage 1: every window's encoder output (and detected language), one call per class."""
        out: list[Encoded | None] = [None] * len(windows)
        for n, idx in self._classes(windows, options).items():
            enc, languages = self._encode([windows[k] for k in idx], options, n)
            rows = np.asarray(enc)  # a view of CTranslate2's CPU buffer; rows keep it alive
            for j, k in enumerate(idx):
                out[k] = Encoded(n, rows[j], *languages[j])
        return [e for e in out if e is not None]

    def decode(self, windows: Sequence[Window], encoded: Sequence[Encoded],
               options: DecodeOptions) -> list[WindowResult]:
        """Stage 2: one decoder batch over windows encoded by any earlier calls (one class)."""
        import ctranslate2

        n = encoded[0].samples
        if any(e.samples != n for e in encoded):
            raise ValueError("a decoder batch needs one padded length")
        feats = ctranslate2.StorageView.from_array(np.stack([e.features for e in encoded]))
        languages = [(e.language, e.language_probability) for e in encoded]
        out = self._decode(windows, feats, languages, options)
        return self._redo_degenerate(windows, out, options, n)

    def _transcribe(
        self, windows: Sequence[Window], options: DecodeOptions, n: int
    ) -> list[WindowResult]:
        return self._decode(windows, *self._encode(windows, options, n), options)

    def _encode(self, windows: Sequence[Window], options: DecodeOptions,
                n: int) -> tuple[Any, list[tuple[str, float | None]]]:
        from whisperx.audio import log_mel_spectrogram

        feats = np.stack([
            log_mel_spectrogram(
                w.audio[:n], n_mels=self._n_mels, padding=n - len(w.audio[:n])
            ).numpy()
            for w in windows
        ]).astype(np.float32)
        encoder_output = self.model.encode(feats)

        languages: list[tuple[str, float | None]]
        if options.language is None and self.model.model.is_multilingual:
            detected = self.model.model.detect_language(encoder_output)
            languages = [(d[0][0][2:-2], float(d[0][1])) for d in detected]
        else:
            languages = [(options.language or "en", None)] * len(windows)
        return encoder_output, languages

    def _decode(self, windows: Sequence[Window], encoder_output: Any,
                languages: list[tuple[str, float | None]],
                options: DecodeOptions) -> list[WindowResult]:
        prompts = []
        tokenizers: dict[str, Any] = {}
        for lang, _ in languages:
            tok = tokenizers.get(lang) or self._tokenizer(lang, options.task)
            tokenizers[lang] = tok
            previous = (
                tok.encode(" " + options.initial_prompt.strip())
                if options.initial_prompt else []
            )
            prompts.append(self.model.get_prompt(tok, previous, without_timestamps=True))

        budget, max_length = self._max_length(windows, prompts)
        results = self._generate(encoder_output, prompts, options, max_length)
        out = [self._result(res, lang, prob, tokenizers[lang], options)
               for (lang, prob), res in zip(languages, results, strict=True)]
        if max_length < self.model.max_length:
            # A window that used its budget without looping holds dense speech (a script whose
            # words take many tokens each), not a loop: decode it again at the model's limit.
            full = [k for k, r in enumerate(out)
                    if len(r.tokens) >= budget and not _degenerate(r)]
            if full:
                again = self._generate(batch_rows(encoder_output, full), [prompts[k] for k in full],
                                       options, self.model.max_length)
                for k, res in zip(full, again, strict=True):
                    lang, prob = languages[k]
                    out[k] = self._result(res, lang, prob, tokenizers[lang], options)
        if options.word_timestamps:
            from app.engine.words import align  # imports this module: import it late

            aligned = align(self.model.model, encoder_output, windows, out, tokenizers)
            for r, words in zip(out, aligned, strict=True):
                r.words = words
        return out

    def _generate(self, encoder_output: Any, prompts: list[list[int]], options: DecodeOptions,
                  max_length: int) -> Any:
        # Same decoding parameters as whisperx's FasterWhisperPipeline, so results match it;
        # a temperature samples as faster-whisper does (top-k 0: the whole distribution).
        search: dict[str, Any] = (
            {"beam_size": 1, "sampling_topk": 0, "sampling_temperature": options.temperature}
            if options.temperature > 0 else {"beam_size": options.beam_size, "patience": 1}
        )
        return self.model.model.generate(
            encoder_output, prompts, length_penalty=1, max_length=max_length,
            suppress_blank=True, suppress_tokens=[-1], return_scores=True,
            return_no_speech_prob=True, **search,
        )

    @staticmethod
    def _result(res: Any, lang: str, prob: float | None, tok: Any,
                options: DecodeOptions) -> WindowResult:
        ids = res.sequences_ids[0]
        text = tok.tokenizer.decode([t for t in ids if t < tok.eot])
        cum = res.scores[0] * len(ids)  # undo length_penalty=1, as whisperx does
        return WindowResult(
            text=text, language=lang, language_probability=prob,
            avg_logprob=float(cum / (len(ids) + 1)), no_speech_prob=float(res.no_speech_prob),
            compression_ratio=compression_ratio(text), tokens=list(ids),
            temperature=options.temperature,
        )

    def _max_length(self, windows: Sequence[Window],
                    prompts: Sequence[Sequence[int]]) -> tuple[int, int]:
        """A batch's token budget, and the ``max_length`` that lets every window reach it: the
        model's (448), or less for short windows.

        A decoder that loops repeats a phrase until this limit, one batch step at a time, so
        the whole batch waits on it; the budget bounds that cost by the audio's length, and the
        loop's text is still flagged degenerate. CTranslate2's Whisper generates at most
        ``min(max_length // 2, max_length - prompt + 1)`` tokens (measured here: 448 -> 224
        with a 4-token prompt, 60 -> 24 with a 37-token one), so ``2 * budget + prompt`` never
        stops a window short of its budget."""
        limit = int(self.model.max_length)
        if not self._tokens_per_s:
            return limit, limit
        longest = max(w.duration for w in windows)
        budget = math.ceil(self._tokens_per_s * longest) + TOKEN_SLACK
        return budget, min(limit, 2 * budget + max(len(p) for p in prompts))

    def close(self) -> None:
        del self.model


def _degenerate(r: WindowResult) -> bool:
    """Whisper's own test for a looping decode: its text compresses more than 2.4x."""
    return r.compression_ratio > 2.4


def batch_rows(encoder_output: Any, idx: list[int]) -> Any:
    """Rows ``idx`` of a batch's encoder output; all of them: the output itself, no copy."""
    import ctranslate2

    if idx == list(range(encoder_output.shape[0])):
        return encoder_output
    if encoder_output.device != "cpu":
        encoder_output = encoder_output.to_device(ctranslate2.Device.cpu)
    return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.asarray(encoder_output)[idx]))


def _cpu_count() -> int:
    import os

    return max(1, len(os.sched_getaffinity(0)))
