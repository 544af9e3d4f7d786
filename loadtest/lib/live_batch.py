"""The uploads the live bench (loadtest/live.py) compares its sessions with: the same clips, each
stream's audio as one upload, and each finalised turn alone, all through ``/transcribe``
(language en), scored as the live text is."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib.live_common import Outcome, Stream, read_as, turn_audio, wer_by_turns


async def batch_texts(base_url: str, streams: list[Stream]) -> dict[str, str]:
    """The same clips through ``/transcribe`` (language en), each clip's text."""
    from loadtest.lib.corpus import load_corpus
    from loadtest.lib.service import Client

    by_id = {c.id: c for c in load_corpus()}
    used = [by_id[u.clip_id] for s in streams for u in s.utterances]
    client = Client(base_url, used, "en")
    try:
        return {c.id: (await client.transcribe(c)).text or ""
                for c in {c.id: c for c in used}.values()}
    finally:
        await client.close()


def turns_uploaded(streams: list[Stream], outcomes: list[Outcome], per_turn: list[list[str]],
                   texts: dict[str, str]) -> dict[str, Any]:
    """The live turns' own uploads (:func:`batch_turn_texts`) scored as the live text is:
    overall and by how the VAD cut each utterance (their ``live_wer_percent`` is the turns'
    uploads here; ``batch_wer_percent`` is still the clips')."""
    from app.client.scoring import wer_percent

    read = [read_as(s, o, t) for s, o, t in zip(streams, outcomes, per_turn, strict=True)]
    refs = [" ".join(u.reference for u in s.utterances) for s in streams]
    return {"wer_percent": wer_percent(refs, [o.text for o in read]),
            "wer_by_turns": wer_by_turns(streams, read, texts)}


def batch_wer(streams: list[Stream], texts: dict[str, str]) -> float | None:
    """The clips' upload texts scored as the live streams are."""
    from app.client.scoring import wer_percent

    refs = [" ".join(u.reference for u in s.utterances) for s in streams]
    return wer_percent(refs, [" ".join(texts[u.clip_id] for u in s.utterances) for s in streams])


async def batch_stream_wer(base_url: str, streams: list[Stream], work: Path) -> float | None:
    """Each stream's own audio (its clips, pauses and all, as the session heard it) as one upload
    through ``/transcribe`` (language en): the same speech in the same order, batch against
    live. Per-clip uploads (:func:`batch_wer`) give each clip a fresh VAD state and a file of
    its own, which a live stream does not have."""
    from app.client.scoring import wer_percent
    from loadtest.lib.common import write_wav16
    from loadtest.lib.service import Client

    client = Client(base_url, [], "en")
    texts = []
    try:
        for k, s in enumerate(streams):
            path = work / f"stream-{k}.wav"
            await asyncio.to_thread(write_wav16, path, s.audio)
            texts.append(await client.text_of(path.name, path.read_bytes()))
    finally:
        await client.close()
    return wer_percent([" ".join(u.reference for u in s.utterances) for s in streams], texts)


async def batch_turn_texts(base_url: str, streams: list[Stream], outcomes: list[Outcome],
                           work: Path) -> list[list[str]]:
    """Each turn the session finalised, its audio (as the session heard it, from
    ``speech_started``'s ``audio_start_ms`` to ``speech_stopped``'s ``audio_end_ms``) as an
    upload of its own through ``/transcribe`` (language en): per stream, the texts in span
    order. Live against these is what reading the turns live costs; these against the clips'
    uploads, what the client's turns cost (a pause of ``silence_duration_ms`` ends a turn, and
    each piece is read without the rest, whoever reads it)."""
    from loadtest.lib.common import write_wav16
    from loadtest.lib.service import Client

    client = Client(base_url, [], "en")
    gate = asyncio.Semaphore(4)

    async def one(k: int, j: int, audio: np.ndarray) -> str:
        path = work / f"turn-{k}-{j}.wav"
        await asyncio.to_thread(write_wav16, path, audio)
        async with gate:
            return await client.text_of(path.name, path.read_bytes())

    try:
        return [list(await asyncio.gather(*(one(k, j, a) for j, a in
                                            enumerate(turn_audio(s, o.spans)))))
                for k, (s, o) in enumerate(zip(streams, outcomes, strict=True))]
    finally:
        await client.close()
