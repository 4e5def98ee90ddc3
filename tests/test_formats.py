"""Parsers trust nothing: malformed safetensors and GGUF files raise FormatError, never crash."""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from ellm.formats.errors import FormatError
from ellm.formats.ggml_types import GGMLType
from ellm.formats.gguf import GGUFFile
from ellm.formats.safetensors import SafetensorsFile, SafetensorsFolder


# -- small valid files ------------------------------------------------------------------

def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], header_extra: dict | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header.update(header_extra or {})
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def small_safetensors(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    c = (rng.standard_normal((2, 5)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    write_safetensors(path, {"a": ("F32", a), "b": ("F32", b), "c": ("BF16", c)})
    return {"a": a, "b": b, "c": c}


def small_gguf(path: Path) -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.5)
    w.add_float64("test.f64", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.arr_i", [1, 2, 3])
    w.add_array("test.arr_s", ["a", "bc", ""])
    a = rng.standard_normal((4, 32)).astype(np.float32)
    h = rng.standard_normal((2, 64)).astype(np.float16)
    w.add_tensor("a", a)
    w.add_tensor("h", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"a": a, "h": h}


# -- safetensors --------------------------------------------------------------------------

def test_safetensors_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    want = small_safetensors(p)
    f = SafetensorsFile(p)
    assert f.metadata == {"format": "pt"}
    for name, arr in want.items():
        np.testing.assert_array_equal(f.array(name), arr)
    assert not f.array("a").flags.writeable  # a view into the read-only map
    assert f.array("a").base is not None


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b[:5], "truncated"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length"),
    (lambda b: b[:8] + b"{not json" + b[17:], "JSON"),
    (lambda b: b[:-8], "outside"),
])
def test_safetensors_bad_files(tmp_path: Path, mutate, needle: str) -> None:
    p = tmp_path / "m.safetensors"
    small_safetensors(p)
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(FormatError, match=needle) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("entry,needle", [
    ({"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}, "field .dtype."),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}, "field .shape."),
    ({"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 8]}, "needs"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 1 << 50]}, "outside"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "outside"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "field .shape."),
    ("nope", "not an object"),
])
def test_safetensors_bad_entries(tmp_path: Path, entry, needle: str) -> None:
    p = tmp_path / "m.safetensors"
    h = json.dumps({"x": entry}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 8)
    with pytest.raises(FormatError, match=needle):
        SafetensorsFile(p)


def test_safetensors_overlap_and_sharded_index(tmp_path: Path) -> None:
    p = tmp_path / "o.safetensors"
    h = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 12)
    with pytest.raises(FormatError, match="overlap"):
        SafetensorsFile(p)
    p.unlink()
    folder = tmp_path / "sharded"
    folder.mkdir()
    a = np.arange(6, dtype=np.float32)
    write_safetensors(folder / "model-00001-of-00002.safetensors", {"a": ("F32", a)})
    write_safetensors(folder / "model-00002-of-00002.safetensors", {"b": ("F32", a * 2)})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    st = SafetensorsFolder(folder)
    np.testing.assert_array_equal(st.array("b"), a * 2)
    index["weight_map"]["c"] = "../../etc/passwd"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError):
        SafetensorsFolder(folder)


# -- GGUF -----------------------------------------------------------------------------------

def test_gguf_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    want = small_gguf(p)
    g = GGUFFile(p)
    m = g.metadata
    assert m["test.u32"] == 7 and m["test.i64"] == -5 and m["test.f32"] == 0.5 and m["test.f64"] == 0.25
    assert m["test.bool"] is True and m["test.str"] == "héllo"
    assert list(m["test.arr_i"]) == [1, 2, 3] and m["test.arr_s"] == ["a", "bc", ""]
    assert g.tensors["a"].qtype == GGMLType.F32 and g.tensors["a"].shape == (4, 32)
    np.testing.assert_array_equal(g.array("a"), want["a"])
    np.testing.assert_array_equal(g.array("h"), want["h"])


def test_gguf_bad_headers(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    small_gguf(p)
    good = p.read_bytes()
    cases = {
        b"GGUX" + good[4:]: "not a GGUF",
        good[:4] + struct.pack("<I", 9) + good[8:]: "version",
        good[:8] + struct.pack("<Q", 1 << 40) + good[16:]: "absurd",
        good[:30]: "truncated",
        good[: len(good) - 16]: "past the end",
        b"": "truncated",
    }
    for data, needle in cases.items():
        p.write_bytes(data)
        with pytest.raises(FormatError, match=needle):
            GGUFFile(p)


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(FormatError, match="cannot open"):
        SafetensorsFile(tmp_path)  # a directory


EXTREMES = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def _fuzz(tmp_path: Path, good: bytes, parse, touch, n: int, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    ok = failed = 0
    p = tmp_path / "fuzz.bin"
    for _ in range(n):
        data = bytearray(good)
        kind = rng.integers(4)
        if kind == 0:  # flip random bytes
            for i in rng.integers(0, len(data), size=rng.integers(1, 8)):
                data[i] = int(rng.integers(256))
        elif kind == 1:  # truncate
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 2:  # overwrite an 8-byte word with an extreme value
            i = int(rng.integers(0, max(1, len(data) - 8)))
            data[i:i + 8] = struct.pack("<Q", EXTREMES[int(rng.integers(len(EXTREMES)))])
        else:  # splice a chunk elsewhere
            i, j = sorted(int(x) for x in rng.integers(0, len(data), size=2))
            data = data[:i] + data[j:] + data[i:j]
        p.write_bytes(bytes(data))
        try:
            f = parse(p)
        except FormatError:
            failed += 1
            continue
        touch(f)
        ok += 1
    return ok, failed


def test_fuzz_gguf(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    small_gguf(src)

    def touch(g: GGUFFile) -> None:
        for name, info in g.tensors.items():
            if info.qtype in (GGMLType.F32, GGMLType.F16):
                g.array(name).reshape(-1).view(np.uint8).sum()
            g.raw(name).sum()

    ok, failed = _fuzz(tmp_path, src.read_bytes(), GGUFFile, touch, 3000, seed=2)
    assert failed > 500 and ok + failed == 3000


def test_fuzz_safetensors(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    small_safetensors(src)

    def touch(f: SafetensorsFile) -> None:
        for name in f.tensors:
            f.array(name).reshape(-1).view(np.uint8).sum()

    ok, failed = _fuzz(tmp_path, src.read_bytes(), SafetensorsFile, touch, 3000, seed=3)
    assert failed > 500 and ok + failed == 3000


# -- weights moved onto 2 MiB pages (ellm.load on the CPU) ---------------------------------

def test_gguf_map_moved_onto_huge_pages_reads_the_same_bytes(smollm2_gguf: Path) -> None:
    """The in-place move changes no byte that a view made before it reads, and leaves the
    map where it was; stop_moving() before it moves nothing."""
    from ellm._native._core import MappedFile
    from ellm.formats.files import transparent_huge_pages

    m = MappedFile(str(smollm2_gguf))
    view = np.frombuffer(m, np.uint8)
    address = view.ctypes.data
    moved = m.move_to_huge_pages()
    on_linux_thp = sys.platform.startswith("linux") and transparent_huge_pages()
    if on_linux_thp:  # every whole 2 MiB piece of the ~98 MB file
        assert moved == len(m) // (2 << 20) * (2 << 20)
    else:
        assert moved == 0
    assert view.ctypes.data == address
    assert hashlib.sha256(view).digest() == hashlib.sha256(smollm2_gguf.read_bytes()).digest()
    again = MappedFile(str(smollm2_gguf))
    again.stop_moving()
    assert again.move_to_huge_pages() == 0


def test_load_moves_gguf_weights_and_decodes_the_same(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ellm.load on the CPU starts the move; greedy tokens are the same with the weights
    left on the file's pages and with them moved (the same bytes, the same kernels)."""
    import ellm
    from ellm.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(300, 340))
    started = []
    real = GGUFFile.move_onto_huge_pages

    def move_and_wait(self: GGUFFile) -> None:
        mover = real(self)
        if mover is not None:
            mover.join(timeout=120)
            assert not mover.is_alive()
        started.append(mover)

    monkeypatch.setattr(GGUFFile, "move_onto_huge_pages", move_and_wait)
    moved = ellm.load(str(smollm2_gguf), progress=False, max_model_len=256).generate(prompt, greedy)
    assert len(started) == 1
    monkeypatch.setattr(GGUFFile, "move_onto_huge_pages", lambda self: None)
    kept = ellm.load(str(smollm2_gguf), progress=False, max_model_len=256).generate(prompt, greedy)
    assert moved.token_ids == kept.token_ids and len(kept.token_ids) == 12


def test_huge_page_move_is_refused_when_asked_or_short_of_memory(smollm2_gguf: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ELLM_HUGE_PAGES=0 keeps the weights on the file's pages (shared page cache), and so
    does a machine where the private copy would take over half of the available memory."""
    from ellm.formats import files

    monkeypatch.setenv("ELLM_HUGE_PAGES", "0")
    assert GGUFFile(smollm2_gguf).move_onto_huge_pages() is None
    monkeypatch.delenv("ELLM_HUGE_PAGES")
    size = 100 << 20
    assert files.room_for_a_private_copy(size, "MemTotal: 900000 kB\nMemAvailable: 204800 kB\n")
    assert not files.room_for_a_private_copy(size, "MemTotal: 900000 kB\nMemAvailable: 204796 kB\n")
    assert not files.room_for_a_private_copy(size, "MemTotal: 900000 kB\n")   # no figure: stay put
    monkeypatch.setattr(files, "MEMINFO", smollm2_gguf.parent / "no-such-meminfo")
    assert GGUFFile(smollm2_gguf).move_onto_huge_pages() is None


def _python_strings(buf: bytes, count: int) -> tuple[list[str], int]:
    """The GGUF string-array layout read one element at a time in Python, the reference
    for the C decoder."""
    out, pos = [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", "surrogateescape"))
        pos += 8 + n
    return out, pos


def test_gguf_string_arrays_decode_in_c_as_python_does() -> None:
    from ellm._native import _core
    rng = np.random.default_rng(7)
    # valid text, empty strings, lone continuation bytes and cut-off sequences (byte tokens
    # of SentencePiece vocabularies), NULs and newlines
    pieces = [b"", b"hello", "▁über".encode(), b"\x80", b"\xe2\x96", b"a\x00b\n", "日本".encode()]
    pieces += [rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).tobytes() for _ in range(500)]
    buf = b"".join(struct.pack("<Q", len(p)) + p for p in pieces)
    want, end = _python_strings(buf, len(pieces))
    got, pos = _core.gguf_strings(buf, 0, len(pieces), 1 << 30)
    assert (got, pos) == (want, end)
    # from an offset, and fewer than all
    first = len(pieces[0]) + 8 + len(pieces[1]) + 8
    got, pos = _core.gguf_strings(buf, first, 3, 1 << 30)
    assert got == want[2:5] and pos == first + sum(8 + len(p) for p in pieces[2:5])
    # it stops before an element cut short (its length or its bytes) or over the limit
    cut = buf[:first + 8 + 3]            # the third string's length, then 3 of its 6 bytes
    assert _core.gguf_strings(cut, 0, 3, 1 << 30) == (want[:2], first)
    assert _core.gguf_strings(buf[:first + 5], 0, 3, 1 << 30) == (want[:2], first)
    assert _core.gguf_strings(buf, 0, 3, 4) == (want[:1], 8)
    assert _core.gguf_strings(b"", 0, 2, 1 << 30) == ([], 0)
    assert _core.gguf_strings(buf, len(buf) + 5, 1, 1 << 30) == ([], len(buf) + 5)
