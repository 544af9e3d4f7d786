"""Carry the service to a GPU host that has Python, torch and a driver but no package index.

Such a host (the lent H100/H200 machines this project measures on: Python 3.12, torch built for
CUDA 13, no CTranslate2, no FastAPI, nothing reachable) takes files in loads of at most 64 MiB a
call. ``pack`` (here) lays out everything the service and ``scripts/gpu-check`` import that
the host lacks, the model and the corpus, as numbered parts of at most ``--part-mb``:

* wheels for the host's Python, at the versions installed here (``--no-deps``: the host keeps
  its own numpy, torch, tokenizers, onnxruntime...);
* whisperx's package without its 17 MB pyannote VAD checkpoint (the service imports only its
  mel filters and language table unless the pyannote VAD is chosen);
* the provisioned model folder, ``model.bin`` xz-compressed and cut into chunks;
* the corpus (``../shared`` does not travel with the working tree);
* part 1 also holds a tiny random Whisper in CTranslate2's format, so the first call can probe
  CTranslate2's GPU path (cuBLAS) before the rest has arrived.

Every call costs device time (a transfer, an unpack, an install: the 15 minutes of a lease
include them), so the parts are packed tight: a wheel over :data:`PACKED_MIN` travels as an xz
tar of its members (a wheel's deflate leaves much: ctranslate2 4.8.5 42.8 -> ~25 MB, av 18.1.1
36.6 -> ~25 MB) and is rebuilt into the same wheel there, and the weights travel as xz
(whisper-base's float16 ``model.bin`` 145.2 -> 128.3 MB). With whisper-base and the corpus that
is 4 parts of 58 MiB instead of 5.

``unpack`` (there, stdlib only) moves whatever parts have arrived into the stage
(``GPU_BUNDLE_STAGE``, outside the repository on the lent hosts), installs the wheels not yet
installed into ``<stage>/site``, and once every part is there joins and checks
the model (sha256 against its manifest). ``env`` prints the variables to run with, including
the cuBLAS route: CTranslate2's wheel dlopens ``libcublas.so.12`` (its CUDA runtime is
static), and ``<stage>/lib`` gets a ``libcublas.so.12`` link to the host's cuBLAS when the host
has only a newer one (``--cublas``).

    python -m loadtest.gpu.bundle pack --out .gpu          # here
    python3 -m loadtest.gpu.bundle unpack --bundle .gpu    # there, after each call's part
    eval "$(python3 -m loadtest.gpu.bundle env --bundle .gpu)"
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
# What the service, the client side of gpu-check and their imports need beyond the GPU image
# (its package list: /work/.library/device/KINDS.md), found by importing the running service
# and listing sys.modules' distributions.
WHEELS = (
    "ctranslate2", "faster-whisper", "av", "fastapi", "starlette", "pydantic", "pydantic_core",
    "pydantic-settings", "python-dotenv", "typing-inspection", "annotated-doc", "annotated-types",
    "opentelemetry-api", "uvicorn", "httptools", "python-multipart", "SQLAlchemy", "greenlet",
    "alembic", "Mako", "srt", "jiwer", "RapidFuzz", "whisper-normalizer", "more-itertools",
    "py-spy",  # gpu-check samples the service's threads while it is saturated
    # uvicorn's WebSocket protocol (the realtime route, app/__main__.py) and the live steps'
    # sessions (loadtest/live.py): without it the service does not start there
    "websockets",
)
FIRST = ("ctranslate2",)  # part 1: what the first probe needs
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
CHUNK = 8 << 20
PACKED_MIN = 4 << 20  # wheels above this travel as an xz tar of their members
XZ_PRESET: Literal[6] = 6


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- pack (here) ------------------------------------------------------------------------------
def download_wheels(dest: Path, python: str) -> list[Path]:
    """Each of :data:`WHEELS` at the version installed here (else its latest), built for the
    host's Python; a project that publishes only a source archive (srt) is built into a wheel
    here (pure)."""
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip = [sys.executable, "-m", "pip"]
    for name in WHEELS:
        try:  # the version installed here; a tool only the GPU host runs (py-spy): the latest
            pin = f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            pin = name
        got = subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", python, "--implementation", "cp", *plat,
                              "-d", str(dest), pin], capture_output=True)
        if got.returncode:
            subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(dest), pin], check=True,
                           capture_output=True)
    return sorted(dest.glob("*.whl"))


def pack_wheel(whl: Path) -> Path:
    """``<wheel>.tar.xz``: the wheel's members and their modes, for :func:`unpack_wheel` to
    rebuild the wheel from (the wheel itself is removed)."""
    out = whl.with_name(whl.name + ".tar.xz")
    with zipfile.ZipFile(whl) as z, tarfile.open(out, "w:xz", preset=XZ_PRESET) as tar:
        for info in z.infolist():
            if info.is_dir():
                continue
            data = z.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            member.mode = (info.external_attr >> 16) & 0o7777 or 0o644
            tar.addfile(member, io.BytesIO(data))
    whl.unlink()
    return out


def pack_weights(weights: Path, dest: Path) -> None:
    """``weights`` xz-compressed into ``<name>.xz.chunkNNN`` files of :data:`CHUNK` bytes."""
    xz = lzma.LZMACompressor(preset=XZ_PRESET)
    pending, k = bytearray(), 0
    with weights.open("rb") as f:
        for block in [*iter(lambda: f.read(CHUNK), b""), None]:
            pending += xz.compress(block) if block is not None else xz.flush()
            while len(pending) >= CHUNK or (block is None and pending):
                (dest / f"{weights.name}.xz.chunk{k:03d}").write_bytes(pending[:CHUNK])
                del pending[:CHUNK]
                k += 1


def tiny_model(dest: Path, tokenizer: Path) -> None:
    """A 2-layer random Whisper (d_model 64) in CTranslate2's format: GEMMs, the conv front
    end and a decoder, enough to tell whether CTranslate2 runs on the GPU at all."""
    from ctranslate2.converters import TransformersConverter
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    hf = dest.parent / (dest.name + "-hf")
    cfg = WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128)
    WhisperForConditionalGeneration(cfg).save_pretrained(hf)
    shutil.copy(tokenizer, hf / "tokenizer.json")
    TransformersConverter(str(hf)).convert(str(dest), quantization="float16", force=True)
    shutil.rmtree(hf)


def pack(out: Path, model_dir: Path, corpus: Path, python: str, part_mb: int) -> None:
    src = out / "src"
    if src.exists():
        shutil.rmtree(src)
    wheels = [pack_wheel(w) if w.stat().st_size > PACKED_MIN else w
              for w in download_wheels(src / "wheels", python)]
    dist = metadata.distribution("whisperx")
    shutil.copytree(Path(str(dist.locate_file("whisperx"))), src / "py" / "whisperx",
                    ignore=shutil.ignore_patterns("pytorch_model.bin", "__pycache__"))
    info = Path(str(dist._path))  # type: ignore[attr-defined]  # its .dist-info: the version
    shutil.copytree(info, src / "py" / info.name)
    (src / "REVISION").write_text(revision())
    model = src / "home" / "models" / model_dir.name
    model.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "model.bin":
            shutil.copy(f, model / f.name)
    pack_weights(model_dir / "model.bin", model)
    shutil.copytree(corpus, src / "corpus")
    tiny_model(src / "probe-model", model_dir / "tokenizer.json")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    first = [p for p in files if p in wheels and p.name.split("-")[0].lower() in FIRST]
    first += [p for p in files if {"probe-model", "py"} & set(p.relative_to(src).parts[:1])]
    files = first + [p for p in files if p not in first]
    parts: list[list[Path]] = [[]]
    size = 0
    for p in files:
        n = p.stat().st_size
        if parts[-1] and size + n > part_mb << 20:
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += n
    for old in out.glob("p[0-9]*"):
        shutil.rmtree(old)
    for k, members in enumerate(parts, 1):
        part = out / f"p{k}"
        listing = {}
        for p in members:
            rel = p.relative_to(src)
            (part / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, part / rel)
            listing[str(rel)] = sha256(p)
        (part / "PART.json").write_text(json.dumps(
            {"part": k, "parts": len(parts), "files": listing,
             "model": f"home/models/{model_dir.name}"}, indent=0))
        mb = sum(p.stat().st_size for p in members) / 2**20
        print(f"{part}: {len(members)} files, {mb:.1f} MiB")


def revision() -> str:
    """The commit the parts were packed from, ``-dirty`` if tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    return git("rev-parse", "--short", "HEAD").strip() + (
        "-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


# ---- unpack (there; stdlib only) --------------------------------------------------------------
def stage_dir(bundle: Path) -> Path:
    """Where parts are unpacked: ``GPU_BUNDLE_STAGE``, else ``<bundle>/stage``. On the lent
    hosts it must lie outside the repository: each call replaces the carried folder's parent
    there, so a stage inside ``.gpu`` was gone at the next call (seen on the H200)."""
    return Path(os.environ.get("GPU_BUNDLE_STAGE") or bundle / "stage")


def unpack(bundle: Path) -> int:
    stage = stage_dir(bundle)
    stage.mkdir(parents=True, exist_ok=True)
    seen = json.loads((stage / "seen.json").read_text()) if (stage / "seen.json").exists() else {}
    for part in sorted(bundle.glob("p[0-9]*")):
        meta = json.loads((part / "PART.json").read_text())
        for rel, digest in meta["files"].items():
            dest = stage / rel
            if not (part / rel).exists():
                continue  # moved by an earlier unpack
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(part / rel), dest)
            if sha256(dest) != digest:
                raise SystemExit(f"unpack: {rel}: sha256 mismatch")
        seen[str(meta["part"])] = meta
    (stage / "seen.json").write_text(json.dumps(seen))
    installed = stage / "installed.txt"
    done = set(installed.read_text().split()) if installed.exists() else set()
    for tarred in sorted((stage / "wheels").glob("*.whl.tar.xz")):
        unpack_wheel(tarred)
    new = [w for w in sorted((stage / "wheels").glob("*.whl")) if w.name not in done]
    if new:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                        str(stage / "site"), *map(str, new)], check=True)
        installed.write_text("\n".join(sorted(done | {w.name for w in new})))
    total = max((m["parts"] for m in seen.values()), default=0)
    missing = [k for k in range(1, total + 1) if str(k) not in seen]
    print(f"unpack: parts {sorted(map(int, seen))} of {total}; installed {len(new)} wheels")
    if missing:
        return 0
    model = stage / next(iter(seen.values()))["model"]
    chunks = sorted(model.glob("model.bin.chunk*"))
    packed = sorted(model.glob("model.bin.xz.chunk*"))
    if chunks or packed:
        xz = lzma.LZMADecompressor()
        with (model / "model.bin").open("wb") as f:
            for c in chunks or packed:
                f.write(xz.decompress(c.read_bytes()) if packed else c.read_bytes())
                c.unlink()
        if packed and not xz.eof:
            raise SystemExit("unpack: model.bin.xz ends early")
    manifest = json.loads((model / "manifest.json").read_text())
    digests = manifest.get("sha256") or {k: v.get("sha256") for k, v in
                                         manifest.get("files", {}).items()}
    want = digests.get("model.bin")
    if want and sha256(model / "model.bin") != want:
        raise SystemExit("unpack: model.bin does not match its manifest")
    print(f"unpack: complete; model at {model}")
    return 0


