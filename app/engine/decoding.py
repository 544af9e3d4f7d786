"""Per-window decoding pieces: prompts, the decode-length budget, and a window's result.

Everything here is per window, so a window's transcript does not depend on what shares its batch:

* **Prompts.** CTranslate2's Whisper ``generate`` takes one prompt per batch item, so each window
  carries its own language token, initial prompt and hotwords (faster-whisper's ``get_prompt``);
  it needs <|startoftranscript|> at one position in a call, so prompts whose context before it
  differs in length run as separate calls (the engine groups them).
* **The decode budget.** A decoder that loops ("uh, uh, uh, ...") repeats until ``max_length``,
  one batch step at a time, with its whole batch waiting; the budget bounds that cost by the
  window's audio: ``max_tokens_per_s`` tokens per second + 16 (speech runs at 3-7 Whisper tokens
  per second; at most 5 on the English corpus). ``max_length`` is per call, so the call runs to
  the largest budget of its windows and each window's tokens are then cut at its own budget: a
  looping window reads the same alone and beside a long one (``tests/test_decode_cap.py``).
  For a window cut this way, ``avg_logprob`` is that of the longer sequence the call produced.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

from app.windows import TOKEN_SLACK, DecodeOptions, Prompt, Task, WindowResult

PROMPT_CACHE = 4096  # distinct (language, task, prompt, hotwords) kept encoded


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def degenerate(r: WindowResult) -> bool:
    """Whisper's own test for a looping decode: its text compresses more than 2.4x."""
    return r.compression_ratio > 2.4


def unsure(r: WindowResult) -> bool:
    """Whisper's own test for a low-confidence decode of real speech: average log-probability
    under -1 where the model does not think the window silent (no-speech probability < 0.6)."""
    return r.avg_logprob < -1.0 and r.no_speech_prob < 0.6


