"""GPU readiness (issue 19) without a GPU: each item under fault injection, by item number.

The GPU is faked at the libraries' boundaries (tests/fakegpu.py): CTranslate2's Whisper class
and device queries, NVML, the CUDA pool meter. Fast tests use a model-less engine drawing on
the fake's memory meter; ``model``-marked ones run the real engine (whisperx, faster-whisper,
the real whisper-base computing on CPU) on the fake device. The whole service over HTTP on the
fake GPU is in tests/test_gpu_service.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import app.engine.gpumem as gpumem
from app.config import BatcherSettings, ModelSettings, Settings
from app.engine.device import (
    DeviceMonitor,
    UnsupportedComputeType,
    cuda_device_count,
    cuda_unavailable_reason,
    is_oom,
    is_sticky,
    resolve_compute_type,
    torch_device,
)
from app.engine.loading import (
    DeviceUnavailable,
    StartupRefused,
    engine_settings,
    load_error,
    mel_bins,
)
from app.engine.sizing import EngineSizing, budget_bytes, resolve_batcher, unit_bytes, units_per_batch
from app.engine.startup import warm_up_engines
from app.engine.warmup import WarmupFailed, warm_up
from app.engine.whisper import time_axis
from models.ct2file import read_facts
from models.provision import bake, provision_local, verify
from models.registry import ModelUnavailable, check_folder, resolve
from tests.conftest import ROOT
from tests.fakegpu import OOM_TEXTS, STICKY_TEXT, MeterEngine
from tests.fakes import FakeEngine

MiB = 1 << 20


def expected_units(total_mb: int, weights_mb: int, unit_mb: int, workers: int = 2,
                   headroom: float = 0.1) -> int:
    """What sizing should derive from the fake's numbers (CUDA context: 300 MiB)."""
    free = total_mb - 300 - weights_mb
    return int((free - headroom * total_mb) // workers // unit_mb)


# ---- 1. warm-up on the device; load errors keep their cause; compute types ---------------------
class Recording(FakeEngine):
    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__(workers=2)
        self.calls: list[tuple[int, Any]] = []
        self._fail = fail

    def transcribe_batch(self, windows: Any, options: Any) -> Any:
        self.calls.append((len(windows), options))
        self.languages = [w.prompt.language for w in windows]
        if self._fail is not None:
            raise self._fail
        return super().transcribe_batch(windows, options)


class NoPools:
    def used(self, index: int) -> int | None:
        return None

    def peak(self, index: int) -> int | None:
        return None

    def reset(self, index: int) -> None:
        pass


def test_warmup_runs_detection_beam_search_and_word_alignment() -> None:
    eng = Recording()
    sizing = warm_up(eng, Settings(), DeviceMonitor("cpu"), NoPools())
    [(n, opts)] = eng.calls  # CPU: one probe window, no sizing
    assert n == 1 and eng.languages == [None] and opts.beam_size == 2 and opts.word_timestamps
    assert sizing.verified is None and sizing.engine == "cpu:0"


@pytest.mark.parametrize(("error", "hint"), [
    ("cuBLAS failed with status CUBLAS_STATUS_NOT_INITIALIZED", None),
    ("Invalid input features shape: expected an input with shape (1, 128, 3000), but got an "
     "input with shape (1, 80, 3000) instead", "mel bins"),
])
def test_a_failing_warmup_refuses_the_start_with_the_library_message(error: str,
                                                                     hint: str | None) -> None:
    with pytest.raises(WarmupFailed) as info:
        warm_up(Recording(fail=RuntimeError(error)), Settings(), DeviceMonitor("cpu"), NoPools())
    assert error in str(info.value) and isinstance(info.value, StartupRefused)
    assert hint is None or hint in str(info.value)


@pytest.mark.parametrize(("exc", "kind", "says"), [
    (RuntimeError("CUDA failed with error CUDA driver version is insufficient for CUDA runtime "
                  "version"), DeviceUnavailable, "driver version is insufficient"),
    (RuntimeError("CUDA failed with error out of memory"), DeviceUnavailable, "not enough memory"),
    (ValueError("Requested float16 compute type, but the target device or backend do not "
                "support efficient float16 computation."), StartupRefused, "efficient float16"),
    (RuntimeError("Variable 'decoder/layer_4/self_attention/linear_0/weight' has an invalid "
                  "payload size"), ModelUnavailable, "truncated or corrupt"),
])
def test_load_errors_keep_their_real_cause(exc: Exception, kind: type, says: str) -> None:
    m = ModelSettings(device="cuda", compute_type="float16", device_index=1)
    err = load_error(exc, "/models/large-v3", m)
    assert isinstance(err, kind) and says in str(err) and str(exc) in str(err)
    if kind is not ModelUnavailable:
        assert "corrupt" not in str(err) and "cuda:1" in str(err)


def test_compute_type_auto_picks_from_what_the_device_supports(gpu_patch: Any) -> None:
    gpu = gpu_patch(compute_types=("float32", "int8", "int8_float32"))  # a Pascal-like card
    assert resolve_compute_type("auto", "cuda", 0) == "int8_float32"
    with pytest.raises(UnsupportedComputeType, match="float32, int8, int8_float32"):
        resolve_compute_type("float16", "cuda", 0)
    gpu.compute_types = ("float32", "float16", "int8_float16")
    assert resolve_compute_type("auto", "cuda", 0) == "float16"
    assert resolve_compute_type("auto", "cpu") == "int8"


def test_cuda_asked_for_on_a_machine_without_one_exits_with_one_line(tmp_path: Path) -> None:
    if cuda_device_count() > 0:
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "BATCHSCRIBE_MODEL__DEVICE": "cuda",
           "BATCHSCRIBE_STORAGE__DATA_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=60)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.strip() and "tcmalloc" not in ln]
    assert proc.returncode != 0
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "no usable GPU" in lines[0] and cuda_unavailable_reason() in lines[0]


# ---- 2. model folders --------------------------------------------------------------------------
def write_model(folder: Path, n_mels: int = 128, d_model: int = 64, layers: int = 2,
                tokenizer: bool = True, cut: int = 0) -> Path:
    """A CTranslate2 Whisper folder whose model.bin has the real layout (tiny tensors)."""
    folder.mkdir(parents=True, exist_ok=True)

    def string(s: str) -> bytes:
        raw = s.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    tensors = {"encoder/conv1/weight": (d_model, n_mels, 3),
               "decoder/embeddings/weight": (100, d_model)}
    for k in range(layers):
        tensors[f"encoder/layer_{k}/ffn/linear_0/weight"] = (d_model, d_model)
        tensors[f"decoder/layer_{k}/ffn/linear_0/weight"] = (d_model, d_model)
    tensors["encoder/layer_norm/gamma"] = (d_model,)
    out = struct.pack("<I", 6) + string("WhisperSpec") + struct.pack("<II", 3, len(tensors))
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        out += string(name) + struct.pack("<B", len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
        out += struct.pack("<BI", 4, nbytes) + b"\0" * nbytes
    out += struct.pack("<I", 0)
    (folder / "model.bin").write_bytes(out[: len(out) - cut])
    (folder / "config.json").write_text(json.dumps({"lang_ids": []}))
    if tokenizer:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {}}))
    (folder / "vocabulary.json").write_text("[]")
    return folder


