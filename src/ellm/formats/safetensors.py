"""safetensors files and sharded folders, as zero-copy numpy views into read-only maps.

Layout: an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and [begin, end) byte range relative to the end of the header, then the data.
Everything in the header is checked against the file size before any view is made:
the header length against the bytes the file has, every dtype, shape and offset for its
type and range (an entry that is not what the format says is a FormatError naming the
tensor and the field, never a TypeError), and no two tensors may share bytes. Only
regular files are opened (see formats/files.py), so a FIFO named `*.safetensors` cannot
block the load.

The files are memory-mapped: a file truncated by another process while it is mapped
kills the process with SIGBUS on the next read past the new end. The size is checked
again before the first tensor is handed out; after that, replace model files by rename,
never truncate them in place.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import FormatError
from .files import MappedModelFile, read_regular_file

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("<f4", 4), "F16": ("<u2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("<i1", 1),
    "U8": ("<u1", 1), "BOOL": ("?", 1),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024  # model.safetensors.index.json (real ones are < 1 MB)


@dataclass(frozen=True)
class SafeTensorInfo:
    name: str
    dtype: str           # safetensors dtype name: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int          # absolute byte offset in the file
    nbytes: int


class SafetensorsFile(MappedModelFile):
    """One .safetensors file. `tensors` maps names to SafeTensorInfo; `array(name)` is a view.

    F16 and BF16 tensors are returned as uint16 bit patterns (numpy has no bf16);
    `dtype` in the info says which.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, SafeTensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        size = len(self._buf)
        if size < 8:
            raise FormatError(self.path, f"truncated: {size} bytes, need at least 8 for the header length")
        (n,) = struct.unpack_from("<Q", self._buf, 0)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise FormatError(self.path, f"header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(bytes(self._buf[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(self.path, f"header is not valid JSON ({e})") from None
        except RecursionError:
            raise FormatError(self.path, "header nests JSON too deeply") from None
        except ValueError as e:  # e.g. an integer with more digits than Python converts
            raise FormatError(self.path, f"header holds a value out of range ({e})") from None
        if not isinstance(header, dict):
            raise FormatError(self.path, "header is not a JSON object")
        data_start = 8 + n
        data_size = size - data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise FormatError(self.path, "__metadata__ is not an object of strings")
        self.metadata = dict(meta)
        spans = []
        for name, entry in header.items():
            info = self._check_entry(name, entry, data_start, data_size)
            self.tensors[name] = info
            spans.append((info.offset, info.offset + info.nbytes, name))
        spans.sort()
        for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise FormatError(self.path, f"tensors {n0!r} and {n1!r} overlap")

    def _check_entry(self, name: str, entry: object, data_start: int, data_size: int) -> SafeTensorInfo:
        if not isinstance(entry, dict):
            raise FormatError(self.path, f"tensor {name!r}: entry is not an object")
        dtype = entry.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:  # (a list or dict is unhashable)
            raise FormatError(self.path, f"tensor {name!r}: field 'dtype' is {_short(dtype)}, "
                                         f"not one of {', '.join(DTYPES)}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise FormatError(self.path, f"tensor {name!r}: field 'shape' is {_short(shape)}, "
                                         "not a list of ints >= 0")
        offsets = entry.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise FormatError(self.path, f"tensor {name!r}: field 'data_offsets' is {_short(offsets)}, "
                                         "not a list of two ints")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise FormatError(self.path, f"tensor {name!r}: data_offsets {offsets} outside the data "
                                         f"section ({data_size} bytes)")
        count = 1
        for d in shape:
            count *= d
        itemsize = DTYPES[dtype][1]
        if count * itemsize != end - begin:
            raise FormatError(self.path, f"tensor {name!r}: shape {shape} x {dtype} needs "
                                         f"{count * itemsize} bytes, data_offsets span {end - begin}")
        return SafeTensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin)

    def array(self, name: str) -> np.ndarray:
        self._first_use()
        info = self.tensors[name]
        np_dtype, itemsize = DTYPES[info.dtype]
        return np.frombuffer(self._buf, dtype=np_dtype, count=info.nbytes // itemsize,
                             offset=info.offset).reshape(info.shape)


class SafetensorsFolder:
    """All the safetensors of a model folder (one file, or shards listed by an index)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_weight_map(index)
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not shard_names:
            raise FormatError(self.folder, "no .safetensors files")
        self.files: dict[str, SafetensorsFile] = {}
        for shard in shard_names:
            if Path(shard).name != shard:
                raise FormatError(index, f"shard name {shard!r} is not a plain file name")
            self.files[shard] = SafetensorsFile(self.folder / shard)
        self.location: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for name in f.tensors:
                if name in self.location:
                    raise FormatError(f.path, f"tensor {name!r} also appears in {self.location[name].path.name}")
                self.location[name] = f
        if weight_map is not None:
            missing = [n for n, shard in weight_map.items() if n not in self.files[shard].tensors]
            if missing:
                raise FormatError(index, f"index lists tensors its shards lack: {missing[:3]}")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return list(self.location)

    def info(self, name: str) -> SafeTensorInfo:
        return self.location[name].tensors[name]

    def array(self, name: str) -> np.ndarray:
        return self.location[name].array(name)


def _short(value: object, limit: int = 60) -> str:
    """repr of a header value, cut short: the value may be megabytes of JSON."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_weight_map(index: Path) -> dict[str, str]:
    """The "weight_map" of a sharded model's index: tensor name -> shard file name."""
    try:
        doc = json.loads(read_regular_file(index, MAX_INDEX_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(index, f"invalid index ({e})") from None
    except RecursionError:
        raise FormatError(index, "invalid index (JSON nested too deeply)") from None
    except ValueError as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(index, f"invalid index ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise FormatError(index, "invalid index: field 'weight_map' is missing or not an object")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise FormatError(index, f"invalid index: weight_map[{bad!r}] is {_short(weight_map[bad])}, "
                                 "not a file name")
    return weight_map
