"""What a user of the installed package meets: no PyTorch, the compiled modules present,
metadata and entry points right, and a clear error when the native part is missing.

These run against whatever `import ellm` finds: the editable install while developing,
the installed wheel under cibuildwheel (which runs the suite from a scratch folder).
Checks that import things run in a fresh interpreter, so what other tests imported
cannot hide what `import ellm` pulls in.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from packaging.requirements import Requirement  # pytest depends on packaging

import ellm

# Frameworks ellm must never bring in: the point of the package is to run without them.
HEAVY = ("torch", "transformers", "tensorflow", "jax", "safetensors.torch")
# Optional extras: `import ellm` and a CPU generate must not need them.
EXTRAS = ("cupy", "starlette", "uvicorn", "fastapi", "pydantic", "prometheus_client", "ray", "PIL")
# Run-time dependencies loaded only when used: a generate without a constraint needs no llguidance.
ON_USE = ("llguidance",)
# qemu's user-mode emulator runs this Python as on an Intel Nehalem: x86-64-v2 (SSE4.2,
# POPCNT) without AVX. That is numpy 2's own baseline, so the oldest CPU the run-time
# dependencies support; ellm must pick its scalar kernels there and give the same model.
QEMU = shutil.which("qemu-x86_64")
OLD_CPU = "Nehalem-v1"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs code in a fresh interpreter of this environment, from cwd."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def loaded(names: tuple[str, ...]) -> str:
    """Code that prints, as JSON, which of these top-level modules are imported."""
    return (f"import json, sys; print(json.dumps(sorted(n for n in {list(names)!r} "
            f"if n in sys.modules)))")


def test_import_pulls_in_no_framework_and_no_extra(tmp_path: Path) -> None:
    proc = run_python("import ellm\n" + loaded(HEAVY + EXTRAS), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_generate_imports_no_torch(smollm2_gguf: Path, tmp_path: Path) -> None:
    code = f"""
import ellm
llm = ellm.load({str(smollm2_gguf)!r}, device="cpu", max_model_len=128)
out = llm.generate("The capital of France is", max_tokens=4, temperature=0.0)
assert len(out.token_ids) >= 1, out
""" + loaded(HEAVY + EXTRAS + ON_USE)
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_compiled_modules_are_inside_the_package() -> None:
    import ellm._native
    # An installed wheel has one folder; an editable install adds the build's folder.
    folders = [Path(p).resolve() for p in ellm._native.__path__]
    core = importlib.import_module("ellm._native._core")
    assert Path(core.__file__).resolve().parent in folders
    # Where the .pyx sources are shipped, each must have its compiled module.
    for pyx in sorted(p for folder in folders for p in folder.glob("*.pyx")):
        mod = importlib.import_module(f"ellm._native.{pyx.stem}")
        assert Path(mod.__file__).suffix in (".so", ".pyd"), mod.__file__


def test_metadata_and_entry_point() -> None:
    assert importlib.metadata.version("ellm-engine") == ellm.__version__
    reqs = [Requirement(r) for r in importlib.metadata.requires("ellm-engine") or []]
    assert not {r.name.lower() for r in reqs} & {"torch", "transformers", "tensorflow", "jax"}, reqs
    core = {r.name.lower() for r in reqs if r.marker is None}
    # tqdm (ellm pull's progress bar), filelock (the model cache lock) and llguidance
    # (constrained decoding) are small, torch-free and used by the core API.
    assert core == {"numpy", "tokenizers", "jinja2", "tqdm", "filelock", "llguidance"}, reqs
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("ellm") == "ellm.cli:main"


def test_python_m_ellm_info(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ellm", "info"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from ellm._native import _core
    assert f"SIMD kernels: {_core.simd_level()}" in proc.stdout
    assert _core.__file__ in proc.stdout


@pytest.mark.parametrize("value,message", [("100,abc", "expected comma-separated token counts"),
                                           ("0", "token counts must be at least 1")])
def test_bench_rejects_bad_contexts(tmp_path: Path, value: str, message: str) -> None:
    """A malformed --contexts is refused before any model is loaded, naming the option."""
    proc = subprocess.run([sys.executable, "-m", "ellm", "bench", "--contexts", value], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--contexts" in proc.stderr and message in proc.stderr


def test_missing_native_module_is_a_clear_error(tmp_path: Path) -> None:
    # A finder that refuses ellm._native._core stands in for a wheel built for another
    # platform, or a source checkout that was never compiled.
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "ellm._native._core":
            raise ImportError("simulated: no compiled module")
        return None
sys.meta_path.insert(0, Refuse())
try:
    import ellm
except ImportError as e:
    print(type(e).__name__)
    print(e)
else:
    print("imported")
"""
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, _, message = proc.stdout.partition("\n")
    assert first == "NativeModuleError"
    assert "ellm._native._core" in message and "simulated" in message
    assert "pip install" in message  # says how to get a working install


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or QEMU is None,
                    reason="needs qemu-x86_64 (Debian: apt-get install qemu-user) on x86-64")
