"""batchscribe's live bench (issue 34): N Realtime transcription sessions over ``/v1/realtime``,
each streaming corpus speech at real-time pace with server VAD, optionally beside upload traffic.

    PYTHONPATH=$PWD .venv/bin/python -m loadtest.live --streams 1,4,16 --seconds 60 \
        --beside long --out loadtest/results/live.json          # phase B: the route exists

Each session speaks OpenAI's protocol exactly as the official SDK does (``session.update`` of a
transcription session: PCM16 at 24 kHz, ``server_vad`` 0.5 / 300 ms / 500 ms, language en; then
``input_audio_buffer.append`` every 100 ms). An utterance is **finalised** by the first
``...transcription.completed`` whose item reaches its end (the item's ``audio_end_ms`` from
``speech_stopped`` within ``--tolerance`` of it, or a completed item that starts after it); its
turn latency runs from its last chunk's send time to that event (so it includes the 500 ms of
silence VAD waits for). Interim text: a ``delta`` for an item over the utterance before its last
chunk was sent. Also counted: the protocol's own promise (each item's deltas join to its
``transcript``), ``error`` and ``failed`` events. ``--batch-wer`` transcribes the same clips
through ``/transcribe`` afterwards (clip by clip, and each stream as one upload): live WER
against batch WER, by how the session's VAD cut each utterance (``wer_by_turns``: whole, split,
merged, not heard), on the corpus's read speech (``wer_by_set``), and with each finalised turn
uploaded alone (``turns_uploaded``: what reading turns live costs apart from what the turns
cost). ``--silence-ms``: the pause that ends a turn (OpenAI's 500 by default).
``--eagerness off,auto`` runs each N twice in turn on the same streams, with server VAD and
with ``semantic_vad`` at eagerness auto (``turn_detection`` in each result).

``--beside long`` keeps a 20-minute upload of continuous read speech (~28 s windows,
loadtest/stall.py) in flight, posted again when it ends. ``--turns long``: only the read speech of
5-15 s (issue 48: LibriSpeech, LJ Speech, LibriVox; 19 clips), in each stream's seeded order.
Streams, pacing and scores: loadtest/lib/live_common.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib.live_batch import (
    batch_stream_wer,
    batch_texts,
    batch_turn_texts,
    batch_wer,
    turns_uploaded,
)
from loadtest.lib.live_common import (
    Done,
    Outcome,
    Stream,
    build_stream,
    finalise,
    live_clips,
    loadavg,
    paced,
    score,
    turns_over,
    wer_by_set,
    wer_by_turns,
)


def session_config(silence_ms: int = 500, eagerness: str | None = None) -> dict[str, Any]:
    """The ``session.update`` a bench session sends: OpenAI's server VAD defaults but the
    pause that ends a turn (``--silence-ms``), or ``semantic_vad`` at ``--eagerness``."""
    td: dict[str, Any] = {"type": "semantic_vad", "eagerness": eagerness} if eagerness else {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
        "silence_duration_ms": silence_ms}
    return {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000},
        "transcription": {"model": "whisper-base", "language": "en"}, "turn_detection": td}}}


SESSION = session_config()
LONG_TURN_SETS = ("librispeech", "ljspeech", "librivox")  # issue 48: long read-speech turns


def to_pcm24(audio16: np.ndarray) -> bytes:
    """16 kHz float32 to the 24 kHz PCM16 an OpenAI client sends (FFmpeg's resampler)."""
    import av

    from app.live.audio import encode_pcm16

    r = av.AudioResampler(format="flt", layout="mono", rate=24_000)
    frame = av.AudioFrame.from_ndarray(audio16.astype(np.float32)[None], format="flt",
                                       layout="mono")
    frame.sample_rate = 16_000
    out = [f.to_ndarray().reshape(-1) for f in [*r.resample(frame), *r.resample(None)]]
    return encode_pcm16(np.concatenate(out))


class Items:
    """One session's items as its events describe them."""

    def __init__(self) -> None:
        self.span: dict[str, list[float | None]] = {}  # item -> [start_s, end_s]
        self.deltas: dict[str, str] = {}
        self.done: dict[str, str] = {}  # item -> transcript, in completion order
        self.spans: list[Done] = []  # each completed item's span and arrival, in that order
        self.broken = 0  # items whose deltas did not join to their transcript

    def on(self, e: dict[str, Any], out: Outcome, stream: Stream, now: float) -> None:
        kind, item = e["type"], e.get("item_id", "")
        if kind == "input_audio_buffer.speech_started":
            self.span[item] = [e["audio_start_ms"] / 1000, None]
        elif kind == "input_audio_buffer.speech_stopped":
            self.span.setdefault(item, [None, None])[1] = e["audio_end_ms"] / 1000
        elif kind.endswith("input_audio_transcription.delta"):
            self.deltas[item] = self.deltas.get(item, "") + (e.get("delta") or "")
            start, end = self.span.get(item, [None, None])
            for k, u in enumerate(stream.utterances):
                if start is not None and start < u.end_s and (end is None or end > u.start_s) \
                        and now < out.t0 + u.spoken_at:
                    out.interim_before_end.add(k)
        elif kind.endswith("input_audio_transcription.completed"):
            self.done[item] = e["transcript"]
            self.broken += self.deltas.get(item, "") != e["transcript"]
            start, end = self.span.get(item, [None, None])
            if start is not None:
                self.spans.append((start, end, now))
        elif kind.endswith("input_audio_transcription.failed") or kind == "error":
            out.errors.append(json.dumps(e.get("error"))[:200])


async def one_session(url: str, stream: Stream, headers: dict[str, str], drain_s: float,
                      tolerance: float, delay_s: float = 0.0,
                      config: dict[str, Any] | None = None) -> tuple[Outcome, Items]:
    import base64

    import websockets

    await asyncio.sleep(delay_s)
    out, items = Outcome(), Items()
    pcm = to_pcm24(np.concatenate([stream.audio, np.zeros(int(drain_s * 16_000), np.float32)]))
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            out.errors.append(f"first event {created.get('type')}")
            return out, items
        await ws.send(json.dumps({"type": "session.update", "session": config or SESSION}))

        async def read() -> None:
            async for raw in ws:
                items.on(json.loads(raw), out, stream, time.monotonic())

        reader = asyncio.create_task(read())
        out.t0 = time.monotonic()
        step = 4800  # bytes of 24 kHz PCM16 per 100 ms

        async def send(k: int) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio":
                                      base64.b64encode(pcm[k * step:(k + 1) * step]).decode()}))

        try:
            await paced(-(-len(pcm) // step), send, out.t0)
        except websockets.ConnectionClosed as exc:
            out.errors.append(f"closed: {exc}")
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    finalise(out, stream, items.spans, tolerance)
    out.text = " ".join(t.strip() for t in items.done.values() if t.strip())
    out.spans = [(sp[0], sp[1], text) for i, text in items.done.items()
                 if (sp := items.span.get(i)) is not None and sp[0] is not None]
    out.turns = turns_over(stream.utterances, out.spans)
    return out, items


async def run_sessions(url: str, streams: list[Stream], headers: dict[str, str] | None = None,
                       drain_s: float = 5.0, tolerance: float = 0.5,
                       config: dict[str, Any] | None = None) -> dict[str, Any]:
    got = await asyncio.gather(*(one_session(url, s, headers or {}, drain_s, tolerance, 0.2 * k,
                                             config) for k, s in enumerate(streams)))
    outcomes = [o for o, _ in got]
    return {"streams": len(streams), **score(streams, outcomes),
            "deltas_not_joining": sum(i.broken for _, i in got),
            "items_completed": sum(len(i.done) for _, i in got),
            "texts": [o.text for o in outcomes], "outcomes": outcomes}


async def keep_long(base_url: str, stop: asyncio.Event, minutes: float, work: Path,
                    kind: str = "meeting") -> int:
    """A long upload (``kind``: see ``--upload``) always in flight until ``stop``; how many
    were posted."""
    from loadtest.lib.corpus import load_corpus
    from loadtest.lib.service import TERMINAL, Client, write_long_wav
    from loadtest.stall import write_meeting_wav

    path = work / "long.wav"
    write = write_meeting_wav if kind == "meeting" else write_long_wav
    await asyncio.to_thread(write, load_corpus(), path, minutes * 60)
    client = Client(base_url, [], "en")
    blob, posted = path.read_bytes(), 0
    try:
        while not stop.is_set():
            job = await client.submit(path.name, blob)
            posted += 1
            while (await client.job(job))["status"] not in TERMINAL:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                if stop.is_set():
                    await client.cancel(job)
                    break
    finally:
        await client.close()
    return posted


async def one_run(args: argparse.Namespace, base: str, ws_url: str, headers: dict[str, str],
                  streams: list[Stream], mode: str, work: Path) -> dict[str, Any]:
    """The ``streams`` as live sessions (``mode``: ``off`` for server VAD, else semantic_vad's
    eagerness), beside the long upload if asked."""
    stop = asyncio.Event()
    beside = (asyncio.create_task(keep_long(base, stop, args.long_minutes, work, args.upload))
              if args.beside == "long" else None)
    load = loadavg()
    r = await run_sessions(ws_url, streams, headers, args.drain, args.tolerance,
                           session_config(args.silence_ms, None if mode == "off" else mode))
    stop.set()
    r.update({"turn_detection": "server_vad" if mode == "off" else f"semantic_vad/{mode}",
              "load_before": load, "load_after": loadavg(), "beside": args.beside,
              "long_uploads_posted": await beside if beside else 0})
    return r


async def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from loadtest.lib.service import Server

    server = None
    base = args.url
    if base is None:
        # One key (none) for every stream: the per-key session cap (16 by default) would refuse
        # the streams past it, and they would read as "not heard".
        most = max(int(x) for x in args.streams.split(","))
        env = {"BATCHSCRIBE_MODEL__NAME": args.model,
               "BATCHSCRIBE_LIVE__MAX_SESSIONS_PER_KEY": str(max(16, most)),
               "BATCHSCRIBE_LIVE__MAX_SESSIONS": str(max(32, most))}
        if args.trace:  # every engine call and submit, stamped (loadtest/lib/batch_trace.py)
            env["BATCHSCRIBE_BATCH_TRACE"] = str(args.trace.resolve())
        entry = ["-m", "loadtest.lib.batch_trace" if args.trace else "app"]
        server = Server(work / "server", env=env, argv=entry).start()
        base = server.url
    ws_url = base.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    clips = live_clips()
    if args.turns == "long":  # read speech of 5-15 s: a turn long enough for interim text
        clips = [c for c in clips if c.set in LONG_TURN_SETS and 5.0 <= c.duration_s <= 15.0]
    cache: dict[str, np.ndarray] = {}
    results = []
    try:
        modes = (args.eagerness or "off").split(",")  # side by side at each N, in turn
        for n in (int(x) for x in args.streams.split(",")):
            streams = [build_stream(clips, args.seconds, args.seed + k, cache=cache)
                       for k in range(n)]
            uploaded: dict[str, Any] = {}  # the same streams' batch reads, for every mode
            for mode in modes:
                r = await one_run(args, base, ws_url, headers, streams, mode, work)
                outcomes = r.pop("outcomes")
                if args.batch_wer:
                    if not uploaded:
                        uploaded["texts"] = texts = await batch_texts(base, streams)
                        uploaded["stream"] = await batch_stream_wer(base, streams, work)
                    texts = uploaded["texts"]
                    r["batch_wer_percent"] = batch_wer(streams, texts)
                    r["wer_by_turns"] = wer_by_turns(streams, outcomes, texts)
                    r["wer_by_set"] = wer_by_set(streams, outcomes, texts,
                                                 {c.id: c.set for c in clips})
                    r["batch_stream_wer_percent"] = uploaded["stream"]
                    per_turn = await batch_turn_texts(base, streams, outcomes, work)
                    r["turns_uploaded"] = turns_uploaded(streams, outcomes, per_turn, texts)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "texts"}), flush=True)
    finally:
        if server is not None:
            server.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running service (default: start one)")
    ap.add_argument("--api-key")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--seconds", type=float, default=60.0, help="speech per stream (about)")
    ap.add_argument("--drain", type=float, default=5.0, help="silence sent after the audio")
    ap.add_argument("--tolerance", type=float, default=0.5)
    ap.add_argument("--beside", choices=("none", "long"), default="none")
    ap.add_argument("--long-minutes", type=float, default=20.0)
    ap.add_argument("--upload", choices=("meeting", "clips"), default="meeting",
                    help="--beside long: continuous read speech, or corpus clips with gaps")
    ap.add_argument("--turns", choices=("all", "long"), default="all",
                    help="utterances: corpus clips of 1-15 s, or read speech of 5-15 s")
    ap.add_argument("--batch-wer", action="store_true")
    ap.add_argument("--silence-ms", type=int, default=500,
                    help="server VAD's silence_duration_ms (OpenAI's default 500)")
    ap.add_argument("--eagerness", help="semantic_vad turns at these eagerness levels, each "
                    "N run once per level in turn: low, medium, high, auto, or off for server "
                    "VAD (default: off)")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--model", default="whisper-base")
    ap.add_argument("--trace", type=Path, help="the started service writes its batcher trace here "
                    "(one JSON line per engine call and submit; loadtest/lib/batch_trace.py)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from loadtest.lib.common import machine_info

    machine = machine_info()  # the tree as the run starts (a commit during the run is not it)
    # The service's settings given in the environment (the started service inherits them).
    settings = {k: v for k, v in sorted(os.environ.items())
                if k.startswith("BATCHSCRIBE_") and "KEY" not in k}
    with tempfile.TemporaryDirectory(prefix="live-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "commit": machine["git"], "clean_tree": machine["git_clean"], "machine": machine,
        "target": "the service's /v1/realtime route" if args.url is None else args.url,
        "args": {k: str(v) for k, v in vars(args).items() if k != "api_key"},
        "settings_env": settings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
