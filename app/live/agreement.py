"""Text while they speak: the local-agreement policy (Machacek, Dabre, Bojar 2023, "Turning
Whisper into Real-Time Transcription System"), over re-decodes of one open turn.

Each interim decode sees the turn's audio so far; a word is *sent* once two consecutive decodes
agree on it (and on every word before it). What was sent is never taken back, so a client can
show it at once, and the ``completed`` transcript is built to extend it:

* **Alignment.** A new decode is read *after* the words already sent: if it starts with them (by
  :func:`key`: case and punctuation folded) its tail is the rest; otherwise ``difflib`` aligns the
  sent words to it and the tail starts after the decode's words matched (or substituted, word for
  word) to the sent ones. So a decode that re-spells a sent word, drops one or adds one still
  continues where the client's text ends, never repeating it or contradicting it.
* **Interim.** The agreed part is the common prefix (by key) of this tail and the previous
  decode's tail; it is sent in this decode's spelling and the rest kept for the next comparison.
  Two decodes agree only if the later one heard at least ``MIN_NEW_AUDIO_S`` more audio: a read
  of nearly the same audio is no second opinion (the paper's decodes are a chunk, 1 s, apart).
  Closer, the later decode's tail just replaces the earlier one's. Measured: at 16 streams an
  early final (the turn read at a 200 ms pause, 0.12 s after an interim) and that interim both
  read 1.0-1.2 s of "Montreal" as "Montreal. Montreal.", which was sent; the final read the
  whole turn as "Montreal", but what was sent stays.
* **Final.** The last decode covers the whole turn: its tail, whole, is the last delta, and the
  transcript is the sent text plus that tail. Hence ``"".join(deltas) == transcript`` always,
  whatever the decodes say (``tests/test_live_agreement.py`` throws adversarial sequences at it),
  and when the final decode starts with the sent words the transcript is that decode (up to the
  case and punctuation of words sent earlier).

Words are whitespace-delimited runs that keep their leading space, as Whisper spells them;
CJK characters count one word each. The transcript's first character is never a space.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

MIN_NEW_AUDIO_S = 0.5  # a decode confirms the one before only after this much more audio

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD = re.compile(rf"\s*(?:[{_CJK}]|[^\s{_CJK}]+)")
_FOLD = re.compile(r"[^\w']+")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def key(word: str) -> str:
    """A word as the agreement compares it: lowercase, punctuation dropped ("Hello," == "hello")."""
    folded = _FOLD.sub("", word.lower())
    return folded or word.strip()


def aligned_tail(sent: Sequence[str], hyp: Sequence[str]) -> list[str]:
    """The words of ``hyp`` after the part that corresponds to ``sent`` (see the module doc)."""
    if not sent:
        return list(hyp)
    sk, hk = [key(w) for w in sent], [key(w) for w in hyp]
    if hk[:len(sk)] == sk:
        return list(hyp[len(sk):])
    end = 0
    ops = difflib.SequenceMatcher(None, sk, hk, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if i1 >= len(sk):  # only words after the sent ones from here on
            break
        if tag == "equal" or tag == "insert":
            end = j2
        elif tag == "replace":  # substituted word for word; extra hypothesis words are new
            end = j1 + min(i2 - i1, j2 - j1)
        else:  # delete: sent words the decode lost
            end = j1
    return list(hyp[end:])


class Agreement:
    """One turn's text: what was sent, and the last interim decode's unsent words."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.text = ""  # exactly what the deltas so far joined to
        self._pending: list[str] | None = None  # the previous decode's tail, not yet agreed on
        self._heard: float | None = None  # seconds of audio that decode read (None: unknown)
        self.decodes = 0

    def interim(self, hypothesis: str, heard_s: float | None = None) -> str:
        """The delta to send for this interim decode ("" if nothing new became stable);
        ``heard_s``: the seconds of audio it read (None: unknown, taken as far enough on)."""
        self.decodes += 1
        tail = aligned_tail(self.sent, words(hypothesis))
        prev, self._pending = self._pending, tail
        before, self._heard = self._heard, heard_s
        if prev is None or (heard_s is not None and before is not None
                            and heard_s - before < MIN_NEW_AUDIO_S):
            return ""
        n = 0
        while n < min(len(prev), len(tail)) and key(prev[n]) == key(tail[n]):
            n += 1
        self._pending = tail[n:]
        return self._send(tail[:n])

    def final(self, hypothesis: str) -> tuple[str, str]:
        """The last delta and the transcript, from the decode of the whole turn."""
        self.decodes += 1
        delta = self._send(aligned_tail(self.sent, words(hypothesis)))
        self._pending = None
        return delta, self.text

    def _send(self, new: list[str]) -> str:
        if not new:
            return ""
        delta = "".join(new)
        if not self.text:
            delta = delta.lstrip()
        self.sent += new
        self.text += delta
        return delta
