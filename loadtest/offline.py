"""In-process measurements, each run in its own subprocess by bench.py and sweep.py.

``baselines``: faster-whisper called one request at a time (what the existing servers do):
  (a) at the service's decode settings, (b) at faster-whisper's defaults, (c) two requests in
  flight on ``num_workers=2`` with one thread each. Each replays the corpus in the fixed order for
  a fixed time and counts audio seconds of finished requests over wall seconds.
``engine``: the service's own windows (decode + Silero VAD + cut, via app.audio) fed straight to
  app.engine.whisper.WhisperEngine at given batch sizes, ``engines`` x ``workers`` batches in flight: the
  upper bound the service can approach, with no HTTP, job store or batcher.

Usage (normally called by bench.py / sweep.py, which pass ``--out``):
  python -m loadtest.offline baselines --clips clips.json --model DIR --duration 60 --out b.json
  python -m loadtest.offline engine --clips clips.json --model DIR --workers 2 --threads 1 \
      --batches 4,8,16 --out e.json
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.lib.common import ClipWindow, RssSampler, allocator, cpu_count, cut_corpus, join_texts, now
from loadtest.lib.corpus import READ_SPEECH, SHORT_CLIP_S, Clip, audio_total, read_clips, replay_order
from loadtest.lib.stats import latency_summary

# The service's decode settings, expressed as faster-whisper transcribe() arguments: greedy,
# no timestamp tokens, no temperature fallback, windows independent, the same Silero VAD options.
SERVICE_KW: dict[str, Any] = {
    "beam_size": 1, "temperature": 0.0, "without_timestamps": True,
    "condition_on_previous_text": False, "vad_filter": True,
    "vad_parameters": {"threshold": 0.5, "max_speech_duration_s": 30.0,
                       "min_silence_duration_ms": 160},
}
DEFAULT_KW: dict[str, Any] = {}  # faster-whisper's defaults: beam 5, timestamps, fallback, no VAD


# ---- baselines --------------------------------------------------------------------------------
class Replay:
    """Thread-safe cycling iterator over the fixed replay order."""

    def __init__(self, clips: Sequence[Clip]) -> None:
        self._order = replay_order(clips)
        self._i = 0
        self._lock = threading.Lock()

    def next(self) -> Clip:
        with self._lock:
            c = self._order[self._i % len(self._order)]
            self._i += 1
            return c


def transcribe_fw(model: Any, clip: Clip, language: str | None, kw: dict[str, Any]) -> str:
    segments, _ = model.transcribe(str(clip.path), language=language, **kw)
    return " ".join(s.text.strip() for s in segments).strip()  # the generator does the work


def timed_replay(fn: Callable[[Clip], str], clips: Sequence[Clip], duration_s: float,
                 in_flight: int, sampler: RssSampler) -> dict[str, Any]:
    """``in_flight`` threads replay the corpus until ``duration_s``; finished requests count."""
    fn(replay_order(clips)[0])  # warm-up (allocator pools, VAD session), not timed
    replay = Replay(clips)
    done: list[tuple[Clip, float, float]] = []  # clip, start, end (relative)
    lock = threading.Lock()
    sampler.reset()
    t0 = now()

    def worker() -> None:
        while now() - t0 < duration_s:
            c = replay.next()
            s = now() - t0
            fn(c)
            with lock:
                done.append((c, s, now() - t0))

    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(e for _, _, e in done)
    audio = sum(c.duration_s for c, _, _ in done)
    short = [e - s for c, s, e in done if c.duration_s <= SHORT_CLIP_S]
    return {"throughput_x": round(audio / wall, 3), "audio_s": round(audio, 3),
            "wall_s": round(wall, 3), "requests": len(done), "in_flight": in_flight,
            "short_clip_latency": latency_summary(short), "peak_rss_mb": sampler.peak_mb}


def cmd_baselines(args: argparse.Namespace) -> dict[str, Any]:
    from faster_whisper import WhisperModel

    clips = read_clips(Path(args.clips))
    wer_clips = [c for c in clips if c.set in READ_SPEECH]
    lang = args.language or None
    cores = cpu_count()
    modes = set(args.modes.split(","))
    out: dict[str, Any] = {"allocator": allocator(), "language": lang, "modes": {}}
    with RssSampler() as sampler:
        if modes & {"a", "b"}:
            seq = WhisperModel(args.model, device="cpu", compute_type=args.compute_type,
                               cpu_threads=cores, num_workers=1)
            if "a" in modes:
                r = timed_replay(lambda c: transcribe_fw(seq, c, lang, SERVICE_KW), clips,
                                 args.duration, 1, sampler)
                # Untimed: the sequential transcripts the service's WER is compared with.
                r["texts"] = {c.id: transcribe_fw(seq, c, lang, SERVICE_KW) for c in clips}
                out["modes"]["a"] = {
                    "label": "faster-whisper, one at a time, service settings "
                             f"(beam 1, no timestamps, VAD), {cores} threads",
                    "settings": {**SERVICE_KW, "cpu_threads": cores, "num_workers": 1}, **r}
            if "b" in modes:
                r = timed_replay(lambda c: transcribe_fw(seq, c, lang, DEFAULT_KW), clips,
                                 args.duration, 1, sampler)
                if args.wer_defaults:
                    r["texts"] = {c.id: transcribe_fw(seq, c, lang, DEFAULT_KW) for c in wer_clips}
                out["modes"]["b"] = {
                    "label": "faster-whisper, one at a time, its defaults "
                             f"(beam 5, timestamps, fallback), {cores} threads",
                    "settings": {**DEFAULT_KW, "cpu_threads": cores, "num_workers": 1}, **r}
            del seq
        if "c" in modes:
            par = WhisperModel(args.model, device="cpu", compute_type=args.compute_type,
                               cpu_threads=1, num_workers=2)
            r = timed_replay(lambda c: transcribe_fw(par, c, lang, SERVICE_KW), clips,
                             args.duration, 2, sampler)
            out["modes"]["c"] = {
                "label": "faster-whisper, num_workers=2 x 1 thread, 2 requests in flight, "
                         "service settings",
                "settings": {**SERVICE_KW, "cpu_threads": 1, "num_workers": 2}, **r}
            del par
    return out


# ---- engine limit -----------------------------------------------------------------------------
def make_batches(windows: Sequence[ClipWindow], batch: int, order: str) -> list[list[ClipWindow]]:
    """``sorted``: longest first, so a batch holds similar lengths (what the batcher's buckets do)."""
    ws = sorted(windows, key=lambda w: -w.window.duration) if order == "sorted" else list(windows)
    return [ws[i:i + batch] for i in range(0, len(ws), batch)]


def cmd_engine(args: argparse.Namespace) -> dict[str, Any]:
    from app.config import ModelSettings
    from app.engine.heap import HeapTrim
    from app.engine.whisper import WhisperEngine
    from app.windows import DecodeOptions, LanguageChoice, Prompt

    clips = read_clips(Path(args.clips))
    corpus_audio = audio_total(clips)
    windows = cut_corpus(clips, Path(args.cache) if args.cache else None)
    if args.repeat > 1:  # copies of the same uploads (gpu-check's saturate step: one cut)
        windows = [ClipWindow(f"{cw.clip_id}#{r}", cw.index, replace(cw.window))
                   for r in range(args.repeat) for cw in windows]
        corpus_audio *= args.repeat
    window_audio = sum(w.window.duration for w in windows)
    opts = DecodeOptions(beam_size=args.beam_size)
    settings = ModelSettings(device=args.device, compute_type=args.compute_type,
                             num_workers=args.workers, cpu_threads=args.threads,
                             time_axis=args.time_axis)

    def set_prompts() -> None:
        """The given language, else one detection per clip (a fresh choice every pass)."""
        choices: dict[str, LanguageChoice] = {}
        for cw in windows:
            cw.window.prompt = (Prompt(language=args.language) if args.language else
                                Prompt(choice=choices.setdefault(cw.clip_id, LanguageChoice())))
    out: dict[str, Any] = {"allocator": allocator(), "engines": args.engines,
                           "workers": args.workers, "threads": args.threads, "order": args.order,
                           "windows": len(windows), "window_audio_s": round(window_audio, 3),
                           "corpus_audio_s": round(corpus_audio, 3), "runs": []}
    slots = args.engines * args.workers  # batches in flight
    with RssSampler() as sampler:
        engines = [WhisperEngine(args.model, settings, "bench") for _ in range(args.engines)]
        out["rss_model_loaded_mb"] = sampler.peak_mb
        # One token per worker thread of every engine: a batch runs on whichever engine has a
        # free thread (what app.engine.placement's least-loaded pool does on CPU).
        free: queue.Queue[Any] = queue.Queue()
        for eng in engines:
            for _ in range(args.workers):
                free.put(eng)

        trim = (HeapTrim(args.heap_release_mb << 20, args.heap_release_every_s)
                if args.heap_release_mb else None)

        def run(batch: list[ClipWindow]) -> list[str]:
            eng = free.get()
            try:
                return [r.text for r in eng.transcribe_batch([w.window for w in batch], opts)]
            finally:
                if trim is not None:
                    trim()
                free.put(eng)

        for b in sorted(int(x) for x in args.batches.split(",")):
            batches = make_batches(windows, b, args.order)
            with ThreadPoolExecutor(slots) as pool:
                set_prompts()
                list(pool.map(run, batches[:slots]))  # warm-up at this batch size
                sampler.reset()
                passes, t0 = 0, now()
                while True:
                    set_prompts()
                    texts = [t for ts in pool.map(run, batches) for t in ts]
                    passes += 1
                    if now() - t0 >= args.min_seconds:
                        break
                wall = now() - t0
            flat = [w for bt in batches for w in bt]
            run_out: dict[str, Any] = {
                "batch": b, "passes": passes, "wall_s": round(wall, 3),
                "throughput_x": round(passes * corpus_audio / wall, 3),
                "window_throughput_x": round(passes * window_audio / wall, 3),
                "peak_rss_mb": sampler.peak_mb,
            }
            if trim is not None:
                run_out["heap_releases"] = trim.released
            if args.texts:
                run_out["texts"] = join_texts(flat, texts)
            out["runs"].append(run_out)
            print(json.dumps({k: v for k, v in run_out.items() if k != "texts"}), flush=True)
        if args.sequential_texts:  # untimed: every window alone, the same-windows reference
            set_prompts()
            with ThreadPoolExecutor(slots) as pool:
                texts = [t for ts in pool.map(run, [[w] for w in windows]) for t in ts]
            out["sequential"] = {"batch": 1, "texts": join_texts(windows, texts)}
        for eng in engines:
            eng.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("baselines", "engine"):
        s = sub.add_parser(name)
        s.add_argument("--clips", required=True, help="JSON list of clips (common.save_clips)")
        s.add_argument("--model", required=True, help="CTranslate2 Whisper model folder")
        s.add_argument("--language", default="en", help="'' to detect")
        s.add_argument("--compute-type", default="int8")
        s.add_argument("--out", required=True)
    b = sub.choices["baselines"]
    b.add_argument("--duration", type=float, default=60.0, help="seconds per timed baseline")
    b.add_argument("--modes", default="a,b,c")
    b.add_argument("--wer-defaults", action="store_true",
                   help="also transcribe the read-speech clips at faster-whisper's defaults")
    e = sub.choices["engine"]
    e.add_argument("--engines", type=int, default=1, help="resident model copies")
    e.add_argument("--device", default="cpu", help="cpu or cuda (scripts/gpu-check)")
    e.add_argument("--workers", type=int, default=2, help="CTranslate2 workers per engine")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--batches", default="8,16")
    e.add_argument("--beam-size", type=int, default=1)
    e.add_argument("--order", choices=("sorted", "corpus"), default="sorted")
    e.add_argument("--time-axis", choices=("dynamic", "full"), default="dynamic")
    e.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat whole passes over the windows until this long")
    e.add_argument("--cache", default="", help="folder for the cut-windows cache")
    e.add_argument("--repeat", type=int, default=1,
                   help="each clip's windows this many times (copies of one upload)")
    e.add_argument("--texts", action="store_true", help="keep per-clip transcripts (for WER)")
    e.add_argument("--heap-release-mb", type=int, default=0,
                   help="after each call, free heap above this goes back to the OS, as the "
                   "service's engine runner does (app/engine/heap.py); 0: never")
    e.add_argument("--heap-release-every-s", type=float, default=60.0,
                   help="at most one such release per this (0: after every call that leaves "
                   "that much free)")
    e.add_argument("--sequential-texts", action="store_true",
                   help="also transcribe every window alone (batch 1), untimed, for WER")
    args = p.parse_args(argv)
    result = cmd_baselines(args) if args.cmd == "baselines" else cmd_engine(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