def unpack_wheel(packed: Path) -> Path:
    """The wheel :func:`pack_wheel` packed, rebuilt beside it (stored, not deflated: pip reads
    it once), its members' modes kept."""
    whl = packed.with_name(packed.name.removesuffix(".tar.xz"))
    tmp = whl.with_name(whl.name + ".part")
    with tarfile.open(packed, "r:xz") as tar, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for member in tar:
            data = tar.extractfile(member) if member.isfile() else None
            if data is None:
                continue
            info = zipfile.ZipInfo(member.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | member.mode) << 16
            z.writestr(info, data.read())
    tmp.rename(whl)
    packed.unlink()
    return whl


def cublas12(stage: Path) -> str | None:
    """A directory holding ``libcublas.so.12`` for CTranslate2's dlopen: the host's own cuBLAS
    12 if it has one, else a link to its newer cuBLAS under that name (the nine cuBLAS entry
    points CTranslate2 resolves kept their signatures in cuBLAS 13)."""
    roots = [Path(p) for p in sys.path if p.endswith("site-packages")]
    for name in ("libcublas.so.12", "libcublas.so.13"):
        for root in roots:
            found = sorted(glob.glob(str(root / "nvidia" / "**" / name), recursive=True))
            if found:
                if name.endswith(".12"):
                    return str(Path(found[0]).parent)
                lib = stage / "lib"
                lib.mkdir(parents=True, exist_ok=True)
                link = lib / "libcublas.so.12"
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(found[0])
                return f"{lib}:{Path(found[0]).parent}"
    return None


