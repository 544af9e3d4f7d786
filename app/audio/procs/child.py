"""A prep process: decode, Silero VAD and cut for the streams the service placed on it.

In the service process, prep ran in threads beside the event loop, the batcher and result
assembly, and met the GIL: one 20-minute WAV's prep ran ~650x real time alone and ~105x beside
one busy pure-Python thread, and on the H200 py-spy saw about 2 of 16 prep threads on a CPU at
any time (loadtest/results/gpu-h200.json: GPU 10 % busy). Here it has an interpreter of its
own: its decoder, its VAD session, one thread (onnxruntime and the FFT as the threads had).

It runs one step at a time: the open stream with the fewest chunks done goes next (a short
upload's only chunk before a long one's tenth, as the thread pool's ranks did), if it holds a
credit (a slot to write a window into) and is not waiting for its part's end or for its
speaker stream. Between steps it reads every command waiting; with nothing to do it blocks on
its pipe (no polling). Before each step it says which stream it works on, so a crash (a
decoder bug on a hostile file) is blamed on that upload alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from app.audio.parts import PartStream, plan, silero_of, splittable
from app.audio.procs.slots import Arena
from app.audio.procs.wire import Failure, Out, Spec
from app.audio.server_vad import vad_for
from app.audio.stream import AudioStream, Chunk
from app.audio.vad import SileroModel, SileroVad
from app.windows import SAMPLE_RATE, Window

log = logging.getLogger("app.audio.procs")
AUDIO_AHEAD = 2  # chunks of a diarize job's audio sent and not yet taken by its speakers


@dataclass
class _Stream:
    sid: int
    spec: Spec
    stream: AudioStream | PartStream
    credits: list[int] = field(default_factory=list)
    pending: list[tuple[Window, int]] = field(default_factory=list)  # cut, not yet in a slot
    chunks: int = 0  # steps done: its rank
    skip: int = 0  # windows still to drop (a replay)
    audio_out: int = 0  # chunks of audio sent and not acknowledged
    seam_sent: bool = False

    def runnable(self) -> bool:
        if self.pending:
            return bool(self.credits)
        s = self.stream
        if s.done:
            return True  # its last record
        if isinstance(s, PartStream) and s.waiting:
            return False
        if self.spec.audio and self.audio_out >= AUDIO_AHEAD:
            return False
        if isinstance(s, PartStream) and s.seam is None:
            return True  # warm-up and the seam's search make no window: they need no slot
        return bool(self.credits)


class Worker:
    def __init__(self, conn: Connection, arena: Arena, vad: SileroVad) -> None:
        self.conn = conn
        self.arena = arena
        self.vad = vad
        self.streams: dict[int, _Stream] = {}

    def run(self) -> None:
        self.conn.send(("ready", os.getpid()))
        while True:
            ready = [s for s in self.streams.values() if s.runnable()]
            if not ready or self.conn.poll(0):
                while True:  # every command waiting (blocking only when nothing can run)
                    if not self._command(self.conn.recv()):
                        return
                    if not self.conn.poll(0):
                        break
                continue
            self._step(min(ready, key=lambda s: (s.chunks, s.sid)))

    def _command(self, msg: tuple[Any, ...]) -> bool:
        kind = msg[0]
        if kind == "exit":
            for sid in list(self.streams):
                self._drop(sid)
            return False
        sid = msg[1]
        s = self.streams.get(sid)
        if kind == "open":
            self._open(sid, msg[2])
        elif kind == "credit":
            if s is None:
                self.conn.send(("closed", sid, list(msg[2])))
            else:
                s.credits += msg[2]
        elif kind == "stop_at" and s is not None and isinstance(s.stream, PartStream):
            s.stream.stop_at(msg[2])
        elif kind == "ack" and s is not None:
            s.audio_out -= 1
        elif kind == "close":
            self._drop(sid)
            self.conn.send(("closed", sid, s.credits if s is not None else []))
        return True

    def _open(self, sid: int, spec: Spec) -> None:
        self.conn.send(("busy", sid))
        try:
            vad = vad_for(self.vad, spec.vad)
            path = Path(spec.path)
            parts, duration = 1, None
            if spec.part is not None:
                stream: AudioStream | PartStream = PartStream(path, vad, spec.max_audio_s,
                                                              spec.chunk_s, spec.part)
            else:
                if spec.split > 1 and not spec.separate and not spec.audio \
                        and not _too_short(spec):
                    silero_of(vad)  # parts need Silero
                    duration = splittable(path)
                    if duration:
                        parts = max(1, min(spec.split, int(duration // spec.part_s)))
                if parts > 1:
                    assert duration is not None
                    stream = PartStream(path, vad, spec.max_audio_s, spec.chunk_s,
                                        plan(duration, parts)[0])
                else:
                    stream = AudioStream(path, vad, spec.max_audio_s, spec.chunk_s,
                                         spec.separate)
        except Exception as exc:
            self._failed(sid, exc)
            return
        self.streams[sid] = _Stream(sid, spec, stream, skip=spec.skip)
        self.conn.send(("opened", sid, parts, duration))

    def _step(self, s: _Stream) -> None:
        self.conn.send(("busy", s.sid))
        out = Out()
        try:
            if not s.pending and not s.stream.done:
                chunk = s.stream.read_chunk()
                s.chunks += 1
                self._cut(s, chunk, out)
            while s.pending and s.credits:
                w, channel = s.pending.pop(0)
                slot = s.credits.pop()
                n = self.arena.write(slot, w.audio)
                out.windows.append((slot, n, round(w.start * SAMPLE_RATE),
                                    round(w.end * SAMPLE_RATE), channel))
        except Exception as exc:
            self._failed(s.sid, exc)
            return
        stream = s.stream
        out.fed = stream.samples
        if isinstance(stream, PartStream) and stream.seam is not None and not s.seam_sent:
            out.seam, s.seam_sent = stream.seam, True
        if stream.done and not s.pending:
            out.done, out.unused = True, s.credits
            del self.streams[s.sid]
            stream.close()
        self.conn.send(("out", s.sid, out))

    def _cut(self, s: _Stream, chunk: Chunk, out: Out) -> None:
        new = list(zip(chunk.windows, chunk.channels, strict=True))
        if s.skip:
            drop, s.skip = min(s.skip, len(new)), s.skip - min(s.skip, len(new))
            new = new[drop:]
        s.pending += new
        start = round(chunk.start_s * SAMPLE_RATE)
        if s.spec.audio and chunk.audio.size and start >= s.spec.skip_audio:
            pcm = np.multiply(chunk.audio, 32768.0).astype(np.int16)
            out.audio, out.audio_start = pcm.tobytes(), start
            out.channels = pcm.shape[0] if pcm.ndim == 2 else 1
            s.audio_out += 1

    def _failed(self, sid: int, exc: Exception) -> None:
        from app.errors import ServiceError

        if not isinstance(exc, ServiceError):
            log.exception("prep of stream %d failed", sid, exc_info=exc)
        s = self.streams.get(sid)
        self._drop(sid)
        self.conn.send(("error", sid, Failure.of(exc)))
        if s is not None and s.credits:
            self.conn.send(("closed", sid, s.credits))

    def _drop(self, sid: int) -> None:
        s = self.streams.pop(sid, None)
        if s is not None:
            try:
                s.stream.close()
            except Exception:
                log.exception("closing stream %d failed", sid)


def main(conn: Connection, arena: str, slots: int, nice: int) -> None:
    """The process's entry point (``multiprocessing`` spawn context); its first message is
    the VAD graph."""
    logging.basicConfig(level=logging.WARNING,
                        format="prep[%(process)d] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("libav").setLevel(logging.CRITICAL)  # clients' files, not our errors
    if nice:
        os.nice(nice)
    shm = Arena(slots, arena)
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):  # the service went away
        kind, model = conn.recv()
        assert kind == "model" and isinstance(model, SileroModel)
        Worker(conn, shm, SileroVad(model=model)).run()


def _too_short(spec: Spec) -> bool:
    """Shorter by its header (the probe's duration, never under the header's own) than two
    parts: it cannot be split, so its file is not opened a second time to ask. That open was
    ~14 % of a short clip's prep CPU here (py-spy, 120 corpus clips one after another)."""
    return 0 < spec.duration_s < 2 * spec.part_s