def test_mel_bins_come_from_the_model_itself(tmp_path: Path) -> None:
    facts = read_facts(write_model(tmp_path / "v3", n_mels=128, layers=3))
    assert (facts.n_mels, facts.d_model, facts.decoder_layers) == (128, 64, 3)
    with pytest.raises(ModelUnavailable, match="truncated"):
        check_folder(write_model(tmp_path / "cut", cut=100))


def test_model_folders_without_tokenizer_or_with_wrong_mels_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match=r"no tokenizer\.json: faster-whisper would fetch"):
        check_folder(write_model(tmp_path / "vocab-only", tokenizer=False))
    wrong = write_model(tmp_path / "wrong")
    (wrong / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80}))
    with pytest.raises(ModelUnavailable, match="says 80 mel bins but the model takes 128"):
        check_folder(wrong)

    class Engine:  # an engine that would feed 80 mel bins to a 128-bin model
        _n_mels = 80
        model = type("W", (), {"model": type("M", (), {"n_mels": 128})()})()

    assert mel_bins(Engine()) == (128, 80)


def test_any_local_folder_is_provisioned_under_a_name_with_a_manifest(tmp_path: Path) -> None:
    src = write_model(tmp_path / "src" / "large-v3-turbo")
    cache = tmp_path / "cache"
    out = provision_local("turbo", src, cache)
    manifest = json.loads((out / "manifest.json").read_text())
    digest = hashlib.sha256((src / "model.bin").read_bytes()).hexdigest()
    assert manifest["files"]["model.bin"]["sha256"] == digest
    assert manifest["model"]["n_mels"] == 128
    assert json.loads((out / "preprocessor_config.json").read_text())["feature_size"] == 128
    assert resolve("turbo", cache) == str(out) and verify("turbo", cache) == []
    with (out / "model.bin").open("ab") as f:
        f.write(b"x")
    assert verify("turbo", cache) == ["model.bin"]
    with pytest.raises(ModelUnavailable, match="its manifest says"):
        resolve("turbo", cache)
    # BAKE_MODEL: a path in the build context, under its folder's name; 0 bakes nothing.
    assert bake(str(src), tmp_path / "image") == tmp_path / "image" / "large-v3-turbo"
    assert bake("0", tmp_path / "none") is None


