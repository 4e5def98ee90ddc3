"""GGUF files (versions 2 and 3): metadata and tensors as views into a read-only map.

Every length, count and offset read from the file is checked against the file size
before it is used, so a damaged file raises FormatError instead of reading past the map,
and nothing is allocated that the file's own bytes do not pay for: each count is bounded
by the bytes left (a metadata entry takes at least 13 bytes, a tensor entry 32, a string
8, a nested array 12), arrays nest at most MAX_ARRAY_DEPTH deep, and tensors must lie
inside the data section without overlapping.

The file is memory-mapped, so a file truncated by another process *while it is mapped*
makes the next read of a page past the new end raise SIGBUS, which kills the process (no
reader of a shared map can catch that). The size is checked again when a tensor is first
handed out (`raw`, `array`), which catches a truncation between opening and loading;
after that, do not truncate model files in place (replace them by rename instead).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._native import _core
from .errors import FormatError
from .files import MappedModelFile
from .ggml_types import BLOCK_LAYOUT, GGMLType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Bounds that no real file comes near; they stop absurd counts before any allocation.
MAX_STRING_BYTES = 1 << 30
MAX_KV_COUNT = 1 << 20
MAX_TENSOR_COUNT = 1 << 20
# Arrays of arrays: no known writer makes them deeper than this; bounding the depth keeps
# the parser's recursion far from Python's limit.
MAX_ARRAY_DEPTH = 3
# Arrays inside arrays, over the whole file: each costs a Python object (~100 bytes) for
# 12 bytes of file, so millions of empty ones would cost gigabytes. Real files have none.
MAX_NESTED_ARRAYS = 1 << 12
# The fewest bytes one entry of each kind takes in the file (the counts are checked
# against the bytes left before anything is built).
_MIN_KV_BYTES = 8 + 4 + 1           # key length, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, rank, one dim, type, offset
_MIN_ELEMENT_BYTES = {8: 8, 9: 4 + 8}  # a string's length; a nested array's type + count

# metadata value type -> (struct format, size) for the scalar types
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_SCALAR_DTYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the last dimension is contiguous (GGUF's ne[0])
    qtype: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Reads little-endian values from the map, refusing to step past its end."""

    def __init__(self, path: Path, buf: memoryview) -> None:
        self.path, self.buf, self.pos = path, buf, 0
        self.depth = 0  # arrays open around the value being read
        self.nested_arrays = 0  # arrays read inside other arrays so far

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(self.path, f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                                         f"file has {len(self.buf)}")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > MAX_STRING_BYTES or n > self.remaining():
            raise FormatError(self.path, f"{what} claims {n} bytes, more than the {self.remaining()} "
                                         "bytes left in the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold byte tokens that are not valid UTF-8 on their own.
            return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings one after the other: `string`'s checks and errors, decoded in C
        (a vocabulary is 100k-260k of them: Gemma 3's took 0.6 s through `string`)."""
        out, pos = _core.gguf_strings(self.buf, self.pos, count, MAX_STRING_BYTES)
        self.pos = pos
        if len(out) < count:   # the decoder stopped before element len(out): name its fault
            i = len(out)
            self.need(8, f"{what}[{i}] length")
            (n,) = _U64.unpack_from(self.buf, pos)
            raise FormatError(self.path, f"{what}[{i}] claims {n} bytes, more than the "
                                         f"{len(self.buf) - pos - 8} bytes left in the file")
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise FormatError(self.path, f"{what} has unknown value type {vtype}")

    def array(self, what: str) -> Any:
        if self.depth >= MAX_ARRAY_DEPTH:
            raise FormatError(self.path, f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        if self.depth:
            self.nested_arrays += 1
            if self.nested_arrays > MAX_NESTED_ARRAYS:
                raise FormatError(self.path, f"{what}: more than {MAX_NESTED_ARRAYS} arrays inside arrays")
        etype = self.u32(f"{what} element type")
        count = self.u64(f"{what} element count")
        if etype in _SCALAR_DTYPES:
            size = _SCALARS[etype][1]
            if count * size > self.remaining():
                raise FormatError(self.path, f"{what} claims {count} elements of {size} bytes, "
                                             f"more than the {self.remaining()} bytes left in the file")
            arr = np.frombuffer(self.buf, dtype=_SCALAR_DTYPES[etype], count=count, offset=self.pos)
            self.pos += count * size
            return arr
        if etype in _MIN_ELEMENT_BYTES:
            if count * _MIN_ELEMENT_BYTES[etype] > self.remaining():
                raise FormatError(self.path, f"{what} claims {count} elements, more than the "
                                             f"{self.remaining()} bytes left in the file hold")
            if etype == _STRING:
                return self.strings(count, what)
            self.depth += 1
            try:
                return [self.value(etype, f"{what}[{i}]") for i in range(count)]
            finally:
                self.depth -= 1
        raise FormatError(self.path, f"{what} has unknown element type {etype}")


class GGUFFile(MappedModelFile):
    """A parsed GGUF file. `metadata` maps keys to values (arrays of numbers are numpy
    arrays, arrays of strings are lists); `tensors` maps names to TensorInfo."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        c = _Cursor(self.path, self._buf)
        c.need(4, "magic")
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise FormatError(self.path, f"not a GGUF file (magic {bytes(self._buf[:4])!r})")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            raise FormatError(self.path, f"unsupported GGUF version {self.version} (2 and 3 are)")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        if n_tensors > MAX_TENSOR_COUNT or n_kv > MAX_KV_COUNT:
            raise FormatError(self.path, f"absurd counts: {n_tensors} tensors, {n_kv} metadata keys")
        if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > c.remaining():
            raise FormatError(self.path, f"truncated or corrupt: tensor count {n_tensors} and metadata "
                                         f"count {n_kv} need more "
                                         f"than the {c.remaining()} bytes left in the file")
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.u32(f"type of {key!r}")
            self.metadata[key] = c.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name")
            n_dims = c.u32(f"tensor {name!r} rank")
            if not 1 <= n_dims <= MAX_DIMS:
                raise FormatError(self.path, f"tensor {name!r} has rank {n_dims}")
            dims = [c.u64(f"tensor {name!r} dim") for _ in range(n_dims)]
            raw_type = c.u32(f"tensor {name!r} type")
            offset = c.u64(f"tensor {name!r} offset")
            infos.append((name, dims, raw_type, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise FormatError(self.path, f"general.alignment {alignment!r} is not a power of two")
        self.alignment = alignment
        self.data_offset = -(-c.pos // alignment) * alignment
        for name, dims, raw_type, offset in infos:
            self.tensors[name] = self._check_tensor(name, dims, raw_type, offset)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:]):
            if begin1 < end0:
                raise FormatError(self.path, f"tensors {name0!r} and {name1!r} overlap (bytes "
                                             f"{begin1}..{end0} belong to both)")

    def _check_tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLType(raw_type)
        except ValueError:
            raise FormatError(self.path, f"tensor {name!r} has unknown type {raw_type}") from None
        if qtype not in BLOCK_LAYOUT:
            raise FormatError(self.path, f"tensor {name!r} has unsupported type {qtype.name}")
        if name in self.tensors:
            raise FormatError(self.path, f"tensor {name!r} appears twice")
        if offset > self.file_size:
            raise FormatError(self.path, f"tensor {name!r} offset {offset} is past the end of the "
                                         f"file ({self.file_size})")
        if any(d <= 0 for d in dims):
            raise FormatError(self.path, f"tensor {name!r} has shape {dims}")
        n = 1
        for d in dims:
            n *= d
            if n > self.file_size * 8:  # even 1-bit weights could not fit
                raise FormatError(self.path, f"tensor {name!r} shape {dims} is larger than the file")
        blk, bsize = BLOCK_LAYOUT[qtype]
        if dims[0] % blk:
            raise FormatError(self.path, f"tensor {name!r}: row of {dims[0]} is not a whole number "
                                         f"of {qtype.name} blocks ({blk})")
        nbytes = n // blk * bsize
        if offset % self.alignment:
            raise FormatError(self.path, f"tensor {name!r} offset {offset} is not aligned")
        start = self.data_offset + offset
        if start + nbytes > self.file_size:
            raise FormatError(self.path, f"tensor {name!r} ends at byte {start + nbytes}, past the "
                                         f"end of the file ({self.file_size})")
        return TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a (rows, row_bytes) uint8 view into the map."""
        self._first_use()
        info = self.tensors[name]
        rows = info.n_elements // info.shape[-1]
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes,
                             offset=info.offset).reshape(rows, info.nbytes // rows)

    def array(self, name: str) -> np.ndarray:
        """A plain-dtype tensor (F32, F16, BF16 as uint16, ints) as a zero-copy view."""
        self._first_use()
        info = self.tensors[name]
        dtypes = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.BF16: "<u2",
                  GGMLType.F64: "<f8", GGMLType.I8: "<i1", GGMLType.I16: "<i2",
                  GGMLType.I32: "<i4", GGMLType.I64: "<i8"}
        if info.qtype not in dtypes:
            raise TypeError(f"{name} is {info.qtype.name}: use raw() or dequantize()")
        return np.frombuffer(self._buf, dtype=dtypes[info.qtype], count=info.n_elements,
                             offset=info.offset).reshape(info.shape)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array of its logical shape."""
        from .dequant import dequantize
        info = self.tensors[name]
        raw = self.raw(name)
        try:
            return dequantize(raw, info.qtype, info.shape)
        except ValueError as e:  # a valid file with a type the kernels do not convert
            raise FormatError(self.path, f"tensor {name!r} ({info.qtype.name}) cannot be dequantized: {e}") from None

    def drop_metadata(self, prefix: str) -> None:
        """Forgets metadata keys starting with prefix (the vocabulary, once a tokenizer
        has been built from it, is the bulk of a file's metadata)."""
        for key in [k for k in self.metadata if k.startswith(prefix)]:
            del self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"
