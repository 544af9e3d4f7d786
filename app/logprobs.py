"""Token log-probabilities in OpenAI's shape (``include[]=logprobs`` on /v1/audio/transcriptions).

OpenAI answers ``include=["logprobs"]`` with ``logprobs``: one ``{"token", "logprob", "bytes"}``
per token of the transcript (``openai.types.audio.transcription.Logprob``; the stream's
``transcript.text.delta`` events carry those of their delta, ``transcript.text.done`` all).

Where ours come from: the word-timestamp pass (app/engine/words.py) runs CTranslate2's
``align`` over the decoded tokens, which returns the model's probability of every text token
given the audio and the tokens before it (``text_token_probs``; faster-whisper averages them
into a word's ``probability``). Those are kept per token on each :class:`~app.windows.Word`,
with the token's bytes (Whisper's byte-level BPE: a token may be part of a UTF-8 character,
which is why OpenAI gives ``bytes`` beside the text). ``include[]=logprobs`` therefore turns on
word alignment for the request (one more decoder pass over known tokens). The align pass sees
the window's audio and the transcript, not the prompt the decode had (initial prompt,
hotwords), so a token's probability there can differ a little from the one it was decoded
with; it is the same for every decode of the same text. Timestamp and special tokens have
none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

from app.windows import WindowResult, Word

FLOOR = 1e-12  # log(0) is not JSON


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``) inverted: BPE symbol -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(hf_tokenizer: Any, ids: Iterable[int]) -> list[bytes]:
    """The bytes of each token id (a ``tokenizers.Tokenizer`` with byte-level BPE)."""
    table = _byte_decoder()
    out = []
    for i in ids:
        symbol = hf_tokenizer.id_to_token(int(i)) or ""
        out.append(bytes(table[ch] for ch in symbol if ch in table))
    return out


def per_token(timing: list[dict[str, Any]], text_tokens: Sequence[int],
              probs: Sequence[float]) -> None:
    """Each word dict of the alignment gets ``token_probs`` for its ``tokens`` (in place),
    walking the decoded tokens in order (punctuation merged into a neighbour keeps its own)."""
    flat = list(zip(text_tokens, probs, strict=False))
    p = 0
    for t in timing:
        got = []
        for tid in t["tokens"]:
            while p < len(flat) and flat[p][0] != tid:
                p += 1
            if p < len(flat):
                got.append(float(flat[p][1]))
                p += 1
        t["token_probs"] = got if len(got) == len(t["tokens"]) else []


def word_entries(words: Iterable[Word]) -> list[dict[str, Any]]:
    out = []
    for w in words:
        for b, prob in zip(w.token_bytes, w.token_probs, strict=False):
            out.append({"token": b.decode("utf-8", errors="replace"),
                        "logprob": round(math.log(max(prob, FLOOR)), 6), "bytes": list(b)})
    return out


def entries(results: Iterable[WindowResult]) -> list[dict[str, Any]]:
    """OpenAI ``Logprob`` dicts for the windows' tokens, in upload order."""
    return [e for r in results for e in word_entries(r.words or [])]
