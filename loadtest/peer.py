"""The peer, side by side: ``faster-whisper-server==0.0.3`` from PyPI under the bench's workload.

    bash loadtest/peer_setup.sh     # once: .venv-peer (python -m loadtest.peer runs it too)
    .venv/bin/python -m loadtest.peer --clients 32 --duration 60 --out /tmp/peer.json

The peer (github andyjjrt/faster-whisper-server) is a FastAPI app around faster-whisper. What
0.0.3 offers, from its source (cli.py, models.py, api.py):

* ``faster-whisper-server MODEL`` (one model, WhisperModel defaults: device auto, compute type
  "default", cpu_threads 0) or ``--config FILE.yaml`` (named models, each with ``path``,
  ``batch_size``, and ``model_options`` passed to ``WhisperModel(path, **model_options)``). Only
  the YAML way sets compute_type and cpu_threads, so this runs it: one model named
  ``whisper-base`` whose ``path`` is the service's own local CTranslate2 folder (faster-whisper
  loads a local path as is: no hub, and HF_HUB_OFFLINE=1 besides). In that mode a request must
  name the model in the form field ``model_name`` (not OpenAI's ``model``; both are sent).
* ``--workers N``: N uvicorn processes, each loading its own model on its first request. Its
  handler is an ``async def`` that runs ``transcribe`` inline, blocking its event loop, so one
  process transcribes one request at a time: WhisperModel's ``num_workers`` cannot help, and
  concurrency comes only from ``--workers``. The 2-core layouts are thus 1 process x 2 CPU
  threads or 2 processes x 1 thread (``--peer-layout 1x2`` / ``2x1``).
* ``batch_size`` > 1: faster-whisper's BatchedInferencePipeline (Silero VAD, then the speech
  chunks of ONE request decoded as a batch); 1 is the plain sequential ``transcribe``.

* ``transcribe_options`` in the YAML: keyword arguments of every ``transcribe`` call.

Decoding options (``--peer-decode``): ``defaults``, the peer's own (beam 5, timestamps, fallback,
no VAD at batch 1, language detected), what its users get; ``service``, the service's decode
settings as ``transcribe_options`` (loadtest/offline.py ``SERVICE_KW``: greedy, no timestamp
tokens, no fallback, Silero VAD), the matched comparison. int8 and the thread layout are
deployment settings, set at their fastest (``--peer-layout``'s default; see DEFAULT_LAYOUT).

Measured exactly as the bench measures the service (loadtest.lib.service.closed_loop): ``--clients``
closed-loop clients replay the clips in the bench's order, ``--warmup`` s unmeasured then
``--duration`` s; throughput is audio seconds of the requests that finished inside the window
over its length. Also: short-clip (<= 10 s) latency of those requests, errors by kind, the CPU
the server's processes used in the window, their peak RSS (VmHWM, summed over the processes)
and the WER (loadtest.lib.stats) of the transcripts it returned (each clip's first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.lib.common import (
    ROOT,
    child_env,
    free_port,
    machine_info,
    parse_layout,
    proc_status_kb,
    resolve_model,
    wait_up,
)
from loadtest.lib.corpus import SHORT_CLIP_S, Clip, load_corpus, select_clips
from loadtest.lib.probes import cpu_seconds
from loadtest.lib.report import error_kinds, log
from loadtest.lib.service import Client, Result, closed_loop
from loadtest.lib.stats import latency_summary, wer_by_group

PEER_VENV = ROOT / ".venv-peer"
PEER_SETUP = ROOT / "loadtest" / "peer_setup.sh"
PEER_PACKAGE = "faster-whisper-server==0.0.3"
MODEL_NAME = "whisper-base"  # the name the peer's YAML gives the model; requests must send it
# "processes x cpu_threads". 2x1 won on the 2-core VM (whisper-base int8, tcmalloc, 4 clients,
# 20 clips, 5 s + 30 s, twice each, alternating, with a test suite running beside it):
# 2x1 3.32x and 3.03x realtime, short p50 6.0/3.9 s; 1x2 2.57x and 2.57x, short p50 6.0/5.4 s.
# One request at a time, CTranslate2's second thread adds little to beam-5 decoding of one
# clip; two processes each keep a core busy. The cost: two models, ~1.37 GB peak RSS vs ~0.69.
DEFAULT_LAYOUT = "2x1"
# Keys of closed_loop's result that only the service's /metrics fills in.
_SERVICE_ONLY = ("batch_size", "batch_fill", "queue_wait", "batch_duration", "engine_audio_s", "cpu")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-layout", default=DEFAULT_LAYOUT,
                   help="peer: uvicorn processes x CPU threads each (1x2 or 2x1 on 2 cores)")
    p.add_argument("--peer-compute-type", default="int8", help="peer: WhisperModel compute_type")
    p.add_argument("--peer-batch-size", type=int, default=1,
                   help="peer: > 1 uses faster-whisper's BatchedInferencePipeline per request")
    p.add_argument("--peer-decode", default="defaults,service",
                   help="peer: decode settings, one run each: defaults (its own), service "
                        "(the service's: beam 1, no timestamps, VAD)")


def _opt(args: argparse.Namespace, name: str, default: Any) -> Any:
    """A peer option from ``args``, or its default when the caller (bench.py) has none."""
    return getattr(args, name, default)


def ensure_venv() -> Path:
    """.venv-peer, set up by loadtest/peer_setup.sh if it is not yet (idempotent)."""
    subprocess.run(["bash", str(PEER_SETUP)], check=True, stdout=subprocess.DEVNULL)
    return PEER_VENV / "bin" / "python"


# ---- the peer server --------------------------------------------------------------------------
@dataclass
class PeerServer:
    work: Path
    model_path: str
    processes: int = 1
    cpu_threads: int = 2
    compute_type: str = "int8"
    batch_size: int = 1
    tcmalloc: bool = True
    transcribe_options: dict[str, Any] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work / "peer.log"

    @property
    def config(self) -> dict[str, Any]:
        return {"models": [{
            "name": MODEL_NAME, "path": self.model_path, "batch_size": self.batch_size,
            "transcribe_options": self.transcribe_options,
            "model_options": {"device": "cpu", "compute_type": self.compute_type,
                              "cpu_threads": self.cpu_threads, "num_workers": 1,
                              "local_files_only": True}}]}

    def command(self, python: Path) -> list[str]:
        return [str(python), "-m", "faster_whisper_server", "--config",
                str(self.work / "peer.yaml"), "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", str(self.processes), "--log-level", "info"]

    def start(self, python: Path, timeout: float = 120.0) -> PeerServer:
        self.work.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: no yaml module needed on this side.
        (self.work / "peer.yaml").write_text(json.dumps(self.config, indent=1))
        env = child_env(self.tcmalloc)  # tcmalloc preloaded and HF_HUB_OFFLINE=1, as env.sh
        env.pop("PYTHONPATH", None)  # the peer's venv only, not this repo
        with self.log_path.open("ab") as f:
            f.write(("\n$ " + shlex.join(self.command(python)) + "\n").encode())
            self.proc = subprocess.Popen(self.command(python), cwd=self.work, env=env,
                                         stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        if wait_up(self.proc, self.url + "/health", timeout, "peer", self.log_tail):
            return self
        self.stop()
        raise RuntimeError(f"peer not up in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.is_file() else ""

    def pids(self) -> list[int]:
        """The server process and its descendants (uvicorn's workers with --workers > 1)."""
        if self.proc is None:
            return []
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            with contextlib.suppress(OSError, ValueError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return out

    def peak_rss(self) -> dict[str, Any]:
        per = {pid: proc_status_kb(pid, "VmHWM") for pid in self.pids()}
        mb = {str(pid): round(kb / 1024, 1) for pid, kb in per.items() if kb}
        return {"peak_rss_mb": round(sum(mb.values()), 1), "peak_rss_mb_by_process": mb}

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids())

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # uvicorn's parent stops its workers
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: it and its workers
            self.proc.wait(30)


# ---- the client: loadtest.lib.service.Client on the OpenAI endpoint -------------------------------
class PeerClient(Client):
    """The bench's client (same uploads, same aiohttp session) posting to the peer's
    ``/v1/audio/transcriptions``; the peer has no /metrics, so those are empty.

    Every request on a new connection: a kept-alive connection stays with the uvicorn process
    that accepted it, and one process takes all of them while the other is still starting (seen
    with ``--workers 2``: one process served every request). Fresh connections are accepted by
    whichever process is free (a busy one's event loop is blocked in ``transcribe``), the best
    the peer's layout can do; a loopback connect costs far less than the requests."""

    def __init__(self, url: str, clips: list[Clip], timeout: float = 900.0) -> None:
        super().__init__(url, clips, None, timeout,
                         {"model": MODEL_NAME, "model_name": MODEL_NAME, "response_format": "json"})

    async def transcribe(self, clip: Clip) -> Result:
        form = self._form(clip.path.name, self.blobs[clip.id])
        sent = time.monotonic()
        try:
            async with self.http.post("/v1/audio/transcriptions", data=form,
                                      headers={"Connection": "close"}) as r:
                body = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Result(clip, sent, time.monotonic(), 0, error=f"{type(exc).__name__}: {exc}")
        done = time.monotonic()
        if status != 200:
            return Result(clip, sent, done, status, error=f"HTTP {status}: {body[:300]}")
        try:
            text = json.loads(body)["text"]
        except (ValueError, KeyError, TypeError):
            return Result(clip, sent, done, status, error=f"bad body: {body[:300]}")
        return Result(clip, sent, done, 200, text=text)

    async def metrics(self) -> dict[tuple[str, str], float]:
        return {}


# ---- the phase --------------------------------------------------------------------------------
async def _cpu_in_window(server: PeerServer, t_start: float, t_stop: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t_start - time.monotonic()))
    c0 = server.cpu_seconds()
    await asyncio.sleep(max(0.0, t_stop - time.monotonic()))
    return {"process_cores": round((server.cpu_seconds() - c0) / (t_stop - t_start), 3)}


