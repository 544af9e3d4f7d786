"""The types every stage passes along: audio windows, decode options, results.

Audio (app/audio) cuts uploads into :class:`Window`; the batcher (app/batching) groups them by
:class:`DecodeOptions`; the engine (app/engine) turns them into :class:`WindowResult`. Kept in a
module of their own so no stage imports another stage's code just to name its data.

What may differ inside one batch and what may not: CTranslate2's Whisper ``generate`` takes one
prompt per batch item, so a window's language, initial prompt and hotwords (its :class:`Prompt`)
are its own, and windows of different jobs, languages and prompts share decoder batches. Only
the search itself (task, beam, temperature, word alignment) must be equal: that is the batch key.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum
from typing import Any, Literal

import numpy as np

SAMPLE_RATE = 16_000
WINDOW_S = 30.0  # Whisper's encoder always sees 30 s; shorter windows are zero-padded
N_SAMPLES = int(SAMPLE_RATE * WINDOW_S)
HOP_LENGTH = 160  # mel frames of 10 ms
N_FRAMES = N_SAMPLES // HOP_LENGTH
TOKENS_PER_SECOND = SAMPLE_RATE / HOP_LENGTH / 2  # encoder positions: 20 ms each
PAD_STEP_S = 5  # dynamic time axis: padded lengths in 5 s classes (few sub-batches per batch)
INT16_SCALE = 1.0 / 32768.0  # int16 PCM to float32 in [-1, 1): exact (a power of two)
TOKEN_SLACK = 16  # tokens allowed beyond max_tokens_per_s: a 1 s window may still say a phrase
# Audio kept around each VAD speech span (split evenly between spans closer than twice this), so
# a window reaches into the upload's own audio around its speech. faster-whisper's VAD keeps
# 0.4 s; measured offline at the service's decode (beam 1, unsure windows at beam 5), 1.4 s took
# corpus-multilingual's mean error 26.4 -> 25.4 % and the English corpus's WER 13.9 -> 13.0 %
# (hard sets 21.1 -> 19.2, read speech 5.3 -> 5.6: one word), for ~5 % more encoder time
# (padded seconds 1450 -> 1525 on the English corpus). 0.7-2.0 s all did better than 0.4.
SPEECH_PAD_S = 1.4

Task = Literal["transcribe", "translate"]
LanguageDetection = Literal["per_upload", "per_window"]
Channels = Literal["mix", "separate"]


class Urgency(IntEnum):
    """How long a window may wait for the engine (issue 34 item 3): the batcher takes lower
    values first (app/batching/urgency.py says how and why)."""

    LIVE_FINAL = 0  # a live turn's final decode: latency-critical, never shed
    REQUEST = 1  # uploads and sync requests (short ones keep the batcher's own priority)
    LIVE_INTERIM = 2  # a live turn's re-decode so far: useful, droppable (see Shed)


# A live interim's place among the interims waiting, lowest first: (interim decodes its turn has
# had answered, when the turn's text was last refreshed, time.monotonic). A turn that has shown
# nothing yet goes before one already showing text, then the longest-waiting turn.
Refresh = tuple[int, float]


class Shed(Exception):
    """An interim decode given up on: the batcher was behind, or a newer interim of the same
    job superseded it. Its future raises this; a final is never shed."""


@dataclass(frozen=True)
class DecodeOptions:
    """The batch key: what must be equal for windows to share an engine call."""

    task: Task = "transcribe"
    beam_size: int = 1
    temperature: float = 0.0  # > 0: sample at this temperature instead of beam search
    word_timestamps: bool = False  # one extra batched ``align`` pass on the same encoder output
    detect_only: bool = False  # stop after the language: no decode
    other_beam_size: int | None = None  # the beam of windows not in English (None: beam_size)

    def beam_for(self, language: str) -> int:
        """A window's beam, once its language is known: ``other_beam_size`` unless English."""
        if self.other_beam_size is None or language == "en":
            return self.beam_size
        return self.other_beam_size


class LanguageChoice:
    """One upload's language, decided once from the first detection that reaches it.

    Shared by the windows of a job that gave no language (``language_detection=per_upload``):
    the engine asks it before detecting (a decided job's windows skip detection) and tells it
    what it detected; the first answer wins, and every window of the upload is decoded in it.
    Windows are encoded in upload order (the batcher takes a job's windows by rank), so that is
    the first speech window's detection. Engine threads share it: a lock guards the decision.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.language: str | None = None
        self.probability: float | None = None

    def decide(self, language: str, probability: float | None) -> tuple[str, float | None]:
        with self._lock:
            if self.language is None:
                self.language, self.probability = language, probability
            return self.language, self.probability


@dataclass(frozen=True)
class Prompt:
    """What the decoder is prompted with for one window: its own, whatever shares its batch."""

    language: str | None = None  # None: detected (from this window, or its upload's choice)
    initial_prompt: str | None = None
    hotwords: str | None = None  # faster-whisper's meaning: words to bias the decode towards
    # Text the window's decode continues: the audio begins with the speech this text is of (a
    # live turn read after the one before it, app/live/reading.py); the result is what follows.
    prefix: str | None = None
    choice: LanguageChoice | None = field(default=None, compare=False)  # per-upload detection


def as_float(audio: np.ndarray) -> np.ndarray:
    """A window's samples as float32 in [-1, 1] (int16 PCM scaled by :data:`INT16_SCALE`)."""
    if audio.dtype == np.int16:
        return audio.astype(np.float32) * np.float32(INT16_SCALE)
    return audio


