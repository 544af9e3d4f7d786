"""Fakes for the live session's tests: an energy VAD, a scripted decoder, audio and a driver."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from app.audio.spans import CHUNK
from app.live.audio import encode_pcm16
from app.live.config import LiveLimits
from app.live.decoding import Decoded, Kind, LiveOptions
from app.live.session import LiveSession
from app.windows import Refresh


class EnergyProbs:
    """Speech probability 0.9 where a 512-sample chunk's RMS is over 0.05, else 0."""

    def __init__(self) -> None:
        self._pending = np.zeros(0, dtype=np.float32)
        self._last = np.zeros(0, dtype=np.float32)
        self.restarts = 0

    def feed(self, samples: np.ndarray) -> np.ndarray:
        data = np.concatenate([self._pending, samples])
        whole = data.size // CHUNK * CHUNK
        self._pending = data[whole:]
        rms = np.sqrt(np.mean(data[:whole].reshape(-1, CHUNK) ** 2, axis=1)) if whole else \
            np.zeros(0)
        self._last = np.where(rms > 0.05, 0.9, 0.0).astype(np.float32)
        return self._last

    def restart(self, last: int = 0) -> np.ndarray:
        """Stateless: the same probabilities again."""
        self.restarts += 1
        return self._last[max(0, self._last.size - last):] if last > 0 \
            else np.zeros(0, np.float32)


class EnergyVad:
    def probability_stream(self) -> EnergyProbs:
        return EnergyProbs()


class ScriptedDecoder:
    """Two words per second of speech (loud 512-sample chunks) in the audio: " w0 w1 ...", so a growing
    turn decodes to growing prefixes of its final text. ``gate`` holds every decode; ``fail``
    and ``shed`` make decodes of a kind raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[Kind, float, LiveOptions]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: set[Kind] = set()
        self.shed = False
        self.in_flight = 0
        self.demoted = 0  # finals the session said became interims (see decoding.demote)
        self.doubtful = False  # a decode that continues a prefix comes back doubtful
        self.ending = ""  # after the words of every decode ("." : it sounds finished)

    def demote(self, task: asyncio.Task[Any]) -> None:
        self.demoted += 1

    async def __call__(self, audio: np.ndarray, options: LiveOptions, kind: Kind,
                       refresh: Refresh = (0, 0.0)) -> Decoded:
        from app.windows import Shed

        self.calls.append((kind, audio.size / 16_000, options))
        self.in_flight += 1
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1
        if kind in self.fail:
            raise RuntimeError("engine fell over")
        if kind == "interim" and self.shed:
            raise Shed()
        whole = audio.size // CHUNK * CHUNK
        rms = np.sqrt(np.mean(audio[:whole].reshape(-1, CHUNK) ** 2, axis=1)) if whole else \
            np.zeros(0)
        n = round(np.count_nonzero(rms > 0.05) * CHUNK / 16_000 * 2)
        # A decode that continues a prefix (the turn before, read first) says what follows it.
        first = len(options.prefix.split()) if options.prefix else 0
        return Decoded("".join(f" w{k}" for k in range(first, n)) + self.ending, options.language,
                       doubtful=self.doubtful and first > 0)


def speech(seconds: float, rate: int = 24_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-0.6, 0.6, int(rate * seconds)).astype(np.float32)
    return x


def silence(seconds: float, rate: int = 24_000) -> np.ndarray:
    return np.zeros(int(rate * seconds), dtype=np.float32)


def appends(audio: np.ndarray, rate: int = 24_000, chunk_ms: int = 100,
            encode: Callable[[np.ndarray], bytes] = encode_pcm16) -> list[str]:
    step = rate * chunk_ms // 1000
    return [json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(encode(audio[i:i + step])).decode()})
            for i in range(0, audio.size, step)]


def event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def manual() -> str:
    return event("session.update", session={"type": "transcription",
                                            "audio": {"input": {"turn_detection": None}}})


async def run_script(messages: list[str], limits: LiveLimits | None = None,
                     decoder: ScriptedDecoder | None = None, vad: bool = True,
                     leave: bool = True) -> tuple[list[dict[str, Any]], LiveSession, str]:
    """Every message in order, then the client leaves (or, ``leave=False``, goes quiet):
    every event the session sent, the session, and why it ended."""
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    for m in messages:
        inbox.put_nowait(m)
    if leave:
        inbox.put_nowait(None)
    session = LiveSession(decoder or ScriptedDecoder(), EnergyVad() if vad else None, limits)
    reason = await session.run(inbox.get)
    events = []
    while (e := session.outbox.get_nowait()) is not None:
        events.append(e)
    return events, session, reason


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].replace("conversation.item.input_audio_transcription.", "tr.")
            .replace("input_audio_buffer.", "buf.") for e in events]
