"""One job's diarization, fed audio progressively: ``feed(samples, offset_s)`` then ``finish()``.

Work happens as audio arrives, so a job holds only what the end needs, never its whole audio:
- every 10 s segmentation window (1 s hop, pyannote's and 3D-Speaker's 10% of the window) is
  run as soon as its audio is in; its hard local-speaker activity is kept (3 bits per 17 ms
  frame, ~6 MB per hour) for the overlap-aware reconstruction;
- the frame-level speaker count is pyannote's ``Inference.aggregate`` (mean over the windows
  covering a frame, rounded; no Hamming, no warm-up trim, as 3D-Speaker's recipe calls it),
  accumulated window by window: a frame is final once no later window covers it. (Tried for
  issue 49 and not kept: averaging the model's probabilities instead of its argmax decisions,
  speech where the mean speech probability is above 1/2 and max(1, round(mean expected
  count)) speakers there: tuning split 11.20 -> 10.02 % DER, but held out 16.5 -> 16.9 %
  mean, AMI excerpts 12.2 -> 12.5 %. The speech it misses, e.g. EN2006a's, is speech no
  window's argmax hears at all; Silero VAD hears less still, 34 s missed on the tuning
  split where this count misses 1.3 s.)
- speech regions are the final frames with count > 0 (3D-Speaker's ``get_valid_field``); they
  are cut into 1.5 s crops every 0.75 s (3D-Speaker's ``chunk``), each embedded by CAM++ as soon
  as its region's frames are final, and only the 192-d embedding is kept (~3.7 MB per hour);
- a chunk's crops are embedded while the next chunk's windows are segmented (the two models on
  threads of their own), so a long upload's speaker work runs on two cores: a 10-minute
  meeting-like upload alone with ``diarize=true`` took 64 s with both models on one thread,
  against 25 s without speakers (2 cores, whisper-base);
- audio older than the next window, the next crop and the crops not embedded yet is dropped
  (about 10 s plus the last chunk are held).

At ``finish()`` pyannote's last, zero-padded window is run, the last crops are embedded, and
clustering and reconstruction run on a worker thread. The result is the same as feeding the
whole array at once (the same windows and crops, in the same order; model calls take fixed-size
inputs, so batching does not change an output beyond float rounding).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from app.speakers.cluster import SpeakerBounds, cluster
from app.speakers.evidence import crop_voices
from app.speakers.models import CROP_SAMPLES, SAMPLE_RATE, FrameGrid, circle_pad
from app.speakers.report import SpeakerTurns
from app.speakers.turns import compress, reconstruct, to_turns, voices_heard
from app.speakers.voices import match, unit_mean

if TYPE_CHECKING:
    from app.batching.primitive import ModelBatcher

CROP_S = 1.5  # 3D-Speaker's diarization sub-segment and hop (chunk(dur=1.5, step=0.75))
CROP_HOP_S = 0.75
MIN_SPEAKER_S = 0.3  # a speaker with less speech than this in all is not reported (turns.py)


class Geometry(Protocol):
    """What a stream needs to know about the segmentation model."""

    window_s: float
    window_step_s: float
    frames: FrameGrid

    @property
    def window_samples(self) -> int: ...


class SpeakerStream:
    """Per-job state. Not safe for concurrent ``feed`` calls: feed chunks one after another."""

    def __init__(self, job: Hashable, geometry: Geometry,
                 segmenter: ModelBatcher[np.ndarray, np.ndarray],
                 embedder: ModelBatcher[np.ndarray, np.ndarray],
                 bounds: SpeakerBounds | None = None,
                 known: Sequence[dict[str, Any]] = ()) -> None:
        self.job = job
        self.bounds = bounds or SpeakerBounds()
        self.known = list(known)  # [{"name", "voice"}]: app/speakers/named.py
        self._seg_b, self._emb_b = segmenter, embedder
        self._grid = geometry.frames
        self._win = geometry.window_samples
        self._hop = round(geometry.window_step_s * SAMPLE_RATE)
        self._buf = np.zeros(0, dtype=np.float32)  # audio from sample _b0 on
        self._b0 = 0
        self._n = 0  # samples received
        self._next_window = 0  # index of the next regular window
        self.windows: list[np.ndarray] = []  # hard segmentation per window
        self.window_frames: list[int] = []  # first frame of each
        self._acc = np.zeros((0, 2), dtype=np.float32)  # (sum, windows) from frame _f0 on
        self._f0 = 0
        self._count: list[np.ndarray] = []  # final per-frame speaker count
        self._region: float | None = None  # start of the open speech region
        self._crop: float = 0.0  # next crop start inside it
        self.crops: list[tuple[float, float]] = []
        self._sent = 0  # crops whose audio went to the embedder
        self.embeddings: list[np.ndarray] = []
        self._busy = False
        self._finished = False
        # What issue 49 changed, each switchable for the side-by-side bench
        # (loadtest/diarization_dev.py): the segmentation-evidence merge
        # (app/speakers/evidence.py) and no speaker with under ``min_speaker_s`` of speech
        # (app/speakers/turns.py).
        self.evidence = True
        self.min_speaker_s = MIN_SPEAKER_S

    # ---- public API ----------------------------------------------------------------------
    async def feed(self, samples: np.ndarray, offset_s: float) -> None:
        """Append 16 kHz mono float32 audio starting at ``offset_s`` (contiguous with what was
        fed before) and run the model work it makes possible."""
        self._enter()
        try:
            if abs(offset_s * SAMPLE_RATE - self._n) > 1:
                raise ValueError(f"chunk at {offset_s:.3f} s, expected {self._n / SAMPLE_RATE:.3f} s")
            samples = np.asarray(samples, dtype=np.float32).reshape(-1)
            self._buf = np.concatenate([self._buf, samples])
            self._n += len(samples)
            ready = []
            while self._next_window * self._hop + self._win <= self._n:
                ready.append(self._audio(self._next_window * self._hop, self._win))
                self._next_window += 1
            # The crops the last feed decided are embedded while this chunk's windows are
            # segmented: each model has a thread of its own (app/speakers/diarizer.py).
            await asyncio.gather(self._segment(ready, self._next_window - len(ready)),
                                 self._embed(self._crop_audio()))
            self._decide_crops(final=False)
            self._trim()
        except BaseException:
            self._finished = True  # half-applied work: the stream cannot go on (cancel included)
            raise
        finally:
            self._busy = False

    async def finish(self) -> SpeakerTurns:
        """Run what is left and return the speaker turns (overlaps allowed)."""
        self._enter()
        try:
            self._finished = True
            if self._n == 0:
                return SpeakerTurns([], self.bounds)
            last_window: list[np.ndarray] = []
            if self._n < self._win or (self._n - self._win) % self._hop:
                # pyannote's last window: from the next grid position, zero-padded.
                last_window.append(self._audio(self._next_window * self._hop, self._win))
            await asyncio.gather(self._segment(last_window, self._next_window),
                                 self._embed(self._crop_audio()))
            if not self.windows:
                return SpeakerTurns([], self.bounds)
            last = self.window_frames[-1] + len(self.windows[-1])
            self._finalize(last)
            self._decide_crops(final=True)
            await self._embed(self._crop_audio())
            return await asyncio.to_thread(self._result)
        finally:
            self._busy = False

    @property
    def duration(self) -> float:
        return self._n / SAMPLE_RATE

    @property
    def held_samples(self) -> int:
        """Audio samples this job still holds (bounded: about one window plus one chunk)."""
        return len(self._buf)

    # ---- internals -----------------------------------------------------------------------
    def _enter(self) -> None:
        if self._busy:
            raise RuntimeError("feed/finish called while another call of this stream runs")
        if self._finished:
            raise RuntimeError("stream already finished")
        self._busy = True

    def _audio(self, start: int, length: int) -> np.ndarray:
        """Samples [start, start+length) as a new array, zero-padded past the end."""
        assert start >= self._b0, "audio already dropped"
        out = np.zeros(length, dtype=np.float32)
        a, b = start, min(start + length, self._n)
        if b > a:
            out[a - start: b - start] = self._buf[a - self._b0: b - self._b0]
        return out

    async def _segment(self, windows: list[np.ndarray], first_index: int) -> None:
        if not windows:
            return
        results = await self._seg_b.run(self.job, windows)
        for i, seg in enumerate(results, start=first_index):
            first = int(np.rint(i * self._hop / SAMPLE_RATE / self._grid.step))
            self._add_window(seg, first)
            # Later windows start at or after the next grid position: frames before it are final.
            self._finalize(int(np.rint((i + 1) * self._hop / SAMPLE_RATE / self._grid.step)))

    def _add_window(self, seg: np.ndarray, first: int) -> None:
        self.windows.append(np.asarray(seg, dtype=np.uint8))
        self.window_frames.append(first)
        end = first + len(seg) - self._f0
        if end > len(self._acc):
            self._acc = np.concatenate([self._acc, np.zeros((end - len(self._acc), 2), np.float32)])
        lo = first - self._f0
        self._acc[lo:end, 0] += seg.sum(axis=1)
        self._acc[lo:end, 1] += 1

    def _finalize(self, upto: int) -> None:
        """Frames [_f0, upto) get their final count; speech regions advance over them."""
        k = upto - self._f0
        if k <= 0:
            return
        acc = self._acc[:k]
        if len(acc) < k:
            acc = np.concatenate([acc, np.zeros((k - len(acc), 2), np.float32)])
        count = np.where(acc[:, 1] > 0, np.rint(acc[:, 0] / np.maximum(acc[:, 1], 1e-12)), 0)
        self._count.append(count.astype(np.uint8))
        self._acc = self._acc[k:]
        for j, c in enumerate(count, start=self._f0):
            middle = j * self._grid.step + self._grid.duration / 2
            if c == 0 and self._region is not None:
                self._close_region(middle)
            elif c > 0 and self._region is None:
                self._region = self._crop = middle
        self._f0 = upto

    def _close_region(self, end: float) -> None:
        assert self._region is not None
        end = min(end, self.duration)
        while self._crop + CROP_S < end + CROP_HOP_S:
            self.crops.append((self._crop, min(self._crop + CROP_S, end)))
            self._crop += CROP_HOP_S
        self._region = None

    def _decide_crops(self, final: bool) -> None:
        """Decide the crops the final frames allow: an open region gets those that lie in its
        final frames; at the end it closes at its last frame's middle."""
        if final and self._region is not None:
            self._close_region((self._f0 - 1) * self._grid.step + self._grid.duration / 2)
        elif self._region is not None:
            horizon = self._f0 * self._grid.step + self._grid.duration / 2
            while self._crop + CROP_S <= horizon:
                self.crops.append((self._crop, self._crop + CROP_S))
                self._crop += CROP_HOP_S

    def _crop_audio(self) -> list[np.ndarray]:
        """The decided crops not sent yet, as circle-padded 1.5 s arrays (marked sent)."""
        out = []
        for s, e in self.crops[self._sent:]:
            a, b = int(s * SAMPLE_RATE), min(int(e * SAMPLE_RATE), self._n)
            out.append(circle_pad(self._audio(a, max(b - a, 0)), CROP_SAMPLES))
        self._sent = len(self.crops)
        return out

    async def _embed(self, crops: list[np.ndarray]) -> None:
        if crops:
            self.embeddings.extend(await self._emb_b.run(self.job, crops))

    def _trim(self) -> None:
        """Drop audio no future window or crop can need."""
        horizon = self._f0 * self._grid.step + self._grid.duration / 2
        first_crop = self._crop if self._region is not None else horizon
        if self._sent < len(self.crops):  # decided, to be embedded by the next call
            first_crop = min(first_crop, self.crops[self._sent][0])
        need = min(self._next_window * self._hop, int(first_crop * SAMPLE_RATE))
        drop = min(need, self._n) - self._b0
        if drop > 0:
            self._buf = self._buf[drop:].copy()
            self._b0 += drop

    def _result(self) -> SpeakerTurns:
        """Clustering and reconstruction (CPU work, on a thread)."""
        count = np.concatenate(self._count) if self._count else np.zeros(0, np.uint8)
        speech_s = round(float((count > 0).sum()) * self._grid.step, 3)
        if not self.embeddings:
            return SpeakerTurns([], self.bounds, 0, speech_s, match({}, self.known)[1])
        labels = cluster(np.stack(self.embeddings), self.bounds,
                         voices_heard(self.windows, self._grid),
                         crop_voices(self.windows, self.window_frames, self.crops, self._grid)
                         if self.evidence else None)
        spans = compress(self.crops, labels.tolist())
        need = self.bounds.num_speakers or self.bounds.min_speakers or 0
        binary = reconstruct(self.windows, self.window_frames, count, spans,
                             int(labels.max()) + 1, self._grid, need,
                             round(self.min_speaker_s / self._grid.step))
        emb = np.stack(self.embeddings)
        voices = {int(k): unit_mean(emb[labels == k]) for k in np.unique(labels)
                  if binary[:, k].any()}
        names, matches = match(voices, self.known)
        return SpeakerTurns(to_turns(binary, self._grid, self.duration, names), self.bounds,
                            len(self.embeddings), speech_s, matches)