def env(bundle: Path) -> None:
    stage = stage_dir(bundle).resolve()
    lib = cublas12(stage)
    paths = [str(stage / "site"), str(stage / "py"), str(ROOT)]
    ld = [p for p in (lib, os.environ.get("LD_LIBRARY_PATH")) if p]
    print(f"export PYTHONPATH={':'.join(paths)}")
    print(f"export LD_LIBRARY_PATH={':'.join(ld)}")
    print(f"export BATCHSCRIBE_HOME={stage / 'home'} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false")
    print(f"export GPU_BUNDLE_CORPUS={stage / 'corpus'} GPU_BUNDLE_PROBE={stage / 'probe-model'}")
    if (stage / "REVISION").exists():
        print(f"export BATCHSCRIBE_GIT_REVISION={(stage / 'REVISION').read_text().strip()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("command", choices=("pack", "unpack", "env"))
    ap.add_argument("--bundle", "--out", dest="bundle", type=Path, default=ROOT / ".gpu")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="the model folder to carry (default: whisper-base in the settings' "
                         "model.cache_dir)")
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("--python", default="3.12", help="the host's Python version")
    ap.add_argument("--part-mb", type=int, default=58, help="MiB per part (a call carries 64)")
    args = ap.parse_args(argv)
    if args.command == "pack":
        if args.model_dir is None:
            from app.config import Settings  # here only: the host has no pydantic before unpack

            args.model_dir = Settings().model.cache_dir / "whisper-base"
        pack(args.bundle, args.model_dir, args.corpus, args.python, args.part_mb)
    elif args.command == "unpack":
        return unpack(args.bundle)
    else:
        env(args.bundle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