# ---- 3. the time axis on GPU: one padded length per engine call -------------------------------
def test_gpu_engines_default_to_the_dynamic_axis_and_two_workers(gpu_patch: Any) -> None:
    """The dynamic axis keeps the corpus's WER (app/engine/whisper.py ``time_axis``), so it is
    the GPU's default too; the 30 s axis stays a setting."""
    gpu_patch()
    m = engine_settings(ModelSettings(device="cuda"))
    assert (m.time_axis, m.num_workers, m.compute_type) == ("dynamic", 2, "float16")
    assert engine_settings(ModelSettings(device="cuda", time_axis="full")).time_axis == "full"
    assert engine_settings(ModelSettings(device="cpu")).time_axis in ("auto", "dynamic")
    assert time_axis(engine_settings(ModelSettings(device="cpu")), "cpu") == "dynamic"
    import torch  # a fake GPU: torch sees none, so torch work (the batched mel) stays on CPU

    assert torch_device("cuda", 0) == ("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.mark.model
def test_a_mixed_gpu_batch_is_one_encoder_and_one_decoder_call(gpu_patch: Any) -> None:
    from app.engine.loading import load_whisper
    from app.windows import DecodeOptions
    from tests.fakes import tagged_window

    gpu = gpu_patch()
    engine = load_whisper(Settings(model={"device": "cuda", "num_workers": 1}))  # type: ignore[arg-type]
    try:
        windows = [tagged_window(k, seconds) for k, seconds in enumerate((3.0, 12.0, 28.0))]
        engine.transcribe_batch(windows, DecodeOptions())  # the tagged windows say "en"
    finally:
        engine.close()
    assert gpu.counts.get("encode") == 1 and gpu.counts.get("generate") == 1, gpu.counts


# ---- 4. hardware-aware batch size ---------------------------------------------------------------
def test_sizing_counts_windows_times_beam_per_worker() -> None:
    assert unit_bytes(600 * MiB, 4, None) == 150 * MiB and unit_bytes(None, 4, 100) == 100 * MiB
    assert budget_bytes(10_000 * MiB, 16_000 * MiB, 0.1, None) == 8_400 * MiB
    assert budget_bytes(10_000 * MiB, 16_000 * MiB, 0.1, 2_000) == 2_000 * MiB  # the operator's
    assert units_per_batch(3000 * MiB, 150 * MiB, 2) == 10
    assert units_per_batch(None, 150 * MiB, 2) is None  # unmeasured: search from the limit
    sizings = [EngineSizing("cuda:0", 2, verified=24), EngineSizing("cuda:1", 2, verified=12)]
    b = resolve_batcher(BatcherSettings(), sizings)
    assert (b.max_batch_size, b.max_batch_beams, b.memory_budget_mb) == (12, 12, 0)
    assert resolve_batcher(BatcherSettings(max_batch_size=8), sizings).max_batch_size == 8
    assert resolve_batcher(BatcherSettings(), []).max_batch_size == 8  # CPU: as measured


def test_batch_cap_counts_beams_and_halves_in_them() -> None:
    from app.batching.policy import after_oom, limit

    s = BatcherSettings(max_batch_size=16, max_batch_beams=16)
    assert [limit(s, 16, "run", 0, beam) for beam in (1, 5, 10)] == [16, 3, 1]
    cap = after_oom(s, 16, 3, beam=5)  # 15 windows x beam ran out: 7 is the new cap
    assert cap == 7 and limit(s, cap, "run", 0, 5) == 1


def test_warmup_derives_each_engines_cap_from_its_own_gpu(gpu_patch: Any) -> None:
    gpu = gpu_patch(totals_mb=(4096, 2048), weights_bytes=500 * MiB)
    engines = [MeterEngine(gpu, 0), MeterEngine(gpu, 1)]
    started = warm_up_engines(engines, Settings(), DeviceMonitor("cuda"), gpumem.pool_meter())
    sizings = started.sizings
    assert started.engines == engines and not started.failed
    # probe: 2 windows x beam 2, encoder output held while the decoder caches grow
    unit = (2 * 50 + 4 * 150) // 4
    want = [expected_units(4096, 500, unit), expected_units(2048, 500, unit)]
    assert [s.unit_bytes for s in sizings] == [unit * MiB] * 2
    assert [s.verified for s in sizings] == want and want[1] < want[0]
    assert resolve_batcher(BatcherSettings(), sizings).max_batch_size == want[1]
    for e, s in zip(engines, sizings, strict=True):  # probe (2 x beam 2) then the batch, x2
        assert [(n, o.beam_size) for n, o in e.batches] == [(2, 2)] + [(s.verified, 1)] * 2


def test_warmup_halves_a_batch_the_device_cannot_hold(gpu_patch: Any) -> None:
    # The encoder's share is larger than the probe (beam 2) suggested for beam 1: the derived
    # batch on both workers at once runs out of memory, and is halved until it fits.
    gpu = gpu_patch(totals_mb=(4096,), decode_mb=100, encode_mb=500, weights_bytes=500 * MiB)
    [sizing] = warm_up_engines([MeterEngine(gpu, meet=2)], Settings(), DeviceMonitor("cuda"),
                               gpumem.pool_meter()).sizings
    assert sizing.unit_bytes == (2 * 500 + 4 * 100) // 4 * MiB  # probe: encoder + decoder caches
    assert sizing.oom_steps >= 1 and sizing.verified is not None and sizing.units is not None
    assert sizing.verified < sizing.units
    assert sizing.free_bytes is not None
    assert 2 * sizing.verified * (500 + 100) * MiB <= sizing.free_bytes  # what ran fits twice


# ---- 5. errors: OOM texts, rotation, health ----------------------------------------------------
@pytest.mark.parametrize("text", [*OOM_TEXTS, "CUDA out of memory. Tried to allocate 20.00 MiB",
                                  "cuFFT error: CUFFT_ALLOC_FAILED",
                                  "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
                                  "mkl_malloc: failed to allocate memory"])
def test_every_real_out_of_memory_text_counts_as_oom(text: str) -> None:
    assert is_oom(RuntimeError(text)) and not is_sticky(RuntimeError(text))


@pytest.mark.parametrize("text", [
    STICKY_TEXT, "parallel_for failed: cudaErrorIllegalAddress: an illegal memory access was "
    "encountered", "CUDA failed with error unspecified launch failure"])
def test_sticky_cuda_errors_are_not_oom(text: str) -> None:
    assert is_sticky(RuntimeError(text)) and not is_oom(RuntimeError(text))
    assert not is_oom(RuntimeError("cuBLAS failed with status CUBLAS_STATUS_EXECUTION_FAILED"))


async def test_a_sticky_error_on_the_last_engine_makes_it_unhealthy_oom_never_does() -> None:
    from app.engine.placement import EnginePool, EngineRunner
    from app.windows import DecodeOptions
    from tests.fakes import tagged_window

    state: dict[str, str | None] = {"error": OOM_TEXTS[1]}

    def fail(windows: Sequence[Any]) -> None:
        if state["error"]:
            raise RuntimeError(state["error"])

    pool = EnginePool([EngineRunner(FakeEngine(fail=fail))], unhealthy_after=3)
    try:
        for _ in range(5):  # out of memory: the batcher's business, never the engine's health
            with pytest.raises(RuntimeError):
                await pool.run([tagged_window(1)], DecodeOptions())
        assert pool.unhealthy() is None and pool.failing == 0
        state["error"] = STICKY_TEXT
        with pytest.raises(RuntimeError):
            await pool.run([tagged_window(1)], DecodeOptions())
        assert "sticky CUDA error on cpu:0" in (pool.unhealthy() or "")
        state["error"] = None  # a success clears it (a sticky error never does in reality)
        await pool.run([tagged_window(1)], DecodeOptions())
        assert pool.unhealthy() is None
    finally:
        pool.close()


# ---- 6. several GPUs --------------------------------------------------------------------------
@pytest.mark.parametrize(("preset", "expected"), [(None, "PCI_BUS_ID"),
                                                  ("FASTEST_FIRST", "FASTEST_FIRST")])
def test_gpus_are_numbered_by_pci_bus_before_cuda_starts(preset: str | None,
                                                         expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    if preset:
        env["CUDA_DEVICE_ORDER"] = preset  # an operator's explicit choice is kept
    out = subprocess.run(
        [sys.executable, "-c", "import app.__main__, os; print(os.environ['CUDA_DEVICE_ORDER'])"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == expected


def test_prep_workers_and_engine_slots_follow_the_gpus() -> None:
    from app.engine import EngineInfo
    from app.engine.placement import EnginePool, EngineRunner
    from app.jobs.prep import prep_threads

    assert prep_threads(1, 4) == 4 and prep_threads(6, 4) == 6  # at least one per engine
    assert prep_threads(0, 4) >= 4  # auto: one per core, at least one per engine
    engines = [FakeEngine(), FakeEngine()]
    for e, index in zip(engines, (0, 2), strict=True):  # GPU 1 failed to load
        e.info = EngineInfo("fake", "cuda", "float16", 2, index)
    asked: list[int] = []
    pool = EnginePool([EngineRunner(e) for e in engines],
                      utilisation=lambda i: asked.append(i) or 0.0)  # type: ignore[func-returns-value]
    assert [s.name for s in pool.slots] == ["cuda:0", "cuda:2"]
    pool.pick()
    assert sorted(asked) == [0, 2]  # NVML is asked about the engines' own GPUs
    pool.close()
