"""Named speakers: reference clips of known people label the diarized speakers they match.

OpenAI's diarizing model takes ``known_speaker_names[]`` with ``known_speaker_references[]``
(2-10 s clips as data URLs, up to 4) and names segments after them; ``POST /transcribe`` takes
the same names with reference files. Each reference is embedded like the recording is: cut
into 1.5 s crops every 0.75 s of its speech (the segmentation model finds the speech), a CAM++
embedding per crop, and their normalised mean is its voice (:func:`voiceprint`, through the
diarizer's own batchers, so the work is batched and off the event loop). Voices (192 floats
each) travel with the job's options; the references themselves are not kept.

At the end of the job the speaker stream matches the voices to the recording's speakers
(app/speakers/voices.py: one to one, at cosine >= ``MATCH_COS``, how sure each match is); a
matched speaker is called by its name, the others keep their labels (``SPEAKER_00``..., or
OpenAI's letters).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import re
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from app.speakers.limits import MAX_KNOWN
from app.speakers.voices import unit_mean

if TYPE_CHECKING:
    from app.speakers.diarizer import Diarizer
    from app.speakers.service import SpeakerService

MIN_REF_S, MAX_REF_S = 1.5, 30.0  # one crop at least; OpenAI asks for 2-10 s
MAX_NAME = 100
DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,",
                      re.IGNORECASE)


class BadReference(ValueError):
    """A reference that cannot be used; the API answers 400 naming ``field``."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_names(names: Sequence[str], references: int, field: str) -> list[str]:
    """Names paired with references: as many, at most MAX_KNOWN, distinct, non-empty."""
    clean = [" ".join(str(n).split()) for n in names]
    if len(clean) != references:
        raise BadReference(f"{len(clean)} name(s) for {references} reference(s): give one "
                             "name per reference, in the same order", field)
    if not clean or len(clean) > MAX_KNOWN:
        raise BadReference(f"give 1 to {MAX_KNOWN} known speakers", field)
    if any(not n or len(n) > MAX_NAME for n in clean):
        raise BadReference(f"a speaker name must be 1-{MAX_NAME} characters", field)
    if len(set(clean)) != len(clean):
        raise BadReference("speaker names must be distinct", field)
    if any(re.fullmatch(r"SPEAKER_\d+", n) for n in clean):
        raise BadReference("SPEAKER_<n> names are the service's labels for unnamed speakers",
                             field)
    return clean


def data_url_bytes(url: str, field: str) -> bytes:
    """The audio inside a base64 ``data:`` URL (OpenAI's known_speaker_references[] format)."""
    m = DATA_URL.match(url.strip())
    if m is None:
        raise BadReference("a reference must be a data URL: data:audio/wav;base64,...", field)
    if m.group("type") and not m.group("type").lower().startswith(("audio/", "video/",
                                                                   "application/octet")):
        raise BadReference(f"a reference must be audio, not {m.group('type')}", field)
    try:
        return base64.b64decode(url.strip()[m.end():], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadReference("a reference's base64 data does not decode", field) from exc


def probe_references(folder: Path, clips: Sequence[bytes], field: str
                     ) -> tuple[list[Path], float]:
    """Blocking: the clips as files in ``folder``, each probed as an upload is (the container
    and codec allow-lists, the header's duration at most ``MAX_REF_S``) before anything is
    decoded; and their audio seconds together, each at least ``MIN_REF_S`` (what is charged)."""
    from app.audio import probe
    from app.errors import ServiceError

    paths, seconds = [], 0.0
    for k, data in enumerate(clips):
        path = folder / f"reference-{k}"
        path.write_bytes(data)
        try:
            seconds += max(MIN_REF_S, probe(path, MAX_REF_S).duration_s)
        except ServiceError as exc:
            raise BadReference(f"a reference is not usable audio: {exc.message}", field) from exc
        paths.append(path)
    return paths, seconds


def decode_reference(path: Path, field: str) -> np.ndarray:
    """Blocking (run it on a thread): 16 kHz mono float32 of a probed reference clip, checked."""
    from app.audio import decode
    from app.errors import ServiceError

    try:
        audio = decode(path, MAX_REF_S + 60)
    except ServiceError as exc:
        raise BadReference(f"a reference is not usable audio: {exc.message}", field) from exc
    seconds = len(audio) / 16_000
    if not MIN_REF_S <= seconds <= MAX_REF_S:
        raise BadReference(f"a reference lasts {seconds:.1f} s; give {MIN_REF_S:g}-"
                             f"{MAX_REF_S:g} s of the speaker alone (2-10 s is plenty)", field)
    return audio


async def voiceprint(diarizer: Diarizer, audio: np.ndarray) -> np.ndarray | None:
    """The normalised mean CAM++ embedding of a clip's 1.5 s crops of speech (None: the
    segmentation model heard no speech in it)."""
    stream = diarizer.stream()
    await stream.feed(audio, 0.0)
    await stream.finish()
    if not stream.embeddings:
        return None
    return unit_mean(np.stack(stream.embeddings))


async def known_voices(diarizer: Diarizer, names: Sequence[str], clips: Sequence[Path],
                       field: str) -> list[dict[str, Any]]:
    """``[{"name", "voice"}]`` for the job's options, from the (checked) names and clips."""
    out = []
    for name, path in zip(names, clips, strict=True):
        audio = await asyncio.to_thread(decode_reference, path, field)
        voice = await voiceprint(diarizer, audio)
        if voice is None:
            raise BadReference(f"no speech found in the reference for {name!r}", field)
        out.append({"name": name, "voice": [round(float(v), 6) for v in voice]})
    return out


def public_options(options: dict[str, Any]) -> dict[str, Any]:
    """A job's options as the API shows them: known speakers by name (not 192 numbers each)."""
    known = options.get("known_speakers")
    if not known:
        return options
    return {**options, "known_speakers": [k.get("name") for k in known]}


# Audio seconds of references -> the admission that holds them in the caller's share while
# they are decoded and embedded (429 past it).
Admit = Callable[[float], AbstractAsyncContextManager[None]]


async def reference_voices(service: SpeakerService | None, names: Sequence[str],
                           clips: Sequence[bytes | str], names_field: str, refs_field: str,
                           admit: Admit | None = None) -> list[dict[str, Any]]:
    """The API's entry: checked names and clips (bytes, or OpenAI's data URLs) -> the job's
    ``known_speakers``; a bad reference is a 400 naming its field, no retry. Each clip is
    probed behind the allow-lists and its duration charged (``admit``) before anything decodes
    it: issue 51 found references decoded and embedded before the main audio was admitted,
    uncharged, on the shared speaker threads, and past the codec allow-list. The speaker
    models are loaded first if nobody has asked for them yet."""
    from app.errors import BadRequest, DiarizationOff

    if service is None:
        raise DiarizationOff("speaker diarization is not available on this service",
                             field=refs_field)
    try:
        clean = check_names(names, len(clips), names_field)
        data = [c if isinstance(c, bytes) else data_url_bytes(c, refs_field) for c in clips]
        with tempfile.TemporaryDirectory(prefix="references-") as folder:
            paths, seconds = await asyncio.to_thread(probe_references, Path(folder), data,
                                                     refs_field)
            async with (admit(seconds) if admit is not None else contextlib.nullcontext()):
                return await known_voices(await service.diarizer(), clean, paths, refs_field)
    except BadReference as exc:
        raise BadRequest(str(exc), field=exc.field, no_retry=True) from exc
