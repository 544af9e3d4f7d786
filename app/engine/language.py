"""Each window's language, from the encoder output its transcription needs anyway.

A window's language is given, its upload's (decided by the upload's first detection), or
detected here in up to three steps of rising cost (:meth:`LanguageDetector.languages`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.engine.decoding import batch_rows, detected
from app.engine.mel import encoder_input
from app.windows import N_SAMPLES, SAMPLE_RATE, TOKENS_PER_SECOND, Window

Languages = list[tuple[str, float | None]]
DETECT_TAIL_S = 2.0  # detection looks at the window's audio and this much of its padding
DETECT_LOOK_AGAIN = 0.8  # less sure than this: asked again of the whole encoder output
DETECT_SURE = 0.5  # still less sure than this: asked again at 30 s (see languages)


class LanguageDetector:
    """Language detection on the engine's model (faster-whisper's WhisperModel) and device."""

    def __init__(self, model: Any, device: str, n_mels: int, mel_device: str) -> None:
        self._model = model
        self._device = device
        self.n_mels = n_mels
        self._mel_device = mel_device

    def languages(self, windows: Sequence[Window], encoder_output: Any, n: int) -> Languages:
        """Each window's language: given; its upload's, once decided; else detected from this
        encoder output (the first detection of an upload decides the upload's language).

        Detection is one decoder step, but that step first projects every encoder position into
        each layer's cross-attention keys and values: measured on the English corpus, ~4 % of
        the engine's time at the dynamic length, where a 5 s window is padded to 15 s. So it
        looks in three steps, each only for windows the step before left unsure:

        1. the encoder positions of the window's own audio plus ``DETECT_TAIL_S`` of its
           padding (in 1 s steps, so the answer depends on the window alone, not on its batch
           mates); agrees with 30 s on 117 of 119 first windows of the two corpora, and both
           misses are under ``DETECT_LOOK_AGAIN``;
        2. below ``DETECT_LOOK_AGAIN``: the whole encoder output at the dynamic length; agrees
           with 30 s on 118 of 119 (the miss: a 2.2 s clip of a child's accented English read
           as zh at p=0.37);
        3. below ``DETECT_SURE``: the window padded to Whisper's 30 s, one more encoder pass
           (3 of the 119 first windows, each 2.2-3.3 s; 2 of the 83 English clips).
        On CUDA (full axis) the first step is the only one."""
        out: list[tuple[str, float | None] | None] = []
        need: list[int] = []
        for k, w in enumerate(windows):
            p = w.prompt
            if p.language:
                out.append((p.language, None))
            elif p.choice is not None and p.choice.language is not None:
                out.append((p.choice.language, p.choice.probability))
            elif not self._model.model.is_multilingual:
                out.append(("en", None))
            else:
                out.append(None)
                need.append(k)
        if need:
            found = self._detect(windows, encoder_output, need)
            doubtful = [j for j, (_, prob) in enumerate(found) if prob < DETECT_LOOK_AGAIN]
            if doubtful and self._device == "cpu":
                again = self._model.model.detect_language(
                    batch_rows(encoder_output, [need[j] for j in doubtful]))
                for j, d in zip(doubtful, again, strict=True):
                    found[j] = detected(d)
            doubtful = [j for j, (_, prob) in enumerate(found) if prob < DETECT_SURE]
            if doubtful and n < N_SAMPLES:
                for j, d in zip(doubtful, self._detect_full([windows[need[j]] for j in doubtful]),
                                strict=True):
                    found[j] = d
            for k, (lang, prob) in zip(need, found, strict=True):
                choice = windows[k].prompt.choice
                out[k] = choice.decide(lang, prob) if choice is not None else (lang, prob)
        return [x for x in out if x is not None]

    def _detect(self, windows: Sequence[Window], encoder_output: Any,
                need: list[int]) -> list[tuple[str, float]]:
        """Step 1 of :meth:`languages`: each window's own positions, grouped by their count."""
        import ctranslate2

        if self._device != "cpu":
            return [detected(d) for d in
                    self._model.model.detect_language(batch_rows(encoder_output, need))]
        rows = np.asarray(encoder_output)
        step = int(TOKENS_PER_SECOND)
        groups: dict[int, list[int]] = {}
        for j, k in enumerate(need):
            look = len(windows[k].audio) / SAMPLE_RATE + DETECT_TAIL_S
            groups.setdefault(min(rows.shape[1], math.ceil(look) * step), []).append(j)
        found: list[tuple[str, float]] = [("", 0.0)] * len(need)
        for frames, js in groups.items():
            part = np.ascontiguousarray(rows[[need[j] for j in js], :frames])
            answers = self._model.model.detect_language(ctranslate2.StorageView.from_array(part))
            for j, d in zip(js, answers, strict=True):
                found[j] = detected(d)
        return found

    def _detect_full(self, windows: Sequence[Window]) -> list[tuple[str, float]]:
        """Detection on the windows padded to 30 s (Whisper's own input)."""
        feats = encoder_input([w.audio for w in windows], N_SAMPLES, self.n_mels,
                              self._mel_device)
        encoded = self._model.model.encode(feats)
        return [detected(d) for d in self._model.model.detect_language(encoded)]
