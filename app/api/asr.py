"""whisper-asr-webservice's API: ``POST /asr`` and ``POST /detect-language``.

Bazarr's Whisper provider, and other tools written for ahmetoner/whisper-asr-webservice, call
these routes. That service runs one request at a time; here the uploads go through the same
job store and micro-batcher as every other route (same keys, limits, backpressure), so several
Bazarr calls at once share batches. Parameters, content types and answers follow its
``app/webservice.py`` (1.9) and its faster-whisper engine's writers:

* query ``encode`` (default true): false means the body is raw s16le 16 kHz mono PCM, which is
  what Bazarr sends (its own ffmpeg extracts the track); it is wrapped in a WAV header as it is
  spooled, so the rest of the pipeline sees an ordinary file.
* ``/asr``: ``task``, ``language``, ``initial_prompt``, ``word_timestamps``, ``output`` =
  txt|json|vtt|srt|tsv, answered as ``text/plain`` with ``Asr-Engine`` and an attachment
  ``Content-Disposition`` named ``<upload name>.<output>``. ``vad_filter`` is accepted and has
  no effect: this service always cuts uploads at speech. Subtitle cues follow
  ``max_line_width``, ``max_line_count`` and ``max_cue_s`` (this service's own additions).
* ``/detect-language``: ``{"detected_language": "english", "language_code": "en",
  "confidence": 0.98}``, from the first speech window. With no speech at all the code is
  ``und`` (Bazarr treats that as "could not detect").

Unknown query parameters (Bazarr's ``video_file``) are ignored, as they are there.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, File, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from app.api.deps import Caller, caller, cue_query, ready_door
from app.api.schemas import ErrorBody
from app.api.transcribe import accept_upload, decode_options, spool_upload
from app.api.waiting import wait_for_job
from app.engine.languages import LANGUAGES
from app.errors import InvalidAudio, PayloadTooLarge
from app.jobs.door import Door
from app.results.asr import asr_body
from app.results.formats import CueOptions
from app.windows import SAMPLE_RATE, JobOptions

router = APIRouter(tags=["whisper-asr-webservice"])
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


def _spooler(encode: bool, head_s: float | None = None) -> Any:
    if encode:
        return spool_upload
    return lambda src, dest, max_bytes: spool_pcm(src, dest, max_bytes, head_s)


@router.post("/asr", response_class=Response, responses=TEXT_ANSWER)
async def asr(
    request: Request,
    audio_file: AudioFile,
    encode: EncodeQuery = True,
    task: Annotated[Literal["transcribe", "translate"], Query()] = "transcribe",
    language: Annotated[str | None, Query(description="ISO 639-1; detected when absent.")] = None,
    initial_prompt: Annotated[str | None, Query(max_length=1000)] = None,
    vad_filter: Annotated[bool, Query(description="Accepted; uploads are always cut at speech.")] = False,
    word_timestamps: Annotated[bool, Query(description="Word times in the json output.")] = False,
    output: Annotated[Output, Query()] = "txt",
    cue: CueOptions = Depends(cue_query),
    d: Door = Depends(ready_door),
    who: Caller = Depends(caller),
) -> Response:
    # Subtitles are cut from word times (sentence-sized cues), as on /v1.
    aligned = word_timestamps or output in ("srt", "vtt", "tsv")
    options = decode_options(d.settings, language, task, None, initial_prompt, 0.0, aligned)
    job_id = await accept_upload(d, audio_file, options, who, spool=_spooler(encode))
    row = await wait_for_job(request, d, job_id, who.owner)
    assert row.result is not None
    name = quote(audio_file.filename or "audio")
    return Response(asr_body(row.result, output, word_timestamps, cue), media_type="text/plain",
                    headers={"Asr-Engine": ASR_ENGINE, "X-Batchscribe-Job-Id": job_id,
                             "Content-Disposition": f'attachment; filename="{name}.{output}"'})


@router.post("/detect-language", responses=ERRORS)
async def detect_language(
    request: Request, audio_file: AudioFile, encode: EncodeQuery = True,
    d: Door = Depends(ready_door), who: Caller = Depends(caller),
) -> JSONResponse:
    """The language of the first speech window (raw PCM: of its first five minutes)."""
    job_id = await accept_upload(d, audio_file, JobOptions(detect_only=True), who,
                                 spool=_spooler(encode, DETECT_HEAD_S))
    row = await wait_for_job(request, d, job_id, who.owner)
    assert row.result is not None
    code = row.result.get("language") or "und"
    prob = row.result.get("language_probability")
    return JSONResponse({"detected_language": LANGUAGES.get(code, "undefined"),
                         "language_code": code, "confidence": round(float(prob or 0.0), 4)},
                        headers={"X-Batchscribe-Job-Id": job_id})
