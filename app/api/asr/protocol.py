"""whisper-asr-webservice's protocol: the query's fields, the raw PCM body Bazarr sends (made a
WAV file as it is spooled), and the answers' shapes for /docs. The family: app/api/asr/__init__.py.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import File, Query, UploadFile

from app.api.errors import ErrorBody
from app.api.uploads import Spool, spool_upload
from app.errors import InvalidAudio, PayloadTooLarge
from app.windows import SAMPLE_RATE

Output = Literal["txt", "vtt", "srt", "tsv", "json"]
ASR_ENGINE = "faster_whisper"  # the engine family whose answers these are (whisper-asr-webservice's name)
# /detect-language reads only this much of a raw PCM upload: Bazarr sends a whole film's track
# (230 MB for two hours) to learn its language, and whisper-asr-webservice looks at 30 s.
# Five minutes leaves room for a silent or musical opening before the first speech.
DETECT_HEAD_S = 300.0
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 409, 413, 415, 422, 429, 500, 503, 504)
}
TEXT_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}},
          "description": "The transcript in the asked output format (json too is sent as text/plain, "
                         "as whisper-asr-webservice does)."},
    **ERRORS,
}
EncodeQuery = Annotated[bool, Query(description="false: the body is raw s16le 16 kHz mono PCM.")]
AudioFile = Annotated[UploadFile, File(description="Audio or video file (or raw PCM, encode=false).")]


MIN_PCM_BYTES = SAMPLE_RATE // 10 * 2  # 0.1 s of s16le: the shortest window the cutter keeps


def spool_pcm(src: UploadFile, dest: Path, max_bytes: int, max_s: float | None = None) -> int:
    """Copy raw s16le 16 kHz mono PCM into a WAV file (``wave`` writes the header and fixes its
    sizes on close). A trailing odd byte (half a sample) is dropped. With ``max_s`` only that
    many seconds are kept (at most ``max_bytes``) and the rest of the body is read and dropped
    (the body itself is bounded by the request size limit). Returns the PCM bytes kept."""
    head = None if max_s is None else min(max_bytes, int(max_s * SAMPLE_RATE) * 2)
    read = kept = 0
    carry = b""
    with wave.open(str(dest), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        while block := src.file.read(1 << 20):
            read += len(block)
            if head is None and read > max_bytes:
                raise PayloadTooLarge(f"upload exceeds the limit of {max_bytes} bytes",
                                      limit_bytes=max_bytes)
            if head is not None:
                block = block[: max(0, head - (read - len(block)))]
            data = carry + block
            whole = len(data) - len(data) % 2
            out.writeframesraw(data[:whole])
            carry = data[whole:]
            kept += whole
    if 0 < kept < MIN_PCM_BYTES:  # a few stray bytes are not audio: say so, do not transcribe
        raise InvalidAudio(f"raw PCM (encode=false) of {kept} bytes is less than 0.1 s of "
                           "16 kHz s16le audio")
    return kept


def spooler(encode: bool, head_s: float | None = None) -> Spool:
    """How the body is spooled: as the file it is, or (``encode=false``) as raw PCM wrapped in a
    WAV header, only its first ``head_s`` seconds kept."""
    if encode:
        return spool_upload
    return lambda src, dest, max_bytes: spool_pcm(src, dest, max_bytes, head_s)
