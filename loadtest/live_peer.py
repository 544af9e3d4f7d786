"""The live peer of issue 34: WhisperLive 0.10.0 (its faster_whisper backend, one shared model,
with and without its cross-client ``batch_enabled`` mode) on the service's own whisper-base
CTranslate2 folder, N streams of corpus speech at real-time pace.

    bash loadtest/peer_setup_live.sh
    PYTHONPATH=$PWD .venv/bin/python -m loadtest.live_peer --streams 1,4 --batch off,on \
        --seconds 45 --out loadtest/results/live_peer.json

WhisperLive's protocol (its own client, ``whisper_live/client.py``): a JSON options message,
``SERVER_READY`` back, then raw float32 16 kHz frames; the server answers with its last
``send_last_n_segments`` segments, each ``{"start", "end", "text", "completed"}`` in stream
seconds. An utterance is **finalised** by the first message in which a completed segment reaches
its end (ends within ``--tolerance`` of it, or starts after it: the stream has moved past it);
**never finalised** if no message did by the time the client closes, ``--drain`` seconds of
silence after the last audio (a microphone keeps sending). Any segment covering an utterance
before its last chunk was sent counts as interim text. The finalised text is every completed
segment once, in order. See loadtest/lib/live_common.py for the streams, pacing and scores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib.common import free_port, proc_status_kb, resolve_model
from loadtest.lib.live_common import (
    CHUNK,
    Done,
    Outcome,
    Stream,
    build_stream,
    chunks_of,
    finalise,
    live_clips,
    loadavg,
    paced,
    score,
)
from loadtest.lib.probes import cpu_seconds

VENV = Path(os.environ.get("WHISPERLIVE_VENV", "/work/peers/whisperlive-venv"))
LAUNCH = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from whisper_live.server import TranscriptionServer
port, model, clients, batch, cache = sys.argv[1:6]
TranscriptionServer().run("127.0.0.1", int(port), backend="faster_whisper",
                          faster_whisper_custom_model_path=model, single_model=True,
                          max_clients=int(clients), max_connection_time=3600,
                          batch_enabled=batch == "1", cache_path=cache)
"""


class Peer:
    """A WhisperLive server process on a free port."""

    def __init__(self, model: str, clients: int, batch: bool, work: Path) -> None:
        self.port = free_port()
        self.log = work / f"whisperlive-{'batch' if batch else 'plain'}-{clients}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
        env.pop("LD_PRELOAD", None)  # its own allocator, as it ships
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(VENV / "bin" / "python"), "-c", LAUNCH, str(self.port), model, str(clients),
                 "1" if batch else "0", str(work / "cache")],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_up(self, timeout: float = 120.0) -> None:
        """Until its port takes connections (its server prints nothing when it is up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"WhisperLive exited: {self.log.read_text()[-3000:]}")
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.25)
        raise RuntimeError("WhisperLive did not open its port")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _seen(out: Outcome, stream: Stream, completed: dict[str, tuple[float, float, str]],
          spans: list[Done], segs: list[dict[str, Any]], now: float) -> None:
    """``completed``: each completed segment's latest span and text; ``spans``: each completed
    segment's span when it first arrived, and when."""
    for seg in segs:
        st, en = float(seg["start"]), float(seg["end"])
        if seg.get("completed"):
            if seg["start"] not in completed:
                spans.append((st, en, now))
            completed[seg["start"]] = (st, en, seg.get("text", ""))
        for k, u in enumerate(stream.utterances):  # text over an utterance still being spoken
            if st < u.end_s and en > u.start_s and now < out.t0 + u.spoken_at:
                out.interim_before_end.add(k)


