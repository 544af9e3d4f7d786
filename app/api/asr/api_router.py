"""whisper-asr-webservice's routes (the family: app/api/asr/__init__.py): the upload made a job
through the door, waited for (app/api/waiting.py), and answered as that service answers."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from app.api.asr.protocol import (
    ASR_ENGINE,
    DETECT_HEAD_S,
    ERRORS,
    TEXT_ANSWER,
    AudioFile,
    EncodeQuery,
    Output,
    spooler,
)
from app.api.deps import Caller, caller, cue_query, ready_door
from app.api.uploads import accept_upload, decode_options
from app.api.waiting import wait_for_job
from app.engine.languages import LANGUAGES
from app.jobs.door import Door
from app.results.asr import asr_body
from app.results.formats import CueOptions
from app.windows import JobOptions

router = APIRouter(tags=["whisper-asr-webservice"])


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
    job_id = await accept_upload(d, audio_file, options, who.owner, spool=spooler(encode))
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
    job_id = await accept_upload(d, audio_file, JobOptions(detect_only=True), who.owner,
                                 spool=spooler(encode, DETECT_HEAD_S))
    row = await wait_for_job(request, d, job_id, who.owner)
    assert row.result is not None
    code = row.result.get("language") or "und"
    prob = row.result.get("language_probability")
    return JSONResponse({"detected_language": LANGUAGES.get(code, "undefined"),
                         "language_code": code, "confidence": round(float(prob or 0.0), 4)},
                        headers={"X-Batchscribe-Job-Id": job_id})
