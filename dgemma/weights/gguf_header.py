"""A fast reader of a GGUF file's header: metadata values and tensor infos over one memory map.

`gguf.GGUFReader` builds numpy views for every part of every metadata value; on a 262,144-token vocabulary that
takes minutes. This reads the same header (format version 2 / 3, little-endian) in one pass with `struct`, and
hands each tensor out as its raw bytes (uint8, shaped [..., bytes per row]) for `gguf`'s own dequantiser.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dgemma.errors import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY, FLOAT32 = 8, 9, 6


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / torch order (GGUF lists dimensions innermost first)
    type_id: int
    data: np.ndarray  # raw bytes, uint8 [*shape[:-1], bytes per row]
    offset: int = 0  # in the file

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type id {self.type_id}"


class Header:
    """`fields` (key -> Python value; float32 values as the shortest decimal that rounds to them) and `tensors`."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            try:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise CheckpointError(f"{path.name}: not a GGUF file ({e})") from None
        self.path, self.pos = path, 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path.name}: corrupt or truncated GGUF header ({e})") from None

    def _parse(self) -> None:
        magic, version = self._take("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise CheckpointError(f"{self.path.name}: not a little-endian GGUF v2/v3 file")
        n_tensors, n_fields = self._take("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._take("<I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._take(f"<{self._take('<I')[0]}Q")
            type_id, offset = self._take("<IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), type_id, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        self.tensors = {name: self._tensor(name, shape, type_id, start + offset)
                        for name, shape, type_id, offset in infos}

    def _tensor(self, name: str, shape: tuple[int, ...], type_id: int, at: int) -> TensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            return TensorInfo(name, shape, type_id, np.empty(0, np.uint8))  # refused by name later
        if shape[-1] % block:
            raise CheckpointError(f"{self.path.name}: tensor {name} has {shape[-1]} columns, not a multiple of "
                                  f"its type's block of {block}")
        row = shape[-1] // block * size
        count = int(np.prod(shape[:-1], dtype=np.int64)) * row
        if at + count > len(self.buf):
            raise CheckpointError(f"{self.path.name}: tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(self.buf, np.uint8, count, at).reshape(*shape[:-1], row)
        return TensorInfo(name, shape, type_id, data, at)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's resident memory once it has been copied (they stay in the
        page cache): without it a load peaks at the mapped file plus the model."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        lo, hi = -(-t.offset // page) * page, (t.offset + t.data.nbytes) // page * page
        if hi > lo and hasattr(self.buf, "madvise"):
            self.buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _take(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._take("<Q")
        text = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._take("<IQ")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item in _NUMPY:
                values = np.frombuffer(self.buf, _NUMPY[item], count, self.pos)
                self.pos += values.nbytes
                return [_plain(v, item) for v in values.tolist()]
            return [self._value(item) for _ in range(count)]  # nested arrays
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return _plain(self._take(_SCALARS[kind])[0], kind)


def _plain(value: Any, kind: int) -> Any:
    return float(str(np.float32(value))) if kind == FLOAT32 else value