def test_runs_on_a_cpu_without_avx(smollm2_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "logits.npy"
    code = f"""
import importlib, json, pkgutil
import numpy as np
import ellm, ellm._native
from ellm._native import _core
llm = ellm.load({str(smollm2_gguf)!r}, device="cpu", max_model_len=64)
np.save({str(out)!r}, llm.logits({PROMPT_IDS!r}))
mods = [importlib.import_module("ellm._native." + m.name)
        for m in pkgutil.iter_modules(ellm._native.__path__) if not m.name.startswith("lib")]
print(json.dumps({{"supported": _core.supported_simd_levels(),
                  "levels": sorted({{m.simd_level() for m in mods if hasattr(m, "simd_level")}})}}))
"""
    # OpenBLAS (numpy's) picks its kernels at run time and, under qemu-user on some hosts
    # (a Zen 5 one), picks AVX ones the emulated CPU lacks and dies in `import numpy`: pinned
    # to the kernels a real Nehalem gets, so what this checks is ellm's own code
    env = {**os.environ, "OPENBLAS_CORETYPE": "Nehalem"}
    proc = subprocess.run([QEMU, "-cpu", OLD_CPU, sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.splitlines()[-1])
    assert info == {"supported": ["scalar"], "levels": ["scalar"]}
    emulated = np.load(out)                                          # (5, vocab)
    native = ellm.load(str(smollm2_gguf), device="cpu", max_model_len=64).logits(PROMPT_IDS)
    # numpy and the kernels both take other code paths there, and int8 activations turn
    # last-bit differences into roundings: the tolerances of test_simd_levels.py.
    diff = emulated - native
    rel_rms = np.sqrt((diff ** 2).mean(-1)) / np.sqrt((native ** 2).mean(-1))
    assert np.abs(diff).max() <= 3.0 and rel_rms.max() <= 0.25 and rel_rms.mean() <= 0.08, \
        (np.abs(diff).max(), rel_rms)
    top2 = np.sort(native, axis=-1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) >= 1.0
    np.testing.assert_array_equal(emulated.argmax(-1)[sure], native.argmax(-1)[sure])


# ---------------------------------------------------------------------------
# The wheel build's ISA check (wheels/check_isa.py), on this checkout's build
# ---------------------------------------------------------------------------

def _check_isa_module() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "wheels" / "check_isa.py"
    spec = importlib.util.spec_from_file_location("check_isa", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _this_build(check_isa: ModuleType, tmp_path: Path) -> tuple[Path, list[Path]]:
    """The CMake build folder under build/ that made the loaded native modules (the
    editable install's, whose installed copies are stripped), and those modules."""
    from ellm._native import _core
    here = Path(_core.__file__).resolve().parent
    libs = sorted(here.glob("libellm_kernels*.so")) + [Path(_core.__file__).resolve()]
    root = Path(__file__).resolve().parents[1] / "build"
    for build in check_isa.wheel_builds(root) if root.is_dir() else []:
        if all(check_isa._with_symbols(lib, build, tmp_path) is not None for lib in libs):
            return build, libs
    pytest.skip(f"no build folder under {root} made {here} (an installed wheel)")


needs_x86_linux_binutils = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64")
    or shutil.which("objdump") is None,
    reason="the ISA check reads x86-64 ELF code with binutils")


@needs_x86_linux_binutils
def test_isa_check_passes_on_this_build(tmp_path: Path) -> None:
    """What `wheels/build.sh` runs after auditwheel: no code beyond SSE2 outside the
    variants that CMake built with ISA flags (AVX2, AVX-512, AMX ...), which must all be
    recognized as such, so the wheel build fails here first."""
    check_isa = _check_isa_module()
    build, libs = _this_build(check_isa, tmp_path)
    baseline, variants, problems = check_isa.classify(build)
    assert problems == []
    names = {o.name.split(".")[0] for o in variants}
    # every csrc file CMake gives ISA flags is a variant, by its flags (the AMX files too)
    assert {"quant_avx2", "quant_avx512", "matmul_amx", "matmul_bf16_amx"} <= names, names
    assert "dispatch" in {o.name.split(".")[0] for o in baseline}
    assert check_isa.check(build, libs) == []


@needs_x86_linux_binutils
def test_isa_check_catches_avx_in_a_baseline_object(tmp_path: Path) -> None:
    """The same check fails when an AVX2 object is declared built without ISA flags."""
    check_isa = _check_isa_module()
    (tmp_path / "scratch").mkdir()
    build, _ = _this_build(check_isa, tmp_path / "scratch")
    (obj,) = build.rglob("quant_avx2.c.o")
    fake = tmp_path / "fake" / "CMakeFiles" / "ellm_kernels.dir" / "csrc"
    fake.mkdir(parents=True)
    shutil.copy(obj, fake / obj.name)
    (dispatch,) = build.rglob("dispatch.c.o")
    shutil.copy(dispatch, fake / dispatch.name)
    commands = [{"directory": str(tmp_path / "fake"), "file": f"csrc/{o.name[:-2]}",
                 "output": f"CMakeFiles/ellm_kernels.dir/csrc/{o.name}",
                 "command": f"cc -O3 -c csrc/{o.name[:-2]} -o CMakeFiles/ellm_kernels.dir/csrc/{o.name}"}
                for o in (obj, dispatch)]
    (tmp_path / "fake" / "compile_commands.json").write_text(json.dumps(commands))
    problems = check_isa.check(tmp_path / "fake", [])
    assert problems and all("quant_avx2.c.o" in p for p in problems), problems
