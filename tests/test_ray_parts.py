"""The Ray path's pieces without Ray or the model: part files (exactly once), the plan (sized for
the hardware), row inputs (paths, bytes, samples, Hugging Face dicts), and the stage's rows with
a fake engine (a broken row gets its error, the others their transcripts)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from app.audio import decode
from app.config import Settings
from app.dataset.inputs import Request, RowError, Spool, audio_source, plain, wav_bytes
from app.dataset.parts import PartsError, PartStore, key, part_name
from app.dataset.plan import plan
from app.dataset.stage import Transcriber, batch_rows
from loadtest.lib.corpus import Clip
from tests.fakes import FakeEngine


def rec(i: Any, error: str | None = None) -> dict[str, Any]:
    return {"id": i, "out": None if error else {"row": i}, "error": error, "facts": {"audio_s": 1.0}}


def test_a_block_is_one_file_named_by_its_ids(tmp_path: Path) -> None:
    store = PartStore(tmp_path / "p")
    assert part_name([3, 1, 2]) == part_name([1, 2, 3]) != part_name([1, 2])
    assert part_name([1]) != part_name(["1"])  # ids keep their JSON type
    first = store.write([rec(1), rec(2)])
    again = store.write([rec(2), rec(1, "later failed")])  # a retried block: the same name
    assert first == again and len(list(store.root.glob("part-*"))) == 1
    (store.root / ".part-x.jsonl.123.tmp").write_text("half a line")  # killed mid-write
    store.write([rec(3)])
    scan = store.scan()
    assert scan.parts == 2 and not scan.duplicates()
    assert set(scan.records) == {key(1), key(2), key(3)}
    assert scan.records[key(1)]["error"] == "later failed"  # the rewrite replaced the file


def test_done_wins_and_the_output_is_in_input_order(tmp_path: Path) -> None:
    store = PartStore(tmp_path / "p")
    store.write([rec(0, "unreadable"), rec(1)])
    store.write([rec(0), rec(2)])  # --retry-failed: row 0 done in a later block
    scan = store.scan()
    assert scan.duplicates() == {key(0): 2}
    assert set(scan.done) == {key(0), key(1), key(2)} and not scan.failed
    out = tmp_path / "out.jsonl"
    assert store.assemble(out, [2, 0, 1, 7], scan) == 3
    assert [json.loads(x)["row"] for x in out.read_text().splitlines()] == [2, 0, 1]


def test_a_rerun_needs_resume_and_the_same_input(tmp_path: Path) -> None:
    store = PartStore(tmp_path / "p")
    header = {"input_digest": "a", "language": "en", "task": "transcribe",
              "word_timestamps": False, "diarize": False}
    store.start(header, resume=False, overwrite=False)
    store.write([rec(1)])
    with pytest.raises(PartsError, match="--resume"):
        store.start(header, resume=False, overwrite=False)
    with pytest.raises(PartsError, match="input_digest"):
        store.start({**header, "input_digest": "b"}, resume=True, overwrite=False)
    (store.root / ".part-y.jsonl.1.tmp").write_text("x")
    store.start(header, resume=True, overwrite=False)
    assert key(1) in store.scan().records and not list(store.root.glob(".part-*"))
    store.start(header, resume=False, overwrite=True)
    assert not store.scan().records


def test_plan_one_actor_per_gpu_else_per_node() -> None:
    gpus = plan([{"CPU": 16, "GPU": 2}, {"CPU": 8, "GPU": 1}, {"CPU": 4, "GPU": 0}], environ={})
    assert (gpus.device, gpus.actors, gpus.gpus_per_actor, gpus.threads) == ("cuda", 3, 1, 8)
    assert gpus.cpus_per_actor == 7  # fits every GPU node with a CPU to spare (8 - 1)
    assert gpus.env["BATCHSCRIBE_PREP__WORKERS"] == "8"
    assert gpus.env["BATCHSCRIBE_STORAGE__MAX_ACTIVE_JOBS"] == str(gpus.rows_in_flight // 2)
    cpu = plan([{"CPU": 2, "GPU": 0}], environ={"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"})
    assert (cpu.device, cpu.actors, cpu.threads, cpu.gpus_per_actor) == ("cpu", 1, 2, 0)
    assert cpu.cpus_per_actor == 1  # a CPU left for Ray Data's read tasks
    assert cpu.env["BATCHSCRIBE_MODEL__NUM_WORKERS"] == "2"  # one 1-thread worker per core
    assert cpu.env["BATCHSCRIBE_MODEL__CPU_THREADS"] == "1"
    assert cpu.env["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4"
    # Twice the rows it runs (the service's 64) wait in the actor: the next batch is there.
    assert cpu.rows_in_flight == 128 and cpu.env["BATCHSCRIBE_STORAGE__MAX_ACTIVE_JOBS"] == "64"
    forced = plan([{"CPU": 8, "GPU": 1}], device="cpu", environ={})
    assert forced.device == "cpu" and forced.actors == 1 and forced.threads == 8
    two = plan([{"CPU": 8, "GPU": 0}], actors=2, environ={"BATCHSCRIBE_MODEL__NUM_WORKERS": "3"})
    assert two.threads == 4 and two.cpus_per_actor == 3.5
    assert two.env["BATCHSCRIBE_MODEL__NUM_WORKERS"] == "3"  # the operator's setting wins
    with pytest.raises(ValueError, match="no GPU"):
        plan([{"CPU": 4}], device="cuda", environ={})


def test_row_audio_from_every_shape(tmp_path: Path, clips: list[Clip]) -> None:
    clip = clips[0]
    data = clip.path.read_bytes()
    assert audio_source({"audio_filepath": str(clip.path), "path": "x"}) == str(clip.path)
    assert audio_source({"path": "a.wav", "bytes": data}) == data  # read_binary_files
    assert audio_source({"audio": {"bytes": data, "path": "a.flac"}}) == data
    decoded = audio_source({"amplitude": np.zeros((2, 800)), "sample_rate": 8000})
    assert isinstance(decoded, tuple)
    samples, rate = decoded
    assert samples.shape == (2, 800) and rate == 8000
    with pytest.raises(RowError, match="no audio"):
        audio_source({"text": "hello"})
    spool = Spool(Settings(), base_dir=clip.path.parent)
    try:
        path, spooled = spool.local(clip.path.name)  # relative: against the manifest's folder
        assert path == clip.path and not spooled
        with pytest.raises(RowError, match="FileNotFoundError"):
            spool.local("missing.wav")
        path, spooled = spool.local(data)
        assert spooled and path.read_bytes() == data
        spool.release(path, spooled)
        assert not path.exists()
    finally:
        spool.close()


def test_a_spool_that_is_never_closed_leaves_no_folder() -> None:
    """A Ray actor ends without ``close``: its spool's folder goes with the spool."""
    import gc

    spool = Spool(Settings())
    folder = spool.dir
    path, _ = spool.local(b"RIFF")
    assert path.parent == folder and folder.is_dir()
    del spool
    gc.collect()
    assert not folder.exists()
    closed = Spool(Settings())
    closed.close()
    closed.close()  # twice is harmless
    assert not closed.dir.exists()


