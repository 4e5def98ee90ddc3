"""Hostile model files: every malformed GGUF / safetensors gives FormatError naming the file
and the field, quickly and in memory proportional to the file's real size; a FIFO or a
device never blocks the load; a file truncated after it was mapped is refused before a
read could raise SIGBUS.

The files are made byte by byte here (a writer library would refuse to make them); the
good ones are checked against the `gguf` package's own reader and dequantizer.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ellm.formats.errors import FormatError
from ellm.formats.ggml_types import GGMLType
from ellm.formats.gguf import MAX_ARRAY_DEPTH, GGUFFile
from ellm.formats.safetensors import SafetensorsFile, SafetensorsFolder

U8, U32, STRING, ARRAY, U64 = 0, 4, 8, 9, 10


# -- raw GGUF bytes -------------------------------------------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def gguf_bytes(kvs: list[bytes], tensors: list[tuple[str, list[int], int, int]], data: bytes = b"",
               *, n_kv: int | None = None, n_tensors: int | None = None, align: int = 32) -> bytes:
    """A GGUF v3 file: header, metadata entries (already encoded), tensor infos (name, dims
    in GGUF order, ggml type, offset), padding to `align`, then `data`."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = b"".join(kvs)
    for name, dims, qtype, offset in tensors:
        body += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        body += struct.pack("<IQ", qtype, offset)
    out = head + body
    out += b"\0" * (-len(out) % align)
    return out + data


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def refused(parse: Callable[[Path], object], path: Path, needle: str, *, max_mb: float = 64.0) -> FormatError:
    """parse(path) must raise FormatError naming the file and matching needle, without
    allocating more than max_mb of Python memory on the way."""
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=needle) as e:
            parse(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < max_mb * 2**20, f"{peak / 2**20:.0f} MB allocated to refuse {path.name}"
    assert str(path) in str(e.value)
    return e.value


# -- GGUF: counts and lengths are paid for by the file's bytes -------------------------------

@pytest.mark.parametrize("payload,needle", [
    # an array of 2**40 strings in a file of a few dozen bytes
    (struct.pack("<IQ", STRING, 1 << 40), "claims 1099511627776 elements"),
    # ten million empty arrays, each of which would be a Python object
    (struct.pack("<IQ", ARRAY, 10_000_000) + struct.pack("<IQ", U8, 0) * 4, "claims 10000000 elements"),
    # 2**61 u64 values: count * 8 overflows nothing in Python, but must not reach numpy
    (struct.pack("<IQ", U64, 1 << 61), "claims 2305843009213693952 elements"),
    # a string longer than the file
    (struct.pack("<IQ", STRING, 1) + struct.pack("<Q", 1 << 33), "claims 8589934592 bytes"),
])
def test_gguf_array_counts_bounded_by_file(tmp_path: Path, payload: bytes, needle: str) -> None:
    p = write(tmp_path, gguf_bytes([kv("bad.array", ARRAY, payload)], []))
    err = refused(GGUFFile, p, needle)
    assert "bad.array" in str(err)


def test_gguf_string_array_cut_short_names_the_element(tmp_path: Path) -> None:
    # three strings announced, room for their lengths, but the file ends in the third's length
    strings = struct.pack("<Q", 10) + b"x" * 10 + struct.pack("<Q", 2) + b"ok"
    data = gguf_bytes([kv("cut.strings", ARRAY, struct.pack("<IQ", STRING, 3) + strings)], [])
    end = data.index(strings) + len(strings) + 4
    err = refused(GGUFFile, write(tmp_path, data[:end]), "truncated")
    assert "'cut.strings'[2] length" in str(err)
    # the second string claims more bytes than are left
    payload = struct.pack("<IQ", STRING, 3) + struct.pack("<Q", 1) + b"x" + struct.pack("<Q", 99) + b"\0" * 16
    err = refused(GGUFFile, write(tmp_path, gguf_bytes([kv("long.string", ARRAY, payload)], [])), "claims 99 bytes")
    assert "'long.string'[1]" in str(err)


def test_gguf_many_nested_arrays_refused_in_bounded_memory(tmp_path: Path) -> None:
    # 200k real empty arrays inside one array (2.4 MB of file): more than any file has
    n = 200_000
    payload = struct.pack("<IQ", ARRAY, n) + struct.pack("<IQ", U8, 0) * n
    p = write(tmp_path, gguf_bytes([kv("many.empty", ARRAY, payload)], []))
    err = refused(GGUFFile, p, "arrays inside arrays", max_mb=32)
    assert "many.empty" in str(err)


def test_gguf_nesting_depth_is_bounded_not_a_recursion_error(tmp_path: Path) -> None:
    for depth in (MAX_ARRAY_DEPTH + 1, 50_000):
        payload = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U8, 0)
        p = write(tmp_path, gguf_bytes([kv("deep", ARRAY, payload)], []))
        refused(GGUFFile, p, "nested more than")
    # the deepest allowed still parses, to the right value
    payload = struct.pack("<IQ", ARRAY, 1) * (MAX_ARRAY_DEPTH - 1) + struct.pack("<IQ", U8, 2) + b"\x07\x09"
    g = GGUFFile(write(tmp_path, gguf_bytes([kv("deep", ARRAY, payload)], [])))
    v = g.metadata["deep"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        assert isinstance(v, list) and len(v) == 1
        v = v[0]
    assert v.tolist() == [7, 9]


@pytest.mark.parametrize("n_tensors,n_kv", [(1 << 20, 0), (0, 1 << 20), (100_000, 100_000), (1 << 19, 1 << 19)])
def test_gguf_entry_counts_bounded_by_file(tmp_path: Path, n_tensors: int, n_kv: int) -> None:
    p = write(tmp_path, gguf_bytes([kv("a", U8, b"\x01")], [], n_kv=n_kv, n_tensors=n_tensors))
    refused(GGUFFile, p, "need more than")


def test_gguf_unknown_value_types(tmp_path: Path) -> None:
    refused(GGUFFile, write(tmp_path, gguf_bytes([kv("x", 99, b"")], [])), "unknown value type 99")
    refused(GGUFFile, write(tmp_path, gguf_bytes([kv("x", ARRAY, struct.pack("<IQ", 13, 1))], [])),
            "unknown element type 13")


# -- GGUF: tensors inside the data section, without overlap ---------------------------------

def _q8_0_rows(rng: np.random.Generator, rows: int, k: int) -> bytes:
    """Valid Q8_0 blocks: an f16 scale then 32 int8 values per block."""
    out = bytearray()
    for _ in range(rows * k // 32):
        out += np.float16(rng.uniform(0.01, 0.1)).tobytes() + rng.integers(-127, 128, 32, dtype=np.int8).tobytes()
    return bytes(out)


def test_gguf_tensor_ending_exactly_at_eof_of_a_page_multiple_file(tmp_path: Path) -> None:
    """The last tensor's last byte is the file's last byte and the file ends on a page
    boundary, so any read past the tensor would fault: loading, dequantizing and a matmul
    must all stay inside (checked against the gguf package's dequantizer)."""
    gguf = pytest.importorskip("gguf")
    from ellm.formats.dequant import dequantize
    from ellm.ops import get_ops
    from ellm.weights import Linear

    rng = np.random.default_rng(0)
    k = 256
    page = os.sysconf("SC_PAGESIZE")
    head = len(gguf_bytes([], [("w", [k, 1], int(GGMLType.Q8_0), 0)]))
    row = k // 32 * 34
    # rows chosen so that header + data is a whole number of pages
    rows = next(r for r in range(1, 4096) if (head + r * row) % page == 0)
    data = _q8_0_rows(rng, rows, k)
    p = write(tmp_path, gguf_bytes([], [("w", [k, rows], int(GGMLType.Q8_0), 0)], data))
    assert p.stat().st_size % page == 0
    g = GGUFFile(p)
    info = g.tensors["w"]
    assert info.offset + info.nbytes == p.stat().st_size
    want = gguf.quants.dequantize(np.frombuffer(data, np.uint8).reshape(rows, row), gguf.GGMLQuantizationType.Q8_0)
    got = g.dequantize("w")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dequantize(g.raw("w")[-1:], GGMLType.Q8_0, (1, k)), want[-1:])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = get_ops("cpu").linear(x, Linear(g.raw("w"), GGMLType.Q8_0, rows, k, "w"))
    np.testing.assert_allclose(y, x @ want.T, rtol=0.05, atol=0.05 * float(np.abs(x @ want.T).max()))


@pytest.mark.parametrize("extra", [1, 31, 32, 4096])
def test_gguf_tensor_past_eof(tmp_path: Path, extra: int) -> None:
    data = np.arange(64, dtype=np.float32).tobytes()
    # claims 64 + extra/4 floats (rounded up to whole floats) over 64 floats of data
    n = 64 + -(-extra // 4)
    p = write(tmp_path, gguf_bytes([], [("t", [n], int(GGMLType.F32), 0)], data))
    refused(GGUFFile, p, "past the end")
    # the same tensor at the right size loads and reads back
    ok = GGUFFile(write(tmp_path, gguf_bytes([], [("t", [64], int(GGMLType.F32), 0)], data), "ok.gguf"))
    np.testing.assert_array_equal(ok.array("t"), np.arange(64, dtype=np.float32))


@pytest.mark.parametrize("offsets", [(0, 0), (0, 32), (64, 0), (32, 64)])
def test_gguf_overlapping_tensors(tmp_path: Path, offsets: tuple[int, int]) -> None:
    data = bytes(256)
    # two 96-byte tensors (24 floats): any of these offset pairs makes them share bytes
    tensors = [("a", [24], int(GGMLType.F32), offsets[0]), ("b", [24], int(GGMLType.F32), offsets[1])]
    refused(GGUFFile, write(tmp_path, gguf_bytes([], tensors, data)), "overlap")


def test_gguf_adjacent_tensors_are_fine(tmp_path: Path) -> None:
    data = np.arange(64, dtype=np.float32).tobytes()
    tensors = [("a", [32], int(GGMLType.F32), 0), ("b", [32], int(GGMLType.F32), 128)]
    g = GGUFFile(write(tmp_path, gguf_bytes([], tensors, data)))
    np.testing.assert_array_equal(g.array("b"), np.arange(32, 64, dtype=np.float32))


# -- safetensors ------------------------------------------------------------------------------

def st_bytes(header: dict | str | bytes, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("dtype", [[], {}, None, 5, ["F32"], "f32", "", True])
def test_safetensors_dtype_of_any_json_type(tmp_path: Path, dtype: object) -> None:
    p = write(tmp_path, st_bytes({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
              "m.safetensors")
    err = refused(SafetensorsFile, p, "field 'dtype'")
    assert "'w'" in str(err)


@pytest.mark.parametrize("field,value", [("shape", {"a": 1}), ("shape", [True]), ("shape", [2.0]),
                                         ("shape", None), ("data_offsets", [0]), ("data_offsets", "0,8"),
                                         ("data_offsets", [0.0, 8.0]), ("data_offsets", [[0], [8]])])
def test_safetensors_fields_of_wrong_type(tmp_path: Path, field: str, value: object) -> None:
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], field: value}
    p = write(tmp_path, st_bytes({"w": entry}, bytes(8)), "m.safetensors")
    refused(SafetensorsFile, p, f"field '{field}'")


@pytest.mark.parametrize("header,needle", [
    ("[" * 200_000 + "]" * 200_000, "nests JSON too deeply|not valid JSON"),
    ('{"w": ' * 100_000 + "1" + "}" * 100_000, "nests JSON too deeply|not valid JSON"),
    ('{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 8]}}', "out of range"),
    ('{"__metadata__": {"a": 1}}', "__metadata__"),
    ('{"__metadata__": {"a": ["x"]}}', "__metadata__"),
])
def test_safetensors_hostile_headers(tmp_path: Path, header: str, needle: str) -> None:
    refused(SafetensorsFile, write(tmp_path, st_bytes(header, bytes(8)), "m.safetensors"), needle)


@pytest.mark.parametrize("index,needle", [
    ({"weight_map": {"a": ["x.safetensors"]}}, r"weight_map\['a'\]"),
    ({"weight_map": {"a": {"f": 1}}}, r"weight_map\['a'\]"),
    ({"weight_map": ["a"]}, "field 'weight_map'"),
    ([1, 2], "field 'weight_map'"),
    ("[" * 100_000, "invalid index"),
])
def test_safetensors_hostile_index(tmp_path: Path, index: object, needle: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    refused(SafetensorsFolder, tmp_path, needle)


# -- files that are not regular files ---------------------------------------------------------

def _finishes(fn: Callable[[], object], fifo: Path, seconds: float = 10.0) -> BaseException | None:
    """Runs fn in a thread; if it is still blocked after `seconds`, opens the FIFO for
    writing to release it and fails the test."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail(f"{fn} blocked on the FIFO {fifo}")
    return box[0]


def test_fifo_named_like_a_gguf_does_not_block(tmp_path: Path) -> None:
    from ellm._native._core import MappedFile

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    err = _finishes(lambda: GGUFFile(fifo), fifo)
    assert isinstance(err, FormatError) and "FIFO" in str(err) and str(fifo) in str(err)
    # the C map itself refuses it without blocking (a path swapped after the check)
    err = _finishes(lambda: MappedFile(str(fifo)), fifo)
    assert isinstance(err, OSError)


def test_fifo_in_a_safetensors_folder_does_not_block(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    err = _finishes(lambda: SafetensorsFolder(tmp_path), fifo)
    assert isinstance(err, FormatError) and "FIFO" in str(err)
    os.unlink(fifo)
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    err = _finishes(lambda: SafetensorsFolder(tmp_path), index)
    assert isinstance(err, FormatError) and "FIFO" in str(err)


def test_character_device_is_refused(tmp_path: Path) -> None:
    # /dev/zero never ends: reading it as a model would take all memory
    for parse in (GGUFFile, SafetensorsFile):
        with pytest.raises(FormatError, match="character device"):
            parse("/dev/zero")


def test_ellm_load_of_a_fifo_does_not_block(tmp_path: Path) -> None:
    import ellm

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    err = _finishes(lambda: ellm.load(fifo, progress=False), fifo)
    assert isinstance(err, (FormatError, FileNotFoundError)) and str(fifo) in str(err)


# -- a file truncated after it was mapped -----------------------------------------------------

def test_gguf_truncated_after_open_is_refused_before_first_read(tmp_path: Path) -> None:
    data = np.arange(4096, dtype=np.float32).tobytes()
    p = write(tmp_path, gguf_bytes([], [("t", [4096], int(GGMLType.F32), 0)], data))
    g = GGUFFile(p)
    os.truncate(p, 100)
    with pytest.raises(FormatError, match="truncated to 100 bytes"):
        g.array("t")
    with pytest.raises(FormatError, match="truncated"):
        g.raw("t")
    p.unlink()
    with pytest.raises(FormatError, match="changed since it was opened"):
        g.check_size()


def test_safetensors_truncated_after_open_is_refused_before_first_read(tmp_path: Path) -> None:
    data = np.arange(1024, dtype=np.float32).tobytes()
    p = write(tmp_path, st_bytes({"t": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}, data),
              "m.safetensors")
    f = SafetensorsFile(p)
    os.truncate(p, 64)
    with pytest.raises(FormatError, match="truncated to 64 bytes"):
        f.array("t")
    # growing is harmless (the map keeps its size)
    p.write_bytes(st_bytes({"t": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}, data) + b"x" * 10)
    f2 = SafetensorsFile(p)
    with open(p, "ab") as fh:
        fh.write(b"more")
    np.testing.assert_array_equal(f2.array("t"), np.arange(1024, dtype=np.float32))


@pytest.mark.parametrize("qtype,k", [(GGMLType.Q8_1, 32), (GGMLType.Q8_K, 256), (GGMLType.I32, 4), (GGMLType.F64, 4)])
def test_gguf_types_the_kernels_cannot_dequantize(tmp_path: Path, qtype: GGMLType, k: int) -> None:
    # (found by tests/fuzz/fuzz_readers.py gguf: a ValueError from the kernel, not FormatError)
    from ellm.formats.ggml_types import row_bytes

    data = bytes(row_bytes(qtype, k))
    g = GGUFFile(write(tmp_path, gguf_bytes([], [("t", [k], int(qtype), 0)], data)))
    with pytest.raises(FormatError, match=f"tensor 't' \\({qtype.name}\\) cannot be dequantized"):
        g.dequantize("t")
    assert g.raw("t").nbytes == len(data)
