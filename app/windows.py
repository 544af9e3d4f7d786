"""The types every stage passes along: audio windows, decode options, results.

Audio (app/audio) cuts uploads into :class:`Window`; the batcher (app/batching) groups them by
:class:`DecodeOptions`; the engine (app/engine) turns them into :class:`WindowResult`. Kept in a
module of their own so no stage imports another stage's code just to name its data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

SAMPLE_RATE = 16_000
WINDOW_S = 30.0  # Whisper's encoder always sees 30 s; shorter windows are zero-padded
N_SAMPLES = int(SAMPLE_RATE * WINDOW_S)
HOP_LENGTH = 160  # mel frames of 10 ms
N_FRAMES = N_SAMPLES // HOP_LENGTH
TOKENS_PER_SECOND = SAMPLE_RATE / HOP_LENGTH / 2  # encoder positions: 20 ms each
PAD_STEP_S = 5  # dynamic time axis: padded lengths in 5 s classes (few sub-batches per batch)
TOKEN_SLACK = 16  # tokens allowed beyond max_tokens_per_s: a 1 s window may still say a phrase

Task = Literal["transcribe", "translate"]

@dataclass(frozen=True)
class DecodeOptions:
    """Options that must be equal for windows to share a batch (they share one prompt)."""

    language: str | None = None  # None: detect per window (used for a job's first window)
    task: Task = "transcribe"
    beam_size: int = 1
    initial_prompt: str | None = None
    temperature: float = 0.0  # > 0: sample at this temperature instead of beam search
    word_timestamps: bool = False  # one extra batched ``align`` pass on the same encoder output


@dataclass(eq=False)
class Window:
    """Up to 30 s of 16 kHz mono speech cut from one upload."""

    audio: np.ndarray
    start: float  # seconds from the start of the upload
    end: float

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE


@dataclass
class Word:
    word: str  # with its leading space, as Whisper spells it
    start: float  # seconds from the start of the upload
    end: float
    probability: float
    tokens: list[int] = field(default_factory=list)


@dataclass
class WindowResult:
    text: str
    language: str
    language_probability: float | None
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    words: list[Word] | None = None  # only when DecodeOptions.word_timestamps


@dataclass(eq=False)
class Encoded:
    """A window between the two stages: its encoder output, waiting for a decoder batch.

    On CPU the encoder costs the same per window at any batch size, while the decoder's cost per
    window falls steeply with the batch (``python -m loadtest.stages`` measures both;
    ``loadtest/results/stages.json``). Encoding as windows arrive and decoding one padded length
    at a time lets the decoder batch windows that arrived in different engine calls. Batch
    composition never changes a transcript, so neither does this.
    """

    samples: int  # the padded length the encoder saw: windows decode together only if equal
    features: np.ndarray  # (frames, d_model), host memory
    language: str
    language_probability: float | None


LanguageDetection = Literal["per_upload", "per_window"]
Channels = Literal["mix", "separate"]


@dataclass(frozen=True)
class JobOptions:
    """What a request asked for: built by the API, kept in the job row (``options``), and turned
    into batch keys and per-window settings by the job runner. New fields get defaults, so rows
    written before them still load (:meth:`from_dict` drops fields it does not know)."""

    language: str | None = None  # None: detected
    language_detection: LanguageDetection = "per_upload"  # per_window: recordings that switch
    task: Task = "transcribe"
    beam_size: int = 1
    initial_prompt: str | None = None
    hotwords: str | None = None  # faster-whisper's meaning: words to bias towards
    temperature: float = 0.0
    word_timestamps: bool = False
    detect_only: bool = False  # the language of the first speech window, no transcript
    diarize: bool = False
    num_speakers: int | None = None
    min_speakers: int | None = None
    max_speakers: int | None = None
    channels: Channels = "mix"  # separate: each channel transcribed, labelled by channel
    audio_url: str | None = None  # fetched by the service (recorded without credentials)

    def to_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> JobOptions:
        from dataclasses import fields

        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # type: ignore[arg-type]

    def decode_options(self) -> DecodeOptions:
        return DecodeOptions(language=self.language, task=self.task, beam_size=self.beam_size,
                             initial_prompt=self.initial_prompt, temperature=self.temperature,
                             word_timestamps=self.word_timestamps)
