"""The Ray Data stage end to end: a local Ray started here (2 CPUs), the real model in its actors.

* The corpus (its shortest clip of every set: short reads, 26-60 s long recordings, L2 and
  spontaneous speech) as a NeMo manifest through ``batchscribe dataset --ray`` gives the rows
  today's dataset mode gives through a real service, field for field (the real-time factor
  aside); a broken file and a missing one fail alone, with their errors.

One local Ray (2 CPUs) is shared by every test, the CLI's subprocesses joining it by address;
the tests take short clips so the module stays near two minutes on a quiet machine.
* An actor SIGKILLed mid-run: Ray restarts it and retries its blocks; every row is in the output
  once and in exactly one part file. A rerun with ``--resume`` then transcribes nothing and
  leaves every part untouched.
* The CLI SIGKILLed mid-run on a running cluster, then ``--resume``: only the rows no part
  holds are transcribed; every row once.
* ``ray.data.read_binary_files`` rows (bytes) with word timestamps and no language (detected),
  and a diarized row, through the stage in a user's own pipeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from app.dataset.parts import PartStore
from app.dataset.plan import plan
from app.dataset.stage import Transcriber
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import COLD, ROOT, Server
from tests.test_speakers import CORPUS as DIARIZATION
from tests.test_speakers import SAMPLE, corpus_item
from tests.wer import wer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    """A local Ray whose workers run at the test process's priority. Ray starts its worker
    processes at nice 15 (its ``worker_niceness``), so on this 2-core host, beside two other
    pytest workers at nice 0, the stage's actor got a sliver of a core: the CLI kill/resume
    test took 22 s alone and 244-359 s in the suite. Its workers also inherit
    ``BATCHSCRIBE_MODEL__WARMUP=false`` from the raylet (set only while this init starts it):
    no claim here is about the warm-up, which cost each of the module's seven actors ~1.3 CPU-s."""
    import ray

    env = {"RAY_worker_niceness": "0", **COLD}  # read by the raylet this init starts
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def nemo_manifest(clips: list[Clip], path: Path, extra: list[dict[str, Any]] = ()) -> Path:  # type: ignore[assignment]
    with path.open("w") as f:
        for c in clips:
            f.write(json.dumps({"audio_filepath": str(c.path), "duration": c.duration_s,
                                "text": c.reference, "lang": "en", "id": c.id, "set": c.set}) + "\n")
        for row in extra:
            f.write(json.dumps(row) + "\n")
    return path


def read_out(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def broken_rows(tmp: Path) -> list[dict[str, Any]]:
    bad = tmp / "broken.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot audio at all" * 10)
    return [{"audio_filepath": str(bad), "text": "nothing", "id": "broken"},
            {"audio_filepath": str(tmp / "missing.flac"), "text": "nothing", "id": "missing"}]


