"""What every API family does with a request's audio before the door: its decoding and speaker
options checked, and the audio handed over once.

``POST /transcribe`` (app/api/native), ``/v1/audio/*`` (app/api/openai) and ``/asr`` +
``/detect-language`` (app/api/asr) name their fields differently, but they decode alike: the
same language check and default beams, the same speaker rules, and one hand-over
(:func:`accept_upload`), after which the core owns the file whatever refuses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from fastapi import UploadFile

from app.api.errors import MissingInput
from app.config import Settings
from app.engine import languages
from app.errors import BadRequest, PayloadTooLarge
from app.jobs.door import Door, Upload
from app.windows import JobOptions

Spool = Callable[[UploadFile, Path, int], int]
MAX_SPEAKERS = 20  # bound on num/min/max_speakers (clustering itself has none)
HOTWORDS_HELP = ("Words or phrases to bias the transcript towards (names, jargon), as in "
                 "faster-whisper: added to each window's prompt.")


def decode_options(settings: Settings, language: str | None, task: str, beam_size: int | None,
                   initial_prompt: str | None, temperature: float = 0.0,
                   word_timestamps: bool = False, hotwords: str | None = None,
                   language_detection: str = "per_upload") -> JobOptions:
    """A request's decoding options, checked: 400 for a language Whisper does not know. The
    beam follows the language when the client gives none (``default_beam_size`` in English,
    ``default_beam_size_other`` in any other, both kept when it is to be detected)."""
    lang = (language or "").strip().lower() or None
    if lang is not None and lang not in languages.CODES:
        raise BadRequest(f"unknown language {language!r}; use an ISO 639-1 code such as 'en'",
                         field="language")
    beam, other = languages.default_beams(lang, beam_size, settings.default_beam_size,
                                          settings.default_beam_size_other)
    if temperature > 0:
        other = None  # sampling ignores the beam: no second generate per batch for it
    return JobOptions(
        language=lang, task=task,  # type: ignore[arg-type]
        beam_size=beam, other_beam_size=other,
        initial_prompt=(initial_prompt or "").strip() or None,
        hotwords=" ".join((hotwords or "").split()) or None,
        temperature=float(temperature), word_timestamps=word_timestamps,
        language_detection=language_detection,  # type: ignore[arg-type]
    )


def speaker_options(d: Door, options: JobOptions, diarize: bool, num_speakers: int | None,
                    min_speakers: int | None, max_speakers: int | None,
                    channels: str = "mix") -> JobOptions:
    """The request's speaker options on top of ``options``, checked: 400 for combinations
    that cannot be met, before anything is uploaded."""
    asked = {"num_speakers": num_speakers, "min_speakers": min_speakers,
             "max_speakers": max_speakers}
    given = [k for k, v in asked.items() if v is not None]
    if given and not diarize:
        raise BadRequest(f"{given[0]} needs diarize=true", field=given[0], no_retry=True)
    lo, hi = min_speakers or 1, max_speakers or MAX_SPEAKERS
    if lo > hi:
        raise BadRequest(f"min_speakers ({min_speakers}) > max_speakers ({max_speakers})",
                         field="min_speakers", no_retry=True)
    if num_speakers is not None and not lo <= num_speakers <= hi:
        raise BadRequest(f"num_speakers ({num_speakers}) is outside min_speakers..max_speakers",
                         field="num_speakers", no_retry=True)
    if diarize and channels == "separate":
        raise BadRequest("channels=separate labels speakers by channel; it cannot be combined "
                         "with diarize=true", field="channels", no_retry=True)
    if diarize:
        d.check_speakers()  # off: 400; models that failed to load: 503
    return replace(options, diarize=diarize, num_speakers=num_speakers,
                   min_speakers=min_speakers, max_speakers=max_speakers,
                   channels=channels)  # type: ignore[arg-type]


def spool_upload(src: UploadFile, dest: Path, max_bytes: int) -> int:
    """Copy the (already disk-spooled) upload to the path the core gave, enforcing the size
    limit. fsynced: the job row that will point at it is committed only after (blobs.put syncs
    the folder). Blocking: the core runs it on a worker thread."""
    size = 0
    with dest.open("wb") as out:
        while block := src.file.read(1 << 20):
            size += len(block)
            if size > max_bytes:
                raise PayloadTooLarge(f"upload exceeds the limit of {max_bytes} bytes",
                                      limit_bytes=max_bytes)
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    return size


async def accept_upload(d: Door, file: UploadFile | None, options: JobOptions,
                        owner: str | None, callback_url: str | None = None,
                        audio_url: str | None = None,
                        check: Callable[[float], None] | None = None,
                        idempotency_key: str | None = None, spool: Spool = spool_upload) -> str:
    """Hand the request's audio (a ``file`` or an ``audio_url``) to the door, once: the job id
    it committed, or the first job's when another request with the same Idempotency-Key
    committed first. ``check(duration_s)`` may refuse the upload after the probe.

    ``spool`` copies the upload to the path the core gives and returns the bytes written (raw
    PCM uploads of the whisper-asr-webservice API are wrapped in a WAV header on the way:
    app/api/asr/protocol.py)."""
    audio_url = (audio_url or "").strip() or None
    if (file is None) == (audio_url is None):
        raise MissingInput("send the audio as a multipart 'file' or name it in 'audio_url' "
                           "(one of the two)", field="file")
    return await d.submit(Upload(
        options, owner, write=partial(spool, file) if file is not None else None,
        filename=file.filename if file is not None else None, audio_url=audio_url,
        callback_url=callback_url, idempotency_key=idempotency_key, check=check))
