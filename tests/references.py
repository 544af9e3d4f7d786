"""Peer yardsticks kept between runs: what faster-whisper and whisperx themselves say on the
corpus, the references some accuracy tests hold the service to.

Computing them was a tenth of the suite's CPU: faster-whisper's own language detection on 119
clips took 142 CPU-s, whisperx one clip at a time on 31 read clips 61 CPU-s (each measured
alone on this 2-core host), on a suite that is CPU-bound. They change only with the peer's
version, the model's files, the clips and the CPU (int8 kernels differ between CPUs: see
tests/test_unsure.py). So each is kept in ``tests/references/<name>.json`` under a key of all
four, and:

* a run whose key matches recomputes a spread sample of ``spot`` items with the peer itself and
  must read the stored answers; any difference recomputes everything and stores it again;
* any other run (a new peer version, model, clip or CPU) computes everything and stores it.

Each file keeps one entry per CPU (``entries``, :func:`cpu_key`), so hosts of two kinds (say the
developers' machines and CI's) both find theirs; an entry for other versions, another model or
other clips is dropped when its host stores again. The service's side is always computed in
full; only the peer's side is kept. Delete the folder to recompute every reference.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
FOLDER = Path(__file__).resolve().parent / "references"


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


ISA = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
       "avx512_bf16", "amx_int8")


def cpu_key() -> str:
    """The CPU as its int8 kernels see it: the model name, its family, model and stepping, and
    the vector extensions CTranslate2 and torch dispatch on. The model name alone was too
    coarse: two "AMD EPYC" hosts (family 25 without AVX-512, and another) read 6 of 31 clips
    differently through whisperx, so a run on one recomputed the other's entry every time."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("cpu family", "model", "stepping", "flags") and k not in fields:
                fields[k] = v.strip()
    except OSError:
        return cpu_model()
    flags = set(fields.get("flags", "").split())
    isa = " ".join(f for f in ISA if f in flags)
    return (f"{cpu_model()} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}; {isa})")


def spread(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (all of them when ``n <= k``)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


def peer_reference(name: str, items: Sequence[tuple[str, Path]],
                   compute: Callable[[list[Path]], list[Any]], versions: dict[str, str],
                   model_dir: Path, spot: int = 4) -> list[Any]:
    """The peer's answer for each ``(id, path)`` item, in order (see the module doc).
    ``compute(paths)`` runs the peer on paths and returns one JSON-able answer per path."""
    key = {"versions": versions, "model": digest(model_dir / "manifest.json"), "cpu": cpu_key(),
           "items": {i: digest(p) for i, p in items}}
    path = FOLDER / f"{name}.json"
    stored: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    entries: list[dict[str, Any]] = stored.get("entries", [stored] if "key" in stored else [])
    # this CPU's entry, else one stored under its model name alone (before cpu_key): checked
    # by the same spot sample, so a host of another generation recomputes and stores its own
    legacy = {**key, "cpu": cpu_model()}
    mine = next((e for e in entries if e["key"] == key), None) \
        or next((e for e in entries if e["key"] == legacy), None)
    if mine is not None:
        answers = mine["answers"]
        picked = spread(len(items), spot)
        again = compute([items[k][1] for k in picked])
        if [answers[items[k][0]] for k in picked] == again:
            return [answers[i] for i, _ in items]
        log.warning("%s: the peer no longer reads %s as stored; recomputing every item", name,
                    [items[k][0] for k in picked])
    fresh = compute([p for _, p in items])
    current = {k: v for k, v in key.items() if k != "cpu"}
    kept = [e for e in entries if e["key"]["cpu"] != key["cpu"]
            and {k: v for k, v in e["key"].items() if k != "cpu"} == current]
    kept.append({"key": key, "answers": {i: a for (i, _), a in zip(items, fresh, strict=True)}})
    FOLDER.mkdir(exist_ok=True)
    path.write_text(json.dumps({"entries": sorted(kept, key=lambda e: e["key"]["cpu"])},
                               indent=1, ensure_ascii=False) + "\n")
    return fresh
