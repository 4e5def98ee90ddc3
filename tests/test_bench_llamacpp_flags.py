"""benchmarks/vs_llamacpp.py --install-llamacpp: the CMake flags it builds llama.cpp with.

Each x86 extension the CPU reports is turned on by name and the rest off (a flag the CPU
lacks would build a library that dies with SIGILL), and llama.cpp's AMX path is always
off: llama-cpp-python 0.3.36's AMX matmul segfaults on the Xeons here (shared/FACTS.md).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_llamacpp.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flags_of(args: str) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args.split())


def test_sapphire_rapids_flags_keep_avx512_and_drop_amx() -> None:
    mod = load_script()
    cpu = {"avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512vbmi",
           "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    got = flags_of(mod.llamacpp_cmake_args(cpu))
    assert got["GGML_NATIVE"] == "OFF"
    for opt in ("GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI"):
        assert got[opt] == "ON", opt
    for opt in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert got[opt] == "OFF", opt


def test_avx2_only_cpu_gets_no_avx512() -> None:
    got = flags_of(load_script().llamacpp_cmake_args({"avx", "avx2", "fma", "f16c"}))
    assert got["GGML_AVX2"] == "ON" and got["GGML_FMA"] == "ON"
    assert got["GGML_AVX512"] == "OFF" and got["GGML_AVX512_VNNI"] == "OFF"
    assert got["GGML_AVX_VNNI"] == "OFF"


def test_a_gguf_path_gets_a_file_name_safe_label() -> None:
    """--models takes any GGUF path (make_random_gguf.py's files), not only known names:
    the label that names its ids file and table is the file's stem, never a path."""
    mod = load_script()
    assert mod.run_label("/data/random/llama-3.2-1b-Q4_K_M.gguf") == "llama-3.2-1b-Q4_K_M"
    assert mod.run_label("~/x/Model.GGUF") == "Model"
    assert mod.run_label("SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
