"""What a CTranslate2 ``model.bin`` says about itself, read from its header without loading it.

The layout is CTranslate2's own (``src/models/model.cc``, ``load_model``; written by
``python/ctranslate2/specs/model_spec.py``): a uint32 binary version, the spec name and its
revision, a uint32 variable count, then per variable its name, rank, uint32 dimensions, a
uint8 type id, a uint32 byte count and the bytes; strings are a uint16 length (with the final
NUL) and the characters. Walking it seeks past every payload, so reading the facts of a 3 GB
large-v3 costs a few hundred small reads, and a truncated file is caught before CTranslate2
spends seconds loading it.

Why the header and not the folder's other files: ``preprocessor_config.json`` is optional (the
PyPI whisper-base has none) and faster-whisper then assumes 80 mel bins, while large-v3 and
turbo take 128; the encoder's first convolution (``encoder/conv1/weight``, shape
``[d_model, n_mels, 3]``) is what the model actually takes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# CTranslate2's DataType enum, in order (include/ctranslate2/types.h).
DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
SUPPORTED_BINARY_VERSION = 6  # what CTranslate2 4.x writes and reads (current_binary_version)


class ModelFileError(ValueError):
    """model.bin is not a readable CTranslate2 Whisper model; the message says what is wrong."""


@dataclass(frozen=True)
class ModelFacts:
    spec: str  # "WhisperSpec" for every Whisper model
    n_mels: int  # mel bins the encoder takes: 80 (tiny..large-v2, distil-v2), 128 (large-v3, turbo)
    d_model: int  # width of encoder and decoder
    encoder_layers: int
    decoder_layers: int
    vocab: int
    weight_dtype: str  # how the weights are stored: float16, int8, ...
    size_bytes: int


def _read(f: BinaryIO, fmt: str, what: str, size: int) -> tuple[int, ...]:
    n = struct.calcsize(fmt)
    at = f.tell()
    data = f.read(n)
    if len(data) != n:
        raise ModelFileError(f"model.bin is truncated: {what} at byte {at} runs past its end "
                             f"({size} bytes)")
    return struct.unpack(fmt, data)


def _string(f: BinaryIO, size: int) -> str:
    (length,) = _read(f, "<H", "a name's length", size)
    if length == 0:
        raise ModelFileError("model.bin is corrupt: a variable name of length 0")
    at = f.tell()
    raw = f.read(length)
    if len(raw) != length:
        raise ModelFileError(f"model.bin is truncated: a name at byte {at} runs past its end "
                             f"({size} bytes)")
    return raw[:-1].decode("utf-8", errors="replace")


def read_facts(path: Path) -> ModelFacts:
    """The facts of the Whisper model in ``path`` (a folder or its model.bin).

    Raises :class:`ModelFileError` for a file that is truncated, of a binary version CTranslate2
    4.x cannot read, or not a Whisper model."""
    model_bin = path / "model.bin" if path.is_dir() else path
    size = model_bin.stat().st_size
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, int] = {}
    with model_bin.open("rb") as f:
        (version,) = _read(f, "<I", "the binary version", size)
        if not 2 <= version <= SUPPORTED_BINARY_VERSION:
            raise ModelFileError(f"model.bin has binary version {version}; CTranslate2 4.x reads "
                                 f"versions 2..{SUPPORTED_BINARY_VERSION} (not a CTranslate2 "
                                 "model, or a corrupt one)")
        spec = _string(f, size)
        _read(f, "<I", "the spec revision", size)
        (count,) = _read(f, "<I", "the variable count", size)
        for _ in range(count):
            name = _string(f, size)
            (rank,) = _read(f, "<B", f"the rank of {name}", size)
            dims = _read(f, f"<{rank}I", f"the shape of {name}", size) if rank else ()
            type_id, nbytes = _read(f, "<BI", f"the type of {name}", size)
            end = f.tell() + nbytes
            if end > size:
                raise ModelFileError(f"model.bin is truncated: variable {name!r} needs {nbytes} "
                                     f"bytes up to byte {end}, the file has {size}")
            f.seek(end)
            shapes[name] = tuple(dims)
            dtypes[name] = type_id
    if spec != "WhisperSpec" or "encoder/conv1/weight" not in shapes:
        raise ModelFileError(f"model.bin holds a {spec!r} model, not a CTranslate2 Whisper model")
    d_model, n_mels, _ = shapes["encoder/conv1/weight"]
    vocab = shapes.get("decoder/embeddings/weight", (0,))[0]
    dtype = dtypes.get("decoder/embeddings/weight", dtypes["encoder/conv1/weight"])
    return ModelFacts(
        spec=spec, n_mels=n_mels, d_model=d_model,
        encoder_layers=_layers(shapes, "encoder"), decoder_layers=_layers(shapes, "decoder"),
        vocab=vocab, weight_dtype=DTYPES[dtype] if dtype < len(DTYPES) else f"type{dtype}",
        size_bytes=size,
    )


def _layers(shapes: dict[str, tuple[int, ...]], stack: str) -> int:
    prefix = f"{stack}/layer_"
    ids = {name[len(prefix):].split("/", 1)[0] for name in shapes if name.startswith(prefix)}
    return sum(1 for i in ids if i.isdigit())  # not "layer_norm", the stack's final norm
