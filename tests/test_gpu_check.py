"""scripts/gpu-check's bookkeeping, without a device: the steps a call runs, one results file
over two calls (a lent GPU runs 10 minutes a command), the long uploads' references, and each
step held to the engine-alone rate on its own windows. (The steps themselves ran end to end on
CPU with ``--device cpu --tiny``; their figures need a GPU.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.gpu.check import STEPS, Report, held_to, parse
from loadtest.gpu.steps import write_upload
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip


def test_steps_are_chosen_by_only_and_skip() -> None:
    assert parse(["--device", "cpu"]).steps == set(STEPS)
    args = parse(["--only", "saturate,peer", "--device", "cpu"])
    assert args.steps == {"saturate", "peer"}
    assert parse(["--skip", "peer,live"]).steps == set(STEPS) - {"peer", "live"}
    with pytest.raises(SystemExit):
        parse(["--only", "saturte"])


def test_the_gpu_defaults_are_issue_50s_and_tiny_is_small() -> None:
    gpu = parse([])
    assert (gpu.saturate, gpu.saturate_min, gpu.long_min, gpu.live, gpu.live_s) == \
        (16, 20.0, 60.0, [64, 256], 30.0)
    tiny = parse(["--device", "cpu", "--tiny"])
    assert (tiny.clips, tiny.saturate, tiny.saturate_min, tiny.live) == (8, 2, 1.0, [2])


def test_a_second_call_adds_its_steps_to_the_same_file(tmp_path: Path) -> None:
    out, mirror = tmp_path / "stage" / "gpu.json", tmp_path / "OUT" / "gpu.json"
    first = Report(out, {"command": "one"}, {"saturate"}, mirror)
    assert first.step("saturate", lambda: {"throughput_x": 800.0})["throughput_x"] == 800.0
    assert first.step("peer", lambda: {"x": 1}) is None  # not asked for in this call
    second = Report(out, {"command": "two"}, {"engine_limit_saturate"}, mirror, resume=True)
    second.step("engine_limit_saturate", lambda: {"best_throughput_x": 1000.0})
    held_to(second, "saturate", "engine_limit_saturate")
    data = json.loads(mirror.read_text())
    assert data == json.loads(out.read_text())
    assert data["command"] == "two" and data["earlier_calls"][0]["command"] == "one"
    assert data["saturate"]["vs_engine_alone"] == 0.8
    fresh = Report(out, {"command": "three"}, set())  # no --resume: a new file
    assert "saturate" not in fresh.data


def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    report = Report(tmp_path / "gpu.json", {}, {"peer", "time_axes"})

    def broken() -> dict[str, object]:
        raise RuntimeError("CUDA failed with error out of memory")

    report.step("peer", broken)
    report.step("time_axes", lambda: {"ok": True})
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["peer"]["error"].startswith("RuntimeError: CUDA failed")
    assert data["time_axes"]["ok"] is True


def test_a_long_upload_carries_its_clips_references(tmp_path: Path) -> None:
    clips = []
    for k, (seconds, ref) in enumerate([(2.0, "alpha beta"), (3.0, "gamma")]):
        path = tmp_path / f"c{k}.wav"
        write_wav16(path, 0.1 * np.ones(int(seconds * 16_000), np.float32))
        clips.append(Clip(f"c{k}", path, seconds, ref, "read"))
    # 11 s: 2 + 0.8 + 3 + 0.8 = 6.6 s a cycle, so the clips twice (13.2 s)
    upload = write_upload(clips, tmp_path / "long.wav", 11 / 60)
    assert upload.set == "long" and upload.duration_s == pytest.approx(13.2, abs=0.01)
    assert upload.reference == "alpha beta gamma alpha beta gamma"
