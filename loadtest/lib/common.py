"""Shared pieces of the benchmarks: engine layouts, memory, the environment and machine facts,
the corpus cut into windows, small I/O (the corpus itself is loadtest.lib.corpus; WER by set and
latency statistics loadtest.lib.stats).

Kept light on purpose: the orchestrating process (and the HTTP load client) imports this module
and must not pull in torch or CTranslate2, so it never competes with the server for memory or
thread pools. Model-side helpers import their heavy modules inside the function.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.lib.corpus import Clip

if TYPE_CHECKING:
    from app.windows import Window

ROOT = Path(__file__).resolve().parents[2]


# ---- engine layouts ---------------------------------------------------------------------------
def parse_layout(spec: str) -> tuple[int, int, int]:
    """``"2x1"`` -> (1 engine, 2 workers, 1 thread); ``"2e1x1"`` -> (2 engines, 1, 1)."""
    spec = spec.strip().lower()
    engines = 1
    if "e" in spec:
        e, spec = spec.split("e", 1)
        engines = int(e)
    w, t = spec.split("x")
    return engines, int(w), int(t)


def layout_name(engines: int, workers: int, threads: int) -> str:
    return (f"{engines} engines x " if engines > 1 else "") + \
        f"{workers} worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"


# ---- memory -----------------------------------------------------------------------------------
def proc_status_kb(pid: int | str, field: str) -> int | None:
    """A ``VmRSS``/``VmHWM``-style field of /proc/<pid>/status in kB (None if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """Samples a process's RSS in a daemon thread; ``peak_mb`` since the last ``reset``."""

    def __init__(self, pid: int | str = "self", interval_s: float = 0.05) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.is_set():
            kb = proc_status_kb(self.pid, "VmRSS")
            if kb is not None and kb > self._peak_kb:
                self._peak_kb = kb
            self._stop.wait(self.interval_s)

    def reset(self) -> None:
        self._peak_kb = proc_status_kb(self.pid, "VmRSS") or 0

    @property
    def peak_mb(self) -> float:
        kb = max(self._peak_kb, proc_status_kb(self.pid, "VmRSS") or 0)
        return round(kb / 1024, 1)


# ---- environment ------------------------------------------------------------------------------
def tcmalloc_path() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
    return found[0] if found else None


def child_env(tcmalloc: bool = True, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment scripts/env.sh sets: tcmalloc preloaded (or not), no model hub."""
    env = dict(os.environ)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "tcmalloc" not in p]
    lib = tcmalloc_path()
    if tcmalloc:
        if lib is None:
            print("warning: libtcmalloc_minimal.so.4 not found; running with glibc malloc",
                  file=sys.stderr)
        else:
            preload.insert(0, lib)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def allocator() -> str:
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def cpu_count() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem_gb = round(kb / 1024 / 1024, 1)
    except (OSError, IndexError, ValueError):
        pass
    versions: dict[str, str | None] = {}
    for pkg in ("ctranslate2", "faster-whisper", "whisperx", "torch", "onnxruntime"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": cpu, "cores": cpu_count(), "memory_gb": mem_gb, "kernel": platform.release(),
        "python": platform.python_version(), "versions": versions, "git": (rev := git_revision()),
        "git_clean": rev is not None and not rev.endswith("-dirty"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "tcmalloc": tcmalloc_path(),
    }


def git_revision() -> str | None:
    """``<short sha>`` or ``<short sha>-dirty``; on a lent GPU host, the revision
    ``loadtest.gpu.bundle pack`` recorded from the committed tree (the .git that travels there
    is the session's first checkout, not the tree that ran: seen on the H200 run)."""
    if os.environ.get("BATCHSCRIBE_GIT_REVISION"):
        return os.environ["BATCHSCRIBE_GIT_REVISION"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev, dirty = "", ""
    return (rev + ("-dirty" if dirty else "")) or None


def resolve_model(name: str) -> str:
    """The model folder the service would load for ``BATCHSCRIBE_MODEL__NAME=name``."""
    from app.config import Settings
    from models.registry import resolve

    m = Settings(model={"name": name}).model  # type: ignore[arg-type]
    return resolve(m.name, m.cache_dir, m.local_files_only)


def run_json_subprocess(args: list[str], env: dict[str, str], out: Path, log: Path,
                        timeout: float) -> dict[str, Any]:
    """Run ``python -m loadtest.offline ...`` to completion; its JSON result, or SystemExit."""
    cmd = [sys.executable, "-m", *args, "--out", str(out)]
    with log.open("ab") as f:
        f.write(("\n$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    if proc.returncode != 0 or not out.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"subprocess failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# ---- windows: decode + Silero VAD + cut, exactly as the service prepares an upload -------------
@dataclass
class ClipWindow:
    clip_id: str
    index: int  # position among its clip's windows
    window: Window


def cut_corpus(clips: Sequence[Clip], cache_dir: Path | None = None) -> list[ClipWindow]:
    """Every clip through app.audio (decode, Silero VAD, cut_windows); cached as .npz."""
    import numpy as np

    from app.audio import cut_windows, decode
    from app.audio.vad import SileroVad
    from app.windows import SAMPLE_RATE, Window

    key = hashlib.sha256(json.dumps([c.id for c in clips]).encode()).hexdigest()[:16]
    cache = cache_dir / f"windows-{key}.npz" if cache_dir else None
    if cache is not None and cache.is_file():
        data = np.load(cache)
        meta = json.loads(str(data["meta"]))
        audio = data["audio"]
        return [ClipWindow(m["clip"], m["index"],
                           Window(audio[m["off"]:m["off"] + m["len"]], m["start"], m["end"]))
                for m in meta]
    vad = SileroVad()
    out: list[ClipWindow] = []
    for c in clips:
        samples = decode(c.path, 4 * 3600.0)
        for k, w in enumerate(cut_windows(samples, vad.speech(samples))):
            out.append(ClipWindow(c.id, k, w))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        meta, off = [], 0
        for cw in out:
            n = len(cw.window.audio)
            meta.append({"clip": cw.clip_id, "index": cw.index, "off": off, "len": n,
                         "start": cw.window.start, "end": cw.window.end})
            off += n
        audio = (np.concatenate([cw.window.audio for cw in out]) if out
                 else np.zeros(0, np.float32))
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, audio=audio.astype(np.float32), meta=np.array(json.dumps(meta)))
        tmp.replace(cache)
    assert all(len(cw.window.audio) <= 30 * SAMPLE_RATE for cw in out)
    return out


def join_texts(windows: Sequence[ClipWindow], texts: Sequence[str]) -> dict[str, str]:
    """Per-clip transcript: its windows' texts in time order (as the service's result.text)."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for cw, t in zip(windows, texts, strict=True):
        parts.setdefault(cw.clip_id, []).append((cw.index, t.strip()))
    return {k: " ".join(t for _, t in sorted(v) if t) for k, v in parts.items()}


def wait_up(proc: subprocess.Popen[bytes], url: str, timeout: float, what: str,
            log_tail: Callable[[], str]) -> bool:
    """Poll ``url`` until it answers 200 (True), the process exits (RuntimeError with its log's
    tail) or ``timeout`` passes (False: the caller stops it and says so)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def now() -> float:
    return time.perf_counter()


def free_port() -> int:
    """A free loopback TCP port (for a server a benchmark or a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_wav16(path: Path, samples: Any, rate: int = 16_000) -> float:
    """Float samples in [-1, 1] as a mono 16-bit wav (standard library); returns seconds."""
    import wave

    import numpy as np

    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return len(pcm) / rate
