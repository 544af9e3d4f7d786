"""Each word's tokens as ``include[]=logprobs`` reports them (app/results/logprobs.py): their
probabilities from the word-timestamp pass, and their bytes.

The word-timestamp pass (app/engine/words.py) runs CTranslate2's ``align`` over the decoded
tokens, which returns the model's probability of every text token given the audio and the
tokens before it (``text_token_probs``; faster-whisper averages them into a word's
``probability``). :func:`per_token` keeps them per token on each word of the alignment, and
:func:`token_bytes` gives each token's bytes (Whisper's byte-level BPE: a token may be part of a
UTF-8 character, which is why OpenAI gives ``bytes`` beside the text). Both end up on
:class:`~app.windows.Word` (``token_probs``, ``token_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any


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
