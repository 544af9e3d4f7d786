"""The OpenAI audio API's response shapes: its pydantic models (what ``/docs`` shows and the
``openai`` SDK parses) and the functions that build them from a job's result."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from app.engine.languages import LANGUAGES


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VerboseSegment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None


class VerboseWord(BaseModel):
    word: str
    start: float
    end: float


class DiarizedSegment(BaseModel):
    type: Literal["transcript.text.segment"] = "transcript.text.segment"
    id: str
    speaker: str
    start: float
    end: float
    text: str


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class OpenAIDiarized(BaseModel):
    """``response_format=diarized_json``: OpenAI's ``TranscriptionDiarized``."""

    task: Literal["transcribe"] = "transcribe"
    duration: float
    text: str
    segments: list[DiarizedSegment]
    usage: DurationUsage | None = None


class OpenAITranscription(BaseModel):
    """json: ``text`` only; verbose_json: every field (``words`` when asked for)."""

    text: str
    task: Literal["transcribe", "translate"] | None = None
    language: str | None = None
    duration: float | None = None
    language_probability: float | None = None
    segments: list[VerboseSegment] | None = None
    words: list[VerboseWord] | None = None


def verbose_json(result: dict[str, Any], task: str, words: bool) -> dict[str, Any]:
    code = result.get("language")
    out: dict[str, Any] = {
        "task": task, "language": LANGUAGES.get(code or "", code), "duration": result["duration"],
        "text": result["text"], "language_probability": result.get("language_probability"),
        "segments": [
            {"id": s["id"], "seek": s.get("seek", 0), "start": s["start"], "end": s["end"],
             "text": s["text"], "tokens": s.get("tokens", []),
             "temperature": s.get("temperature", 0.0), "avg_logprob": s.get("avg_logprob"),
             "compression_ratio": s.get("compression_ratio"),
             "no_speech_prob": s.get("no_speech_prob")}
            for s in result.get("segments", [])
        ],
    }
    if words:
        out["words"] = [{"word": w["word"], "start": w["start"], "end": w["end"]}
                        for w in result.get("words") or []]
    return out


def diarized_json(result: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``TranscriptionDiarized`` from a diarized job's result. Speakers are renamed as
    OpenAI names them (A, B, ... by first appearance); a segment where the speaker models heard
    no speech at all keeps the name ``unknown``."""
    names = {s: speaker_letter(k) for k, s in enumerate(result.get("speakers") or [])}
    segments = [
        DiarizedSegment(id=f"seg_{k}", speaker=names.get(s.get("speaker") or "", "unknown"),
                        start=s["start"], end=s["end"], text=s["text"])
        for k, s in enumerate(s for s in result.get("segments", []) if s.get("text"))
    ]
    return OpenAIDiarized(duration=result["duration"], text=result["text"], segments=segments,
                          usage=DurationUsage(seconds=result["duration"])).model_dump(mode="json")


def speaker_letter(k: int) -> str:
    """A, B, ..., Z, then AA, AB, ... (spreadsheet columns)."""
    out = ""
    k += 1
    while k:
        k, r = divmod(k - 1, 26)
        out = chr(65 + r) + out
    return out