@dataclass(eq=False)
class Window:
    """Up to 30 s of 16 kHz mono speech cut from one upload. ``audio`` is the window's own array
    (never a view into the whole upload), released once the window's result is back: float32
    in [-1, 1], or int16 PCM (read as x / 32768; the engine sends int16 batches to a GPU as
    int16, half the copy: :mod:`app.engine.mel`). Whoever reads samples rather than their
    count takes :func:`as_float`."""

    audio: np.ndarray
    start: float  # seconds from the start of the upload
    end: float
    prompt: Prompt = Prompt()
    pad_margin_s: float | None = None  # dynamic time axis: this window's margin (None: engine's)

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
    # per token (app/engine/tokens.py): the align pass's probability and the token's bytes
    token_probs: list[float] = field(default_factory=list)
    token_bytes: list[bytes] = field(default_factory=list)


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
    # A staged engine's first pass that asks for Whisper's 30 s fallback (a loop or an unsure
    # decode, see app/engine/whisper.py ``redo``), which the batcher runs as separate work.
    redo: bool = False
    # A decode that continued a prefix (Prompt.prefix) and reads as a loop or unsure: no
    # fallback was run on it; its caller decodes the audio again without the context.
    doubtful: bool = False

    @classmethod
    def detection(cls, language: str, probability: float | None) -> WindowResult:
        """A detect-only window's result: its language, no text."""
        return cls(text="", language=language, language_probability=probability,
                   avg_logprob=0.0, no_speech_prob=0.0, compression_ratio=0.0)


@dataclass(eq=False)
class Encoded:
    """A window between the two stages: its encoder output, waiting for a decoder batch.

    On CPU the encoder costs the same per window at any batch size, while the decoder's cost per
    window falls steeply with the batch: whisper-base int8 on one thread, 15 s windows, encoder
    121.7 ms per window at batch 1 and 121.3 at 8, decoder 93.6 ms at batch 1, 37.1 at 8, 31.3
    at 16 (``loadtest/results/stages.json`` of 88169a0, by the former ``loadtest/stages.py``: git
    history). Encoding as windows arrive and decoding one padded length at a time lets the
    decoder batch windows that arrived in different engine calls. Batch composition never
    changes a transcript, so neither does this.
    """

    samples: int  # the padded length the encoder saw: windows decode together only if equal
    features: np.ndarray  # (frames, d_model), host memory
    language: str  # given, the upload's choice, or detected from this window
    language_probability: float | None


@dataclass(frozen=True)
class JobOptions:
    """What a request asked for: built by the API, kept in the job row (``options``), and turned
    into the batch key (:meth:`decode_options`) and each window's :class:`Prompt` by the job
    runner. New fields get defaults, so rows written before them still load (:meth:`from_dict`
    drops fields it does not know)."""

    language: str | None = None  # None: detected
    language_detection: LanguageDetection = "per_upload"  # per_window: recordings that switch
    task: Task = "transcribe"
    beam_size: int = 1
    other_beam_size: int | None = None  # windows not in English, when the request gave no beam
    initial_prompt: str | None = None
    hotwords: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    detect_only: bool = False  # the language of the first speech window, no transcript
    diarize: bool = False
    num_speakers: int | None = None
    min_speakers: int | None = None
    max_speakers: int | None = None
    # diarize: [{"name", "voice"}] from reference clips (app/speakers/named.py), not the clips
    known_speakers: list[dict[str, Any]] | None = None
    logprobs: bool = False  # result["logprobs"]: OpenAI's per token (app/results/logprobs.py)
    vad: dict[str, float] | None = None  # OpenAI's server_vad settings (app/audio/server_vad.py)
    channels: Channels = "mix"  # separate: each channel transcribed, labelled by channel
    audio_url: str | None = None  # fetched by the service (recorded without credentials)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> JobOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # type: ignore[arg-type]

    def decode_options(self) -> DecodeOptions:
        return DecodeOptions(task=self.task, beam_size=self.beam_size,
                             other_beam_size=self.other_beam_size,
                             temperature=self.temperature, word_timestamps=self.word_timestamps,
                             detect_only=self.detect_only)

    def prompt(self) -> Prompt:
        """The windows' prompt; a fresh :class:`LanguageChoice` per upload when it is detected
        once for the whole upload."""
        per_upload = self.language is None and self.language_detection == "per_upload"
        return Prompt(language=self.language, initial_prompt=self.initial_prompt,
                      hotwords=self.hotwords, choice=LanguageChoice() if per_upload else None)
