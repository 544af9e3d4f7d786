"""One decoder batch from an encoder output, and Whisper's fallbacks: one rule, three steps.

:class:`WindowDecoder` turns an encoder output and per-window prompts into results: one
``generate`` per position of <|startoftranscript|>, each window cut at its own token budget
(:mod:`app.engine.decoding`), a window that filled its budget without looping decoded again at
the model's limit (dense speech, not a loop).

:func:`fallback_for` is the engine's one fallback rule: what a window's decode asks for next.

* :attr:`Fallback.AXIS`: decoded at a padded length below its final one (the dynamic time
  axis), it loops or is unsure: encode it again at its final length and decode it there.
* :attr:`Fallback.WIDEN`: at its final length, unsure at a beam below ``unsure_beam_size``:
  decode again at that beam from the same encoder output, keep the likelier decode that does
  not loop (:meth:`WindowDecoder.widen`).
* :attr:`Fallback.UNLOOP`: at its final length, it loops: decode again with each repetition
  penalty in turn (:meth:`WindowDecoder.unloop`).

A window's final length is Whisper's 30 s, except a live window padded under the engine's own
margin, whose final length is that margin (see ``WhisperEngine.final_samples``). The engine
runs the steps inside a decode (``decode(redo=True)``, ``transcribe_batch``), or marks the
windows the rule names (``WindowResult.redo``) and runs them in a call of its own (``redo``):
the same rule decides both, so the two ways give the same text.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Any

from app.engine.decoding import (
    Prompts,
    batch_rows,
    degenerate,
    max_length,
    prefix_tokens,
    search_args,
    to_result,
    unsure,
)
from app.engine.language import Languages
from app.windows import DecodeOptions, Task, WindowResult


class Fallback(Enum):
    AXIS = "axis"
    WIDEN = "widen"
    UNLOOP = "unloop"


def fallback_for(r: WindowResult, beam: int, temperature: float, below_final: bool,
                 wide: int, penalties: tuple[float, ...]) -> Fallback | None:
    """The fallback a window's decode asks for next, or None (see the module's docstring).

    A decode that continued a prefix (``doubtful``) asks for none: its caller holds the audio
    without the context and decodes that instead. Below the final length both tests of
    Whisper's (a loop compresses > 2.4; unsure: average log-probability < -1 on speech) send a
    window to its final length at the request's own beam: running the redo straight at the
    wider beam lost the 30 s decode at the request's beam (a Chinese clip translated to
    "4035-1-7-7-8-8-8-8-..." at beam 5, a loop short enough to compress < 2.4, where beam 1
    reads a sentence). Sampling (``temperature`` > 0) takes no fallback at the final length."""
    if r.doubtful:
        return None
    if below_final:
        return Fallback.AXIS if degenerate(r) or unsure(r) else None
    if temperature != 0:
        return None
    if degenerate(r):
        return Fallback.UNLOOP if penalties else None
    if unsure(r) and beam < wide:
        return Fallback.WIDEN
    return None


class WindowDecoder:
    """The decoder side of one resident model: prompts, budgets, ``generate``, the re-decodes."""

    def __init__(self, model: Any, limit: int, penalties: tuple[float, ...], wide: int) -> None:
        self.model = model  # faster-whisper's WhisperModel
        self.prompts = Prompts(model)
        self.limit = limit  # the model's max_length
        self.penalties = penalties
        self.wide = wide

    def first_pass(self, encoder_output: Any, prompts: list[list[int]], budgets: list[int],
                   languages: Languages, options: DecodeOptions) -> list[WindowResult]:
        """Every window decoded at ``options``; one that used its budget without looping holds
        dense speech (a script whose words take many tokens each), not a loop: it is decoded
        again at the model's limit."""
        results = self.generate(encoder_output, prompts, options, budgets)
        out = [self.result(res, lang, prob, options.task, options, b, p)
               for (lang, prob), res, b, p in zip(languages, results, budgets, prompts,
                                                  strict=True)]
        full = [k for k, r in enumerate(out)
                if len(r.tokens) >= budgets[k] and budgets[k] < self.limit // 2
                and not degenerate(r)]
        limits = [self.limit // 2] * len(out)
        for k, r in zip(full, self.again(encoder_output, full, prompts, limits, languages,
                                         options), strict=True):
            out[k] = r
        return out

    def widen(self, encoder_output: Any, prompts: list[list[int]], budgets: list[int],
              languages: Languages, options: DecodeOptions, out: list[WindowResult],
              todo: list[int]) -> None:
        """:attr:`Fallback.WIDEN` for windows ``todo``: decoded again at ``unsure_beam_size``
        from the same encoder output, keeping the decode of higher average log-probability that
        does not loop (faster-whisper's rule among its fallbacks: the best below the compression
        threshold). Never more decoder states than the batch had: groups of
        ``batch * beam // wide``."""
        wide = replace(options, beam_size=self.wide)
        step = max(1, len(out) * options.beam_size // self.wide)
        for i in range(0, len(todo), step):
            part = todo[i:i + step]
            for k, r in zip(part, self.again(encoder_output, part, prompts, budgets, languages,
                                             wide), strict=True):
                if r.avg_logprob > out[k].avg_logprob and not degenerate(r):
                    out[k] = r  # a loop scores high (measured -0.3 against -1.66): never it

    def unloop(self, encoder_output: Any, prompts: list[list[int]], budgets: list[int],
               languages: Languages, options: DecodeOptions, out: list[WindowResult],
               loops: list[int]) -> None:
        """:attr:`Fallback.UNLOOP` for windows ``loops``: decoded again with a repetition
        penalty.

        faster-whisper falls back to sampling at rising temperatures; sampling draws from each
        CTranslate2 worker thread's own generator, so a window's text would depend on what ran
        on that thread before it. A repetition penalty is deterministic and per window, and
        breaks the loops too (measured: a 15 s Japanese clip translated as "a ship of
        shipwrecked ships, ..." to the decode cap at beam 1 and 5; at 1.1 it is a sentence;
        over the 12 translated clips chrF rose 35.1 -> 37.9 at beam 1, 36.8 -> 40.3 at beam 5).
        Each of ``loop_penalties`` is tried on the windows the one before left looping; a
        window keeps the decode that compresses least."""
        for penalty in self.penalties:
            if not loops:
                return
            again = self.again(encoder_output, loops, prompts, budgets, languages, options,
                               repetition_penalty=penalty)
            for k, r in zip(loops, again, strict=True):
                if r.compression_ratio < out[k].compression_ratio:
                    out[k] = r
            loops = [k for k in loops if degenerate(out[k])]

    def again(self, encoder_output: Any, idx: list[int], prompts: list[list[int]],
              budgets: list[int], languages: Languages, options: DecodeOptions,
              **extra: Any) -> list[WindowResult]:
        """Windows ``idx`` of a decoded batch, decoded again from its encoder output."""
        if not idx:
            return []
        results = self.generate(batch_rows(encoder_output, idx), [prompts[k] for k in idx],
                                options, [budgets[k] for k in idx], **extra)
        out = []
        for k, res in zip(idx, results, strict=True):
            lang, prob = languages[k]
            out.append(self.result(res, lang, prob, options.task, options, budgets[k],
                                   prompts[k]))
        return out

    def result(self, res: Any, lang: str, prob: float | None, task: Task,
               options: DecodeOptions, cut: int, prompt: list[int]) -> WindowResult:
        """A window's result; one that continued a prefix (``Prompt.prefix``) and reads as a
        loop or unsure is marked ``doubtful`` and left to its caller, who holds the audio
        without the context: no fallback here (measured offline on the corpus clips the live
        VAD splits: 3 of 16 continued turns looped, "... ... ...", each read well alone)."""
        tok = self.prompts.tokenizer(lang, task)
        pre = prefix_tokens(prompt, tok)
        r = to_result(res, lang, prob, tok, options, cut, pre)
        r.doubtful = bool(pre) and (degenerate(r) or unsure(r))
        return r

    def generate(self, encoder_output: Any, prompts: list[list[int]], options: DecodeOptions,
                 budgets: list[int], **extra: Any) -> list[Any]:
        """One ``generate`` per position of <|startoftranscript|> in the prompts.

        CTranslate2 takes one prompt per batch item but requires the start token at the same
        position in all of them ("To work around this limitation, simply adapt the number of
        previous text tokens in each batch"). Languages and task sit after it, so windows of
        any languages always share a call; windows whose initial prompt and hotwords differ
        in token count go in separate calls of the same engine call."""
        sot = self.prompts.sot
        groups: dict[int, list[int]] = {}
        for k, p in enumerate(prompts):
            groups.setdefault(p.index(sot), []).append(k)
        out: list[Any] = [None] * len(prompts)
        for idx in groups.values():
            part = [prompts[k] for k in idx]
            length = max_length([budgets[k] for k in idx], part, self.limit)
            results = self.model.model.generate(
                batch_rows(encoder_output, idx), part, length_penalty=1, max_length=length,
                suppress_blank=True, suppress_tokens=[-1], return_scores=True,
                return_no_speech_prob=True, **search_args(options), **extra,
            )
            for k, r in zip(idx, results, strict=True):
                out[k] = r
        return out
