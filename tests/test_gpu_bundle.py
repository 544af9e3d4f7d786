"""loadtest.gpu.bundle: parts arriving one call at a time are joined and checked on the host."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from loadtest.gpu import bundle as gpu_bundle


def _part(bundle: Path, k: int, parts: int, files: dict[str, bytes]) -> None:
    part = bundle / f"p{k}"
    for rel, data in files.items():
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        (part / rel).write_bytes(data)
    (part / "PART.json").write_text(json.dumps({
        "part": k, "parts": parts, "model": "home/models/m",
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}}))


def test_parts_arrive_one_call_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call carries one part and the carried folder's parent is replaced (as on the lent
    hosts), so only the stage outside it keeps what earlier calls brought."""
    weights = bytes(range(256)) * 1000
    manifest = {"files": {"model.bin": {"sha256": hashlib.sha256(weights).hexdigest()}}}
    stage = tmp_path / "stage"
    monkeypatch.setenv("GPU_BUNDLE_STAGE", str(stage))
    for k, files in enumerate([
            {"home/models/m/model.bin.chunk000": weights[:100_000],
             "home/models/m/manifest.json": json.dumps(manifest).encode()},
            {"home/models/m/model.bin.chunk001": weights[100_000:], "corpus/a.txt": b"x"}], 1):
        bundle = tmp_path / f"call{k}" / ".gpu"  # a fresh .gpu each call: only part k in it
        _part(bundle, k, 2, files)
        assert gpu_bundle.unpack(bundle) == 0
        assert not (stage / "home/models/m/model.bin").exists() or k == 2
    model = stage / "home/models/m"
    assert (model / "model.bin").read_bytes() == weights
    assert not list(model.glob("model.bin.chunk*"))
    assert (stage / "corpus/a.txt").read_bytes() == b"x"


def test_a_damaged_part_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_BUNDLE_STAGE", str(tmp_path / "stage"))
    _part(tmp_path / ".gpu", 1, 1, {"corpus/a.txt": b"x"})
    (tmp_path / ".gpu/p1/corpus/a.txt").write_bytes(b"y")
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        gpu_bundle.unpack(tmp_path / ".gpu")


def test_a_newer_cublas_is_linked_under_the_name_ctranslate2_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site-packages"
    lib = site / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    monkeypatch.setattr(gpu_bundle.sys, "path", [str(site)])
    found = gpu_bundle.cublas12(tmp_path / "stage")
    assert found is not None and str(lib) in found
    link = tmp_path / "stage" / "lib" / "libcublas.so.12"
    assert link.is_symlink() and link.resolve() == (lib / "libcublas.so.13").resolve()