def test_samples_reach_prep_as_the_same_audio(tmp_path: Path) -> None:
    t = np.arange(16000 * 2) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    wav = tmp_path / "tone.wav"
    wav.write_bytes(wav_bytes(tone, 16000))
    back = decode(wav, 60)
    # The decoder resamples to 16-bit, as for every upload: within one step of it.
    assert back.shape == tone.shape and np.abs(back - tone).max() < 2 / 32768


def test_plain_values_and_batch_formats() -> None:
    assert plain(np.float64("nan")) is None and plain(np.int64(3)) == 3
    assert plain(np.array([{"a": np.int32(1)}], dtype=object)) == [{"a": 1}]
    df = pd.DataFrame({"a": [1, 2], "b": ["x", None]})
    rows = [{k: plain(v) for k, v in r.items()} for r in batch_rows(df)]  # as the stage reads them
    assert rows == [{"a": 1, "b": "x"}, {"a": 2, "b": None}]
    assert batch_rows({"a": np.array([1, 2])}) == [{"a": 1}, {"a": 2}]


def test_request_options_follow_the_api() -> None:
    s = Settings()
    assert Request(language="en").options({}, s).beam_size == 1
    de = Request(language_key="lang", prompt_key="p").options({"lang": "DE", "p": " Hi "}, s)
    assert (de.language, de.beam_size, de.initial_prompt) == ("de", 5, "Hi")
    detect = Request().options({}, s)
    assert (detect.language, detect.beam_size, detect.other_beam_size) == (None, 1, 5)


@pytest.fixture
def fake_stage(tmp_path: Path) -> Any:
    settings = Settings(storage={"data_dir": tmp_path},  # type: ignore[arg-type]
                        model={"vad": "silero", "warmup": False})  # type: ignore[arg-type]
    stage = Transcriber(language="en", id_key="id", parts_dir=str(tmp_path / "parts"),
                        settings=settings, engine_factory=lambda s: FakeEngine(workers=2))
    yield stage
    stage.close()


def test_a_broken_row_gets_its_error_and_the_rest_finish(fake_stage: Transcriber,
                                                         clips: list[Clip], tmp_path: Path) -> None:
    good = [c for c in clips if c.set == "librispeech"][:3]
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF not really")
    batch = pd.DataFrame([{"id": k, "audio_filepath": str(c.path), "text": c.reference}
                          for k, c in enumerate(good)]
                         + [{"id": 3, "audio_filepath": str(bad), "text": "x"},
                            {"id": 4, "audio_filepath": str(tmp_path / "gone.flac"), "text": None}])
    out = asyncio.run(fake_stage(batch))
    assert list(out["id"]) == [0, 1, 2, 3, 4]
    assert out["error"][:3].isna().all() and out["pred_text"][:3].str.startswith("w").all()
    assert out["error"][3].startswith("unsupported_media") and "FileNotFoundError" in out["error"][4]
    assert (out["language"][:3] == "en").all() and (out["wer"][:3] > 0).all()  # fake texts
    [part] = list((tmp_path / "parts").glob("part-*.jsonl"))
    records = [json.loads(x) for x in part.read_text().splitlines()]
    assert [r["id"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["error"] is None for r in records] == [True] * 3 + [False] * 2
    assert records[0]["out"]["audio_filepath"] == str(good[0].path) and records[3]["out"] is None
    assert not os.listdir(fake_stage.spool.dir)