def budget(duration_s: float, tokens_per_s: float, limit: int) -> int:
    """A window's token budget: by its audio, at most what the model can generate (limit // 2)."""
    if not tokens_per_s:
        return limit // 2
    return min(limit // 2, math.ceil(tokens_per_s * duration_s) + TOKEN_SLACK)


def max_length(budgets: list[int], prompts: list[list[int]], limit: int) -> int:
    """The call's ``max_length``: enough for every window to reach its own budget.

    CTranslate2's Whisper generates at most ``min(max_length // 2, max_length - prompt + 1)``
    tokens (measured: 448 -> 224 with a 4-token prompt, 60 -> 24 with a 37-token one), so
    ``2 * budget + prompt`` never stops a window short of its budget."""
    return min(limit, max(2 * b + len(p) for b, p in zip(budgets, prompts, strict=True)))


class Prompts:
    """Tokenizers per (language, task) and encoded prompts, cached: a job's windows share one."""

    def __init__(self, model: Any) -> None:
        from faster_whisper.tokenizer import Tokenizer

        self._model = model  # faster-whisper's WhisperModel: hf_tokenizer, get_prompt, max_length
        self._tokenizer_cls = Tokenizer
        self._tokenizers: dict[tuple[str, Task], Any] = {}
        self._prompts: dict[tuple[str, Task, str | None, str | None, str | None], list[int]] = {}
        self.sot = self.tokenizer("en", "transcribe").sot  # <|startoftranscript|>: any language

    def tokenizer(self, language: str, task: Task) -> Any:
        tok = self._tokenizers.get((language, task))
        if tok is None:
            multilingual = self._model.model.is_multilingual
            tok = self._tokenizer_cls(self._model.hf_tokenizer, multilingual, task=task,
                                      language=language if multilingual else "en")
            self._tokenizers[(language, task)] = tok
        return tok

    def tokens(self, prompt: Prompt, language: str, task: Task) -> list[int]:
        key = (language, task, prompt.initial_prompt, prompt.hotwords, prompt.prefix)
        out = self._prompts.get(key)
        if out is None:
            tok = self.tokenizer(language, task)
            previous = (tok.encode(" " + prompt.initial_prompt.strip())
                        if prompt.initial_prompt else [])
            out = self._model.get_prompt(tok, previous, without_timestamps=True,
                                         prefix=prompt.prefix, hotwords=prompt.hotwords)
            if len(self._prompts) >= PROMPT_CACHE:
                self._prompts.clear()
            self._prompts[key] = out
        return out


def search_args(options: DecodeOptions) -> dict[str, Any]:
    """Same decoding parameters as whisperx's FasterWhisperPipeline, so results match it; a
    temperature samples as faster-whisper does (top-k 0: the whole distribution)."""
    if options.temperature > 0:
        return {"beam_size": 1, "sampling_topk": 0, "sampling_temperature": options.temperature}
    return {"beam_size": options.beam_size, "patience": 1}


def prefix_tokens(prompt: list[int], tok: Any) -> int:
    """How many of ``prompt``'s tokens are a prefix the decode continues (after
    <|notimestamps|>, where faster-whisper's ``get_prompt`` puts it)."""
    return len(prompt) - prompt.index(tok.no_timestamps) - 1 if tok.no_timestamps in prompt else 0


def to_result(res: Any, language: str, probability: float | None, tok: Any,
              options: DecodeOptions, cut: int, prefix: int = 0) -> WindowResult:
    """One generate() result as a window's result, its tokens cut at the window's budget.
    ``prefix``: the prompt's prefix tokens, which CTranslate2 returns ahead of the decode's own
    (measured: the same 25 ids with a 5-token prefix as without): the result is what follows."""
    ids = res.sequences_ids[0]
    cum = res.scores[0] * len(ids)  # undo length_penalty=1, as whisperx does
    ids = ids[prefix:]
    avg_logprob = float(cum / (len(ids) + 1))
    ids = ids[:cut]
    text = tok.tokenizer.decode([t for t in ids if t < tok.eot])
    return WindowResult(
        text=text, language=language, language_probability=probability,
        avg_logprob=avg_logprob, no_speech_prob=float(res.no_speech_prob),
        compression_ratio=compression_ratio(text), tokens=list(ids),
        temperature=options.temperature,
    )


def detected(result: Any) -> tuple[str, float]:
    """CTranslate2's ``detect_language`` answer for one window: its most likely language."""
    token, prob = result[0]
    return token[2:-2], float(prob)  # "<|en|>" -> "en"


def batch_rows(encoder_output: Any, idx: list[int]) -> Any:
    """Rows ``idx`` of a batch's encoder output; all of them: the output itself, no copy.

    On a GPU the rows are gathered where they are (torch over the CUDA array interface, on this
    thread's side stream, see :func:`app.engine.mel.encoder_input`): the re-decodes
    (:class:`app.engine.decoder.WindowDecoder`'s ``widen``, ``unloop``, ``again``), the beam
    groups and detection each take a few rows of a batch, and copying the whole output to the
    host and the rows back (64 windows of whisper-base in float16: 98 MB each way) cost more
    than the decode of those rows.
    CTranslate2's ``encode`` synchronises its stream before it returns, so the output is
    complete when torch reads it."""
    import ctranslate2
    import numpy as np

    if idx == list(range(encoder_output.shape[0])):
        return encoder_output
    if encoder_output.device != "cpu":
        return _device_rows(encoder_output, idx)
    return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.asarray(encoder_output)[idx]))


def _device_rows(encoder_output: Any, idx: list[int]) -> Any:
    import ctranslate2
    import torch

    from app.engine.mel import side_stream

    device = f"cuda:{encoder_output.device_index}"
    stream = side_stream(device)
    with torch.inference_mode(), torch.cuda.stream(stream):
        whole = torch.as_tensor(encoder_output, device=device)
        rows = whole.index_select(0, torch.tensor(idx, device=device)).contiguous()
    stream.synchronize()
    return ctranslate2.StorageView.from_array(rows)  # the view keeps ``rows`` alive