@pytest.mark.timeout(900)
def test_cli_killed_then_resumed_skips_written_rows(clips: list[Clip], ray_local: Any,
                                                    tmp_path: Path) -> None:
    """The real CLI on a running Ray cluster (``--ray ADDRESS``: this module's local one),
    SIGKILLed with every process it started once some parts are written; the cluster ends
    that driver's actors, and ``--resume`` transcribes only the rows no part holds. (It ran on
    a local Ray of its own, started twice: with three pytest workers on 2 cores the two starts
    made it the suite's slowest test, 359 s against 66 s alone.) The actor outlives the
    driver's kill by the rows it was handed, ``calls x batch_rows`` (8 x 2 on a CPU node,
    app/dataset/plan.py), and writes them: with 12 rows, killed at 3 parts, all 12 were
    written once (CI). So 32 rows, killed at 2 parts: 4 written and at most 16 in flight."""
    subset = sorted(clips, key=lambda c: c.duration_s)[:32]
    manifest = nemo_manifest(subset, tmp_path / "m.jsonl")
    out = tmp_path / "out.jsonl"
    store = PartStore(out.with_name(out.name + ".parts"))
    address = ray_local.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "app.cli", "dataset", str(manifest), "-o", str(out),
           "--language", "en", "--no-progress", "--ray", address, "--batch-rows", "2"]
    log = (tmp_path / "first.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    try:
        while store.scan().parts < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        tree = [p for p, _ in descendants(proc.pid)]
        proc.kill()
        for pid in tree:  # Ray's processes, started by that CLI
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        proc.wait(30)
        log.close()
    first = store.scan()
    assert 0 < len(first.records) < len(subset)
    stamp = {p.name: p.stat().st_mtime_ns for p in store.root.glob("part-*")}
    p = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_out(out)
    assert Counter(r["id"] for r in rows) == Counter(c.id for c in subset)
    scan = store.scan()
    assert not scan.duplicates() and len(scan.done) == len(subset)
    assert {n: t for n, t in ((q.name, q.stat().st_mtime_ns) for q in store.root.glob("part-*"))
            if n in stamp} == stamp  # what the first run wrote was not written again
    s = json.loads(out.with_suffix(".summary.json").read_text())
    assert s["this_run"]["files"] == len(subset) - len(first.records)


def one_per_set(clips: list[Clip]) -> list[Clip]:
    """The shortest clip of every corpus set, in corpus order."""
    shortest: dict[str, Clip] = {}
    for c in clips:
        if c.set not in shortest or c.duration_s < shortest[c.set].duration_s:
            shortest[c.set] = c
    return [c for c in clips if shortest[c.set] is c]


def test_corpus_through_ray_equals_dataset_mode(clips: list[Clip], server: Server,
                                               ray_local: Any, tmp_path: Path) -> None:
    clips = one_per_set(clips)
    manifest = nemo_manifest(clips, tmp_path / "corpus.jsonl", broken_rows(tmp_path))
    http_out, ray_out = tmp_path / "http.jsonl", tmp_path / "ray.jsonl"
    p = subprocess.run([sys.executable, "-m", "app.cli", "dataset", str(manifest), "-o",
                        str(http_out), "--language", "en", "--no-progress", "--server", server.url],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stderr  # the two broken rows
    code = main(["dataset", str(manifest), "-o", str(ray_out), "--language", "en",
                 "--no-progress", "--ray"])
    assert code == 1
    http_rows = {r["id"]: r for r in read_out(http_out)}
    ray_rows = read_out(ray_out)
    assert [r["id"] for r in ray_rows] == [c.id for c in clips]  # input order, once each
    assert set(http_rows) == {c.id for c in clips}
    for r in ray_rows:  # the same transcript, language, score: every field but the speed
        h = http_rows[r["id"]]
        assert r["rtf"] > 0
        assert {k: v for k, v in r.items() if k != "rtf"} == {k: v for k, v in h.items()
                                                             if k != "rtf"}, r["id"]
    read = [r for r in ray_rows if r["set"] in READ_SPEECH]
    assert wer([r["text"] for r in read], [r["pred_text"] for r in read]) < 0.12
    s = json.loads((tmp_path / "ray.summary.json").read_text())
    h = json.loads((tmp_path / "http.summary.json").read_text())
    assert s["done"] == len(clips) and s["failed"] == 2 and s["scores"] == h["scores"]
    errors = {f["audio_filepath"].rsplit("/", 1)[-1]: f["error"] for f in s["failures"]}
    assert errors["broken.wav"].startswith("unsupported_media: not a decodable audio file")
    assert errors["missing.flac"].startswith("FileNotFoundError")
    assert s["ray"]["ids_in_two_parts"] == 0 and s["ray"]["plan"].startswith("1 actor(s) on cpu")


def descendants(root: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of every process below ``root``: only processes this test started."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            with contextlib.suppress(OSError):
                found.append((c, Path(f"/proc/{c}/cmdline").read_bytes()))
    return found


def actor_pids() -> list[int]:
    """This process's own Ray actors running the stage."""
    return [p for p, cmd in descendants(os.getpid()) if b"MapBatches(Transcriber)" in cmd]


@pytest.mark.timeout(600)
def test_actor_killed_mid_run_then_rerun_every_row_once(clips: list[Clip], ray_local: Any,
                                                       tmp_path: Path) -> None:
    subset = sorted(clips, key=lambda c: c.duration_s)[:16]  # short clips: many small blocks
    manifest = nemo_manifest(subset, tmp_path / "m.jsonl")
    out = tmp_path / "out.jsonl"
    store = PartStore(out.with_name(out.name + ".parts"))
    argv = ["dataset", str(manifest), "-o", str(out), "--language", "en", "--no-progress",
            "--ray", "--batch-rows", "2"]
    result: list[int] = []
    run = threading.Thread(target=lambda: result.append(main(argv)))
    run.start()
    killed, deadline = None, time.monotonic() + 600
    while killed is None and run.is_alive() and time.monotonic() < deadline:
        written = store.scan()
        pids = actor_pids()
        if written.parts >= 2 and pids:  # the actor has written blocks and has more to do
            assert len(written.records) < len(subset)
            os.kill(pids[0], signal.SIGKILL)
            killed = (pids[0], len(written.records))
        else:
            run.join(0.2)
    run.join(600)
    assert killed is not None, "the run ended before the actor could be killed"
    assert result == [0]
    assert pids[0] not in actor_pids()  # that process is gone; a restarted actor finished
    rows = read_out(out)
    assert Counter(r["id"] for r in rows) == Counter(c.id for c in subset)
    scan = store.scan()
    assert not scan.duplicates() and len(scan.done) == len(subset)  # each id in one part
    texts = {r["id"]: r["pred_text"] for r in rows}
    assert all(texts[c.id] for c in subset if c.set in READ_SPEECH)
    stamp = {p.name: p.stat().st_mtime_ns for p in store.root.glob("part-*")}
    before = out.read_bytes()
    assert main([*argv, "--resume"]) == 0  # nothing left to do: no actor, no part written
    assert {p.name: p.stat().st_mtime_ns for p in store.root.glob("part-*")} == stamp
    assert out.read_bytes() == before
    s = json.loads(out.with_suffix(".summary.json").read_text())
    assert s["this_run"]["files"] == 0 and s["done"] == len(subset) and s["ray"]["plan"] is None


@pytest.mark.timeout(600)
def test_user_pipeline_bytes_words_and_speakers(clips: list[Clip], ray_local: Any,
                                               tmp_path: Path) -> None:
    ray = ray_local
    picked = [c for c in clips if c.set == "librispeech"][:3]
    bad = tmp_path / "notes.wav"
    bad.write_bytes(b"plain text, not audio")
    ds = ray.data.read_binary_files([str(c.path) for c in picked] + [str(bad)],
                                    include_paths=True)
    layout = plan([{"CPU": 2, "GPU": 0}])
    rows = ds.map_batches(Transcriber, fn_constructor_kwargs={  # no language: detected
        "words": True, "segments": True, "id_key": "path"},
        **layout.map_kwargs(), runtime_env={"env_vars": layout.env}).take_all()
    by_path = {r["path"]: r for r in rows}
    assert set(by_path) == {*(str(c.path) for c in picked), str(bad)}
    assert "bytes" not in rows[0]  # the audio itself is not copied to the output
    for c in picked:
        r = by_path[str(c.path)]
        assert r["error"] is None and wer([c.reference], [r["pred_text"]]) < 0.3
        assert r["language"] == "en"  # detected inside the batch
        words = list(r["words"])
        assert words and all(w["start"] <= w["end"] for w in words)
        assert [s["text"] for s in r["segments"]]
    assert by_path[str(bad)]["error"].startswith("unsupported_media")
    # Speakers: pyannote-sample (two people on the phone) as a NeMo row, diarized.
    sample = DIARIZATION / corpus_item(SAMPLE)["file"]
    one = ray.data.from_items([{"audio_filepath": str(sample), "id": SAMPLE}])
    [d] = one.map_batches(Transcriber, fn_constructor_kwargs={
        "language": "en", "diarize": True, "id_key": "id"},
        **layout.map_kwargs(), runtime_env={"env_vars": layout.env}).take_all()
    assert d["error"] is None and list(d["speakers"]) == ["SPEAKER_00", "SPEAKER_01"]
    assert {s["speaker"] for s in d["segments"]} == {"SPEAKER_00", "SPEAKER_01"}
