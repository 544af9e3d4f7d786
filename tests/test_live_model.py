"""A live session on the real model: Silero server VAD and whisper-base through the engine
runner (app.live.decoding.engine_decoder), two read-speech clips streamed at twice real time."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest

from app.live.audio import encode_pcm16
from app.live.config import LiveLimits
from app.live.decoding import engine_decoder
from app.live.session import LiveSession
from app.client.scoring import wer_percent
from tests.conftest import corpus_clips

pytestmark = pytest.mark.model


async def test_real_model_turns_text_while_speaking_and_completed_transcripts(engine) -> None:
    from app.audio import decode
    from app.audio.vad import SileroVad
    from app.engine.placement import EngineRunner

    clips = {c.id: c for c in corpus_clips()}
    chosen = [clips["ljspeech-LJ001-0001"], clips["librispeech-1089-134691-0000"]]
    parts = [np.zeros(16_000, np.float32)]
    for c in chosen:
        parts += [decode(c.path, 60.0), np.zeros(24_000, np.float32)]
    audio = np.concatenate(parts)
    session = LiveSession(engine_decoder(EngineRunner(engine).run), SileroVad(),
                          LiveLimits(interim_interval_ms=1000))
    update = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000},
        "transcription": {"language": "en"}}}}}
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    inbox.put_nowait(json.dumps(update))
    runner = asyncio.create_task(session.run(inbox.get))
    t0 = time.monotonic()
    for k, i in enumerate(range(0, audio.size, 1600)):  # 100 ms appends, at twice real time
        await asyncio.sleep(max(0.0, t0 + k * 0.05 - time.monotonic()))
        inbox.put_nowait(json.dumps({"type": "input_audio_buffer.append", "audio":
                                     base64.b64encode(encode_pcm16(audio[i:i + 1600])).decode()}))
    inbox.put_nowait(None)
    assert await asyncio.wait_for(runner, 300) == "disconnected"
    events = []
    while (e := session.outbox.get_nowait()) is not None:
        events.append(e)

    assert [e for e in events if e["type"] in ("error", "conversation.item."
                                               "input_audio_transcription.failed")] == []
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert len(completed) >= 2
    for c in completed:
        joined = "".join(e["delta"] for e in events
                         if e["type"].endswith(".delta") and e["item_id"] == c["item_id"])
        assert joined == c["transcript"]
    first_commit = next(i for i, e in enumerate(events)
                        if e["type"] == "input_audio_buffer.committed")
    assert any(e["type"].endswith(".delta") for e in events[:first_commit]), \
        "no interim text while the first clip was being spoken"
    text = " ".join(c["transcript"] for c in completed)
    wer = wer_percent([" ".join(c.reference for c in chosen)], [text])
    assert wer is not None and wer <= 15.0, text