def decode_options(name: str) -> dict[str, Any]:
    """``--peer-decode``'s ``transcribe_options``: the peer's defaults, or the service's."""
    from loadtest.offline import SERVICE_KW

    if name not in ("defaults", "service"):
        raise SystemExit(f"--peer-decode: defaults or service, not {name!r}")
    return {} if name == "defaults" else dict(SERVICE_KW)


async def phase(args: argparse.Namespace, work: Path, clips: list[Clip],
                decode: str = "defaults") -> dict[str, Any]:
    """Start the peer, run the bench's closed loop on it (``args.clients``, ``args.warmup``,
    ``args.duration``), stop it. Peer options come from :func:`add_arguments` if ``args`` has
    them, else their defaults; ``decode`` names the decode settings (:func:`decode_options`)."""
    engines, processes, threads = parse_layout(_opt(args, "peer_layout", DEFAULT_LAYOUT))
    if engines != 1:
        raise SystemExit("--peer-layout is PROCESSES x THREADS, e.g. 1x2 or 2x1")
    python = await asyncio.to_thread(ensure_venv)
    server = PeerServer(work / f"peer-{decode}", resolve_model(_opt(args, "model", "whisper-base")),
                        processes=processes, cpu_threads=threads,
                        compute_type=_opt(args, "peer_compute_type", "int8"),
                        batch_size=_opt(args, "peer_batch_size", 1),
                        tcmalloc=not _opt(args, "no_tcmalloc", False),
                        transcribe_options=decode_options(decode))
    settings = {"package": PEER_PACKAGE, "layout": f"{processes}x{threads}", "decode": decode,
                "processes": processes, "cpu_threads": threads, **server.config["models"][0]}
    log(f"peer: starting {PEER_PACKAGE} ({processes} process(es) x {threads} thread(s), "
        f"{server.compute_type}, batch_size {server.batch_size}, decode settings: {decode})")
    await asyncio.to_thread(server.start, python)
    out: dict[str, Any] = {"settings": settings, "command": shlex.join(server.command(python)),
                           "log": str(server.log_path), "idle_rss": server.peak_rss()}
    client = PeerClient(server.url, clips)
    try:
        # The model loads on a process's first request: one per process, not timed (uvicorn
        # spreads connections; the warm-up of the closed loop covers any it missed).
        short = sorted((c for c in clips if c.duration_s <= SHORT_CLIP_S), key=lambda c: c.id)
        warm = await asyncio.gather(*(client.transcribe(c) for c in (short or clips)[:processes]))
        out["first_requests"] = {"errors": error_kinds(warm),
                                 "latency_s": [round(r.latency, 3) for r in warm]}
        log(f"peer: {args.clients} clients, {args.warmup:.0f}s warm-up + {args.duration:.0f}s")
        t0 = time.monotonic()
        t_start, t_stop = t0 + args.warmup, t0 + args.warmup + args.duration
        load, cpu = await asyncio.gather(
            closed_loop(client, clips, args.clients, args.warmup, args.duration),
            _cpu_in_window(server, t_start, t_stop))
        results: list[Result] = load.pop("_results")
        counted: list[Result] = load.pop("_counted")
        for k in _SERVICE_ONLY:
            load.pop(k, None)
        load["cpu"] = cpu
        load["latency_short"] = latency_summary(
            [r.latency for r in counted if r.clip.duration_s <= SHORT_CLIP_S])
        load["errors_by_kind"] = _errors_by_kind(results)
        out["load"] = load
        out.update(server.peak_rss())
        texts: dict[str, str] = {}
        for r in results:
            if r.ok and r.text is not None:
                texts.setdefault(r.clip.id, r.text)
        out["wer"] = wer_by_group(clips, texts)
        out["wer"]["clips_transcribed"] = f"{len(texts)} of {len(clips)}"
        out["texts"] = texts
        log(f"  {load['throughput_x']}x realtime, short p50 {load['latency_short']['p50_s']}s "
            f"p95 {load['latency_short']['p95_s']}s, {load['requests_failed']} failed, "
            f"peak RSS {out['peak_rss_mb']} MB, WER {out['wer']['all']['wer_percent']}% "
            f"({len(texts)} clips)")
    finally:
        await client.close()
        await asyncio.to_thread(server.stop)
    return out