async def one_stream(url: str, stream: Stream, model: str, drain_s: float, tolerance: float,
                     delay_s: float) -> Outcome:
    import websockets

    await asyncio.sleep(delay_s)  # connects spread out: its batch mode admits 5 clients/s
    out = Outcome()
    completed: dict[str, tuple[float, float, str]] = {}
    spans: list[Done] = []
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        await ws.send(json.dumps({
            "uid": str(uuid.uuid4()), "language": "en", "task": "transcribe", "model": model,
            "use_vad": True, "send_last_n_segments": 10, "no_speech_thresh": 0.45,
            "clip_audio": False, "same_output_threshold": 10}))
        while True:  # its first answers: a language, SERVER_READY, or a refusal
            ready = json.loads(await ws.recv())
            if ready.get("status") in ("WAIT", "ERROR"):
                out.errors.append(f"{ready.get('status')}: {ready.get('message')}")
                return out
            if ready.get("message") == "SERVER_READY":
                break

        async def read() -> None:
            async for raw in ws:
                msg = json.loads(raw)
                if msg.get("segments"):
                    _seen(out, stream, completed, spans, msg["segments"], time.monotonic())

        reader = asyncio.create_task(read())
        out.t0 = time.monotonic()
        audio = np.concatenate([stream.audio, np.zeros(int(drain_s * 16_000), np.float32)])

        async def send(k: int) -> None:
            await ws.send(audio[k * CHUNK:(k + 1) * CHUNK].astype(np.float32).tobytes())

        try:
            await paced(chunks_of(audio.size), send, out.t0)
        except websockets.ConnectionClosed as exc:
            out.errors.append(f"closed: {exc}")
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    finalise(out, stream, spans, tolerance)
    out.text = " ".join(t.strip() for _, _, t in sorted(completed.values()) if t.strip())
    return out


async def run_case(model: str, n: int, batch: bool, seconds: float, drain_s: float,
                   tolerance: float, work: Path, seed: int) -> dict[str, Any]:
    clips = live_clips()
    cache: dict[str, np.ndarray] = {}
    streams = [build_stream(clips, seconds, seed + k, cache=cache) for k in range(n)]
    peer = Peer(model, max(n, 1), batch, work)
    try:
        await asyncio.to_thread(peer.wait_up)
        load_before, cpu0, t0 = loadavg(), cpu_seconds(peer.proc.pid), time.monotonic()
        outcomes = await asyncio.gather(*(one_stream(
            f"ws://127.0.0.1:{peer.port}", s, model, drain_s, tolerance, 0.3 * k)
            for k, s in enumerate(streams)))
        wall = time.monotonic() - t0
        cpu = cpu_seconds(peer.proc.pid) - cpu0
        rss = proc_status_kb(peer.proc.pid, "VmHWM")
    finally:
        peer.stop()
    return {"peer": "whisper-live==0.10.0 (faster_whisper backend, single_model)",
            "batch_enabled": batch, "streams": n, "speech_s_per_stream": seconds,
            "load_before": load_before, "load_after": loadavg(),
            "server_cores": round(cpu / wall, 3), "peak_rss_mb": rss and round(rss / 1024, 1),
            **score(streams, list(outcomes)),
            "texts": [o.text for o in outcomes], "log": str(peer.log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4", help="comma-separated N")
    ap.add_argument("--batch", default="off,on", help="off, on, or both")
    ap.add_argument("--seconds", type=float, default=45.0, help="speech per stream (about)")
    ap.add_argument("--drain", type=float, default=10.0, help="silence sent after the audio")
    ap.add_argument("--tolerance", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--model", default="whisper-base")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = resolve_model(args.model)
    results = []
    with tempfile.TemporaryDirectory(prefix="live-peer-") as tmp:
        for mode in args.batch.split(","):
            for n in (int(x) for x in args.streams.split(",")):
                r = asyncio.run(run_case(model, n, mode == "on", args.seconds, args.drain,
                                         args.tolerance, Path(tmp), args.seed))
                r["log_tail"] = Path(r.pop("log")).read_text(errors="replace")[-1500:]
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("texts", "log_tail")}),
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from loadtest.lib.common import machine_info

    machine = machine_info()
    args.out.write_text(json.dumps({"commit": machine["git"], "clean_tree": machine["git_clean"],
                                    "machine": machine, "model": model, "results": results},
                                   indent=1))


if __name__ == "__main__":
    main()
