"""GGUFHeader: a GGUF file's metadata scalars and tensor index, read from its header bytes.

gguf-py's GGUFReader memory-maps the whole file and builds a numpy object for every value of
every array (SmolLM2's 49152 tokens and 48900 merges: ~6 s and ~150 MB of Python objects on 2
cores). Loading needs only a few scalars (architecture, head counts, alignment) and where each
tensor's bytes are, so this reads the header with plain buffered reads, skipping arrays.

Layout (GGUF v2/v3, little-endian):
  "GGUF", u32 version, u64 tensor_count, u64 kv_count,
  kv_count x (string key, u32 value_type, value),   string = u64 length + UTF-8 bytes,
                                                    array = u32 type + u64 count + items,
  tensor_count x (string name, u32 n_dims, n_dims x u64 ne (ne[0] = the fastest axis),
                  u32 ggml type, u64 offset from the data section),
  padding to general.alignment (default 32), then the data section.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of a scalar (8: string, 9: array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
SHORT_ARRAY = 1024  # arrays of numbers up to this length are read (per-layer values)


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes are. shape is in torch order (rows first: ne reversed)."""

    name: str
    kind: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """Scalar metadata, short arrays of numbers as lists (a per-layer pattern), longer or
    string arrays skipped with only their lengths kept, as ints (a vocabulary), and the tensor
    index, in file order."""

    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: object = None) -> object:
        """An architecture-scoped key, e.g. arch_value("attention.head_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_header(path: Path) -> GGUFHeader:
    with open(path, "rb") as file:
        if file.read(4) != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        (version,) = _unpack(file, "<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        tensor_count, kv_count = _unpack(file, "<QQ")
        metadata = {}
        for _ in range(kv_count):
            key = _string(file)
            (value_type,) = _unpack(file, "<I")
            metadata[key] = _value(file, value_type)
        infos = [_tensor_entry(file) for _ in range(tensor_count)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-file.tell() // alignment) * alignment
    tensors = tuple(
        TensorInfo(name, kind, shape, data_start + offset) for name, kind, shape, offset in infos
    )
    return GGUFHeader(metadata, tensors)


def _unpack(file: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = file.read(size)
    if len(data) != size:
        raise GGUFFormatError("truncated GGUF header")
    return struct.unpack(fmt, data)


def _string(file: BinaryIO) -> str:
    (length,) = _unpack(file, "<Q")
    data = file.read(length)
    if len(data) != length:
        raise GGUFFormatError("truncated GGUF header")
    return data.decode("utf-8", errors="replace")


def _value(file: BinaryIO, value_type: int) -> object:
    if value_type == _STRING:
        return _string(file)
    if value_type == _ARRAY:
        item_type, count = _unpack(file, "<IQ")
        if item_type in _SCALARS and count <= SHORT_ARRAY:
            return list(_unpack(file, f"<{count}{_SCALARS[item_type]}"))
        _skip_array(file, item_type, count)
        return count
    if value_type not in _SCALARS:
        raise GGUFFormatError(f"unknown GGUF metadata type {value_type}")
    return _unpack(file, "<" + _SCALARS[value_type])[0]


def _skip_array(file: BinaryIO, item_type: int, count: int) -> None:
    if item_type in _SCALARS:
        file.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
        return
    for _ in range(count):  # strings (tokens, merges) or nested arrays: variable sizes
        if item_type == _STRING:
            (length,) = _unpack(file, "<Q")
            file.seek(length, 1)
        elif item_type == _ARRAY:
            inner_type, inner_count = _unpack(file, "<IQ")
            _skip_array(file, inner_type, inner_count)
        else:
            raise GGUFFormatError(f"unknown GGUF array item type {item_type}")


def _tensor_entry(file: BinaryIO) -> tuple[str, int, tuple[int, ...], int]:
    name = _string(file)
    (n_dims,) = _unpack(file, "<I")
    ne = _unpack(file, f"<{n_dims}Q")
    kind, offset = _unpack(file, "<IQ")
    return name, kind, tuple(reversed(ne)), offset