RESULT_KEYS = {"defaults": "peer", "service": "peer_matched"}  # the results' key per decode


async def phases(args: argparse.Namespace, work: Path, clips: list[Clip]) -> dict[str, Any]:
    """:func:`phase` once per ``--peer-decode`` setting, one after the other: the results under
    ``peer`` (its defaults) and ``peer_matched`` (the service's decode settings)."""
    out = {}
    for decode in filter(None, _opt(args, "peer_decode", "defaults").split(",")):
        decode_options(decode)  # a typo fails before the first run, not after it
    for decode in filter(None, _opt(args, "peer_decode", "defaults").split(",")):
        out[RESULT_KEYS[decode]] = await phase(args, work, clips, decode)
    return out


def _errors_by_kind(results: list[Result]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "").split(":", 1)[0] or f"HTTP {r.status}"
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="unmeasured seconds first")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--clips", type=int, default=None, help="use a spread subset of N clips")
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="default: /tmp/batchscribe-peer-*")
    p.add_argument("--out", type=Path, default=None)
    add_arguments(p)
    args = p.parse_args(argv)
    clips = select_clips(load_corpus(args.corpus) if args.corpus else load_corpus(), args.clips)
    work = args.workdir or Path(f"/tmp/batchscribe-peer-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "meta": {"command": "python -m loadtest.peer " + shlex.join(
                     sys.argv[1:] if argv is None else argv),
                 "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                 "machine": machine_info(), "workdir": str(work),
                 "corpus": {"clips": len(clips),
                            "audio_s": round(sum(c.duration_s for c in clips), 3)}},
    }
    res.update(asyncio.run(phases(args, work, clips)))
    res["meta"]["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    texts = {k: res[k].pop("texts") for k in RESULT_KEYS.values() if k in res}
    text = json.dumps(res, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".texts.json").write_text(json.dumps(texts, indent=1,
                                                                  ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
