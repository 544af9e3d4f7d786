"""A finished job's result as the API shows it (``Job.result``, ``GET /jobs/{id}/result``):
what app/results/transcript.py assembles, described for /docs."""

from __future__ import annotations

from pydantic import BaseModel, Field


def absent(v: object) -> bool:
    """Speaker fields are left out of jobs that asked for no speakers: those stay as before."""
    return v is None


class Segment(BaseModel):
    id: int
    start: float = Field(description="Seconds from the start of the upload.")
    end: float
    text: str
    language: str | None = Field(None, description="The window's language (they differ only "
                                 "with language_detection=per_window).")
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    compression_ratio: float | None = None
    temperature: float | None = None
    tokens: list[int] = []
    speaker: str | None = Field(
        None, exclude_if=absent,
        description="diarize=true: SPEAKER_00, SPEAKER_01, ... (in order of first "
        "appearance); channels=separate: channel_0, channel_1, ... Absent otherwise.")


class Word(BaseModel):
    word: str
    start: float = Field(description="Seconds from the start of the upload.")
    end: float
    probability: float | None = None
    speaker: str | None = Field(None, exclude_if=absent,
                                description="As the segment's (diarize, channels=separate).")


class Transcription(BaseModel):
    text: str
    language: str | None
    language_probability: float | None = Field(
        None, description="Detection confidence; null when the language was given."
    )
    duration: float = Field(description="Decoded audio length in seconds.")
    segments: list[Segment]
    words: list[Word] | None = Field(None, description="Only when word timestamps were asked for.")
    speakers: list[str] | None = Field(
        None, exclude_if=absent,
        description="diarize=true or channels=separate: the speaker labels that occur.")
