"""loadtest.gpu.bundle: parts arriving one call at a time are joined and checked on the host."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import zipfile
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


def _wheel(path: Path, members: dict[str, tuple[bytes, int]]) -> None:
    """A wheel pip accepts: ``members`` (name: (data, mode)) plus its dist-info's RECORD."""
    import base64

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    info = "tinypkg-1.0.dist-info"
    members = {**members,
               f"{info}/METADATA": (b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n", 0o644),
               f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                 b"Tag: py3-none-any\n", 0o644)}
    record = "".join(f"{n},sha256={digest(d)},{len(d)}\n" for n, (d, _) in members.items())
    members[f"{info}/RECORD"] = ((record + f"{info}/RECORD,,\n").encode(), 0o644)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, (data, mode) in members.items():
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100000 | mode) << 16
            z.writestr(zi, data)


def test_a_wheel_travels_as_xz_and_is_rebuilt_installable(tmp_path: Path) -> None:
    """The members, their bytes and their modes come back, and pip installs the rebuilt wheel
    (an executable library keeps its x bit: CTranslate2's wheel carries its .so files so)."""
    whl = tmp_path / "tinypkg-1.0-py3-none-any.whl"
    lib = bytes(range(256)) * 4000
    _wheel(whl, {"tinypkg/__init__.py": (b"VALUE = 42\n", 0o644),
                 "tinypkg/libfake.so": (lib, 0o755)})
    with zipfile.ZipFile(whl) as z:
        before = {i.filename: (z.read(i), i.external_attr >> 16) for i in z.infolist()}
    packed = gpu_bundle.pack_wheel(whl)
    assert packed.name == whl.name + ".tar.xz" and not whl.exists()
    rebuilt = gpu_bundle.unpack_wheel(packed)
    assert rebuilt == whl and not packed.exists()
    with zipfile.ZipFile(rebuilt) as z:
        after = {i.filename: (z.read(i), i.external_attr >> 16) for i in z.infolist()}
    assert after == before
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), str(rebuilt)], check=True)
    assert (site / "tinypkg/__init__.py").read_text() == "VALUE = 42\n"
    assert os.access(site / "tinypkg/libfake.so", os.X_OK)


def test_xz_weights_arriving_in_two_calls_are_joined_and_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compressed weights' chunks split over two parts (as a part boundary may fall), then
    decompressed into ``model.bin`` and checked against the manifest's sha256."""
    monkeypatch.setattr(gpu_bundle, "CHUNK", 16_000)
    weights = random.Random(5).randbytes(50_000) + bytes(40_000)  # some of it compresses
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(weights)
    packed_dir = tmp_path / "packed"
    packed_dir.mkdir()
    gpu_bundle.pack_weights(src / "model.bin", packed_dir)
    chunks = sorted(packed_dir.iterdir())
    assert len(chunks) >= 3 and sum(c.stat().st_size for c in chunks) < len(weights)
    manifest = {"files": {"model.bin": {"sha256": hashlib.sha256(weights).hexdigest()}}}
    stage = tmp_path / "stage"
    monkeypatch.setenv("GPU_BUNDLE_STAGE", str(stage))
    halves = [chunks[:1], chunks[1:]]
    for k, half in enumerate(halves, 1):
        files = {f"home/models/m/{c.name}": c.read_bytes() for c in half}
        if k == 1:
            files["home/models/m/manifest.json"] = json.dumps(manifest).encode()
        _part(tmp_path / f"call{k}" / ".gpu", k, 2, files)
        assert gpu_bundle.unpack(tmp_path / f"call{k}" / ".gpu") == 0
    model = stage / "home/models/m"
    assert (model / "model.bin").read_bytes() == weights
    assert not list(model.glob("model.bin.xz.chunk*"))
