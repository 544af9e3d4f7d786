"""Token log-probabilities in OpenAI's shape (``include[]=logprobs`` on /v1/audio/transcriptions).

OpenAI answers ``include=["logprobs"]`` with ``logprobs``: one ``{"token", "logprob", "bytes"}``
per token of the transcript (``openai.types.audio.transcription.Logprob``; the stream's
``transcript.text.delta`` events carry those of their delta, ``transcript.text.done`` all).

Where ours come from: the word-timestamp pass (app/engine/words.py) runs CTranslate2's
``align`` over the decoded tokens, which returns the model's probability of every text token
given the audio and the tokens before it; those are kept per token on each
:class:`~app.windows.Word`, with the token's bytes (app/engine/tokens.py). ``include[]=logprobs``
therefore turns on word alignment for the request (one more decoder pass over known tokens).
The align pass sees the window's audio and the transcript, not the prompt the decode had
(initial prompt, hotwords), so a token's probability there can differ a little from the one it
was decoded with; it is the same for every decode of the same text. Timestamp and special
tokens have none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from app.windows import WindowResult, Word

FLOOR = 1e-12  # log(0) is not JSON


def word_entries(words: Iterable[Word]) -> list[dict[str, Any]]:
    """OpenAI ``Logprob`` dicts for the words' tokens, in order."""
    out = []
    for w in words:
        for b, prob in zip(w.token_bytes, w.token_probs, strict=False):
            out.append({"token": b.decode("utf-8", errors="replace"),
                        "logprob": round(math.log(max(prob, FLOOR)), 6), "bytes": list(b)})
    return out


def entries(results: Iterable[WindowResult]) -> list[dict[str, Any]]:
    """OpenAI ``Logprob`` dicts for the windows' tokens, in upload order."""
    return [e for r in results for e in word_entries(r.words or [])]
