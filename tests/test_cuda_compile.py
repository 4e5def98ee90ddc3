"""The CUDA kernels compile, on machines without a GPU: every csrc/cuda/*.cu through
nvcc to PTX for sm_80 (Ampere) and sm_90 (Hopper) with warnings as errors, every
kernel ops/cuda.py launches is an entry of that PTX, and ptxas assembles both without
register spills (the fused decode kernels without any stack frame); each unit ops/cuda.py
compiles (linear.cu and mmv.cu a weight type at a time) makes exactly its own kernels.
Optionally also through NVRTC (the compiler CuPy uses at run time), unit by unit, when a
libnvrtc is found. nvcc's and ptxas's output for a file compiled cleanly before (the same
text, tools and arguments) comes from ~/.cache/ellm/nvcc_check; the checks run on it as
on a fresh compile.

Skipped, saying why, when nvcc is not installed (the GPU tests are tests/test_cuda.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ellm.ops import cuda as cuda_ops
from ellm.ops import cuda_kernels

NVCC = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
ARCHS = ("sm_80", "sm_90")
PTXAS = (shutil.which("ptxas") or str(Path(NVCC).resolve().parent / "ptxas")) if NVCC else None
# the kernels of the fused decode path (ops/fused_stack.py through ops/cuda.py) and the
# tensor-core prefill attention: no stack frame at all
FUSED_DECODE_KERNELS = ("nmv3_", "glu_", "gemv_add_", "qkv_rope_", "attn_decode", "mmv", "attn_prefill", "moe_glu_",
                        "moe_down_")
# the files of mmv.cu's decode products (moe.cu: the same with the expert chosen on the device)
MMV_FILES = ("mmv.cu", "moe.cu")
SOURCES = sorted(cuda_kernels.kernel_dir().glob("*.cu"))


def _nvdisasm() -> str | None:
    """nvdisasm (SASS from a cubin): on PATH, beside nvcc, or from the pip wheel
    nvidia-cuda-nvdisasm (the [test] extras on Linux x86-64)."""
    beside = Path(NVCC).resolve().parent / "nvdisasm" if NVCC else None
    wheels = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "bin", "nvdisasm")))
    return shutil.which("nvdisasm") or (str(beside) if beside and beside.is_file() else None) or \
        (wheels[-1] if wheels else None)


NVDISASM = _nvdisasm()

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed; "
                                                     "the kernels' compile check needs it")


def test_every_kernel_file_is_known_to_ops_cuda() -> None:
    assert {p.name for p in SOURCES} == set(cuda_kernels.KERNELS), \
        "csrc/cuda/*.cu and ops/cuda_kernels.py KERNELS disagree"


def _nvcc_and_ptxas(source: Path, arch: str, out: Path) -> tuple[subprocess.CompletedProcess, str,
                                                                   subprocess.CompletedProcess | None,
                                                                   dict[str, int] | None,
                                                                   dict[str, list[int]] | None]:
    """nvcc's PTX of one file for one architecture, then ptxas over it (None when nvcc
    failed), and where nvdisasm is found, each kernel's weight loads in flight in ptxas's
    SASS (_weight_loads_in_flight) and its groups of loads (_load_groups; both None
    without nvdisasm). What they said of a text they
    compiled cleanly before is kept on disk (see _compile_cache), since mmv.cu alone is a
    minute of this machine's two cores."""
    ptx = out / f"{source.stem}-{arch}.ptx"
    nvcc_args = ["--ptx", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings"]
    ptxas_args = [f"-arch={arch}", "-v", "-warn-spills", "-Werror"]
    kept = _compile_cache(source, nvcc_args, ptxas_args)
    if kept.is_file():
        done = json.loads(kept.read_text())
        if NVDISASM is None or "load_groups" in done:   # (else kept before nvdisasm was found: again)
            return (subprocess.CompletedProcess(done["nvcc"][0], 0, done["nvcc"][1], done["nvcc"][2]), done["ptx"],
                    subprocess.CompletedProcess(done["ptxas"][0], 0, done["ptxas"][1], done["ptxas"][2]),
                    done.get("in_flight"), done.get("load_groups"))
    nvcc = subprocess.run([NVCC, *nvcc_args, "-o", str(ptx), str(source)], capture_output=True, text=True,
                          timeout=900)
    if nvcc.returncode != 0:
        return nvcc, "", None, None, None
    cubin = out / f"{source.stem}-{arch}.cubin"
    ptxas = subprocess.run([PTXAS, *ptxas_args, "-o", str(cubin), str(ptx)], capture_output=True, text=True,
                           timeout=900)
    in_flight = load_groups = None
    if ptxas.returncode == 0 and NVDISASM is not None:
        sass = subprocess.run([NVDISASM, str(cubin)], capture_output=True, text=True, timeout=900)
        assert sass.returncode == 0, sass.stderr
        in_flight = _weight_loads_in_flight(sass.stdout)
        load_groups = _load_groups(sass.stdout)
    if ptxas.returncode == 0:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        done = {"nvcc": [nvcc.args, nvcc.stdout, nvcc.stderr], "ptx": ptx.read_text(),
                "ptxas": [ptxas.args, ptxas.stdout, ptxas.stderr]}
        if in_flight is not None:
            done["in_flight"], done["load_groups"] = in_flight, load_groups
        tmp.write_text(json.dumps(done))
        tmp.replace(kept)
    return nvcc, ptx.read_text(), ptxas, in_flight, load_groups


@functools.cache
def _tool_versions() -> str:
    return "".join(subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
                   for tool in (NVCC, PTXAS))


def _compile_cache(source: Path, nvcc_args: list[str], ptxas_args: list[str]) -> Path:
    """Where nvcc's and ptxas's output for this file is kept: named by a hash of the file's
    text with the header pasted in (what nvcc reads), both tools' versions and their
    arguments, so any change to them compiles again."""
    key = hashlib.sha256("\0".join([cuda_kernels.kernel_source(source.name), _tool_versions(), *nvcc_args, "|",
                                     *ptxas_args]).encode()).hexdigest()[:32]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ellm" / "nvcc_check"
    return root / f"{source.stem}-{key}.json"


@pytest.fixture(scope="module")
def compiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The (source, arch) pairs this session selected, compiled as many at a time as there
    are cores (each nvcc run is one single-threaded compiler: mmv.cu alone takes a minute
    or more), each test waiting for its own pair only."""
    out = tmp_path_factory.mktemp("ptx")
    by_name = {src.name: src for src in SOURCES}
    # the file each test reads where it has no `source` parameter
    reads = {"test_nvcc_ptx_without_warnings": [],
             "test_mmv_kernels_have_their_weight_loads_in_flight_at_once": [by_name[f] for f in MMV_FILES],
             "test_sampling_passes_keep_a_threads_loads_in_flight": [by_name["sample.cu"]]}
    wanted = {(src, item.callspec.params["arch"])
              for item in request.session.items if hasattr(item, "callspec") and getattr(item, "originalname", "")
              in reads
              for src in ([item.callspec.params["source"]] if "source" in item.callspec.params
                          else reads[item.originalname])}
    # (Linux: the cores this process may use)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pool = ThreadPoolExecutor(max_workers=max(1, cores or 1))
    request.addfinalizer(lambda: pool.shutdown(cancel_futures=True))
    return {(src.name, arch): pool.submit(_nvcc_and_ptxas, src, arch, out) for src, arch in wanted}


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvcc_ptx_without_warnings(source: Path, arch: str, compiled: dict) -> None:
    proc, ptx, ptxas, *_ = compiled[(source.name, arch)].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr   # not even a note
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    missing = set(cuda_kernels.KERNELS[source.name]) - entries
    assert not missing, f"{source.name} does not define {sorted(missing)}"
    if arch == "sm_90":
        late = [k for k, why in _dependency_sync_order(ptx).items() if why]
        assert not late, f"kernels touching global memory before grid_dependency_sync: {late}"
        if source.name == "mmv.cu":   # their first weights are on their way while they wait
            unfetched = [k for k, early in _prefetch_before_wait(ptx).items() if not early]
            assert not unfetched, f"mmv kernels without an L2 prefetch before the wait: {unfetched}"
        if source.name in MMV_FILES:   # (moe.cu's learn their expert only after the wait)
            unfetched = [k for k, after in _activations_fetched_after_wait(ptx).items() if not after]
            assert not unfetched, f"mmv kernels without their activations' L1 prefetch: {unfetched}"
    # ptxas assembles it for this architecture without spilling registers to local memory
    # (a spill in a decode kernel costs more than the kernel itself), and says per kernel
    # what it uses (-v): the fused decode kernels keep no stack frame at all
    assert ptxas is not None and ptxas.returncode == 0, ptxas and ptxas.stderr
    frames = dict(re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame", ptxas.stdout + ptxas.stderr))
    fused = [k for k in cuda_kernels.KERNELS[source.name] if k.startswith(FUSED_DECODE_KERNELS)]
    assert all(k in frames for k in fused), f"ptxas -v said nothing of {[k for k in fused if k not in frames]}"
    assert not [k for k in fused if frames[k] != "0"], \
        f"stack frames in {[(k, frames[k]) for k in fused if frames[k] != '0']} ({arch})"
    if source.name in MMV_FILES:   # one tile's kernels: two blocks of 256 threads an SM (MMV3_RESIDENT)
        used = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", ptxas.stdout + ptxas.stderr,
                               re.S))
        one_tile = [k for k in cuda_kernels.KERNELS[source.name] if not re.match(r"\w+x[24]_", k)]
        assert one_tile and all(k in used for k in one_tile), sorted(set(one_tile) - set(used))
        limit = 65536 // (cuda_ops.MMV3_RESIDENT[1] * cuda_ops.MMV_THREADS)   # an SM's registers
        over = {k: int(used[k]) for k in one_tile if int(used[k]) > limit}
        assert not over, \
            f"one-tile mmv kernels over {limit} registers (fewer blocks an SM than ops/cuda.py counts): {over} ({arch})"


# a load, store or atomic that may reach global memory (parameter, shared, local and
# constant spaces excepted)
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red)\.(?!param|shared|local|const)[\w.]*", re.M)


def _dependency_sync_order(ptx: str) -> dict[str, str]:
    """Per kernel entry of an sm_90 PTX: "" when `griddepcontrol.wait` comes before its
    first global memory access, else what comes first. A kernel launched dependently
    (ops/cuda_pdl.py) may otherwise read what the kernel before is still writing."""
    verdict: dict[str, str] = {}
    for m in re.finditer(r"\.entry\s+(\w+)(.*?)(?=\.entry\s|\Z)", ptx, re.S):
        body = m.group(2)
        wait = body.find("griddepcontrol.wait")
        first = _MEMORY_OP.search(body)
        if wait < 0:
            verdict[m.group(1)] = "no griddepcontrol.wait"
        elif first is not None and first.start() < wait:
            verdict[m.group(1)] = first.group(0).strip()
        else:
            verdict[m.group(1)] = ""
    return verdict


def _prefetch_before_wait(ptx: str) -> dict[str, bool]:
    """Per kernel entry: whether a `prefetch.global.L2` comes before `griddepcontrol.wait`."""
    out: dict[str, bool] = {}
    for m in re.finditer(r"\.entry\s+(\w+)(.*?)(?=\.entry\s|\Z)", ptx, re.S):
        body = m.group(2)
        wait, fetch = body.find("griddepcontrol.wait"), body.find("prefetch.global.L2")
        out[m.group(1)] = 0 <= fetch < wait
    return out


def _activations_fetched_after_wait(ptx: str) -> dict[str, bool]:
    """Per kernel entry: whether a `prefetch.global.L1` (mmv.cu prefetch_activations: what
    the kernel before wrote) comes after `griddepcontrol.wait`."""
    out: dict[str, bool] = {}
    for m in re.finditer(r"\.entry\s+(\w+)(.*?)(?=\.entry\s|\Z)", ptx, re.S):
        body = m.group(2)
        wait = body.find("griddepcontrol.wait")
        out[m.group(1)] = 0 <= wait < body.find("prefetch.global.L1", wait + 1)
    return out


_SASS_KERNEL = re.compile(r"^\.text\.(\w+):\n(.*?)(?=^//-+ \.text\.|\Z)", re.M | re.S)
_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_SASS_LOAD = re.compile(r"(?:@!?U?P\w+\s+)?(LDG\.E[\w.]*)\s+R(\d+)")


def _weight_loads_in_flight(sass: str) -> dict[str, int]:
    """Per kernel of nvdisasm's SASS: how many global loads of the weights are issued
    before the first instruction that reads a register one of them loaded (which waits
    for that load). mmv.cu's activations and norm weights are `const __restrict__`
    (LDG...CONSTANT, the read-only path), its weight rows not: the other loads."""
    out: dict[str, int] = {}
    for m in _SASS_KERNEL.finditer(sass):
        loaded: set[int] = set()
        count = 0
        for ins in _SASS_INSTRUCTION.finditer(m.group(2)):
            text = ins.group(1)
            load = _SASS_LOAD.match(text)
            if load and "CONSTANT" not in load.group(1):
                count += 1
                loaded.update(_loaded_registers(load))
                continue
            if loaded and any(r in loaded for r in _sources_read(text)):
                break
        out[m.group(1)] = count
    return out


def _loaded_registers(load: re.Match) -> range:
    """The registers a global load (_SASS_LOAD's match) writes: 1, 2 or 4 from its first."""
    width = 4 if ".128" in load.group(1) else 2 if ".64" in load.group(1) else 1
    return range(int(load.group(2)), int(load.group(2)) + width)


def _sources_read(text: str) -> list[int]:
    """The registers an instruction reads: its operands after the first (the destination)."""
    operands = text.split(None, 1)[1] if " " in text else ""
    if text.startswith("@"):   # a predicate, then the opcode
        operands = operands.split(None, 1)[1] if " " in operands else ""
    sources = operands.split(",", 1)[1] if "," in operands else ""
    return [int(r) for r in re.findall(r"(?<![\w.])R(\d+)", sources)]


def _load_groups(sass: str) -> dict[str, list[int]]:
    """Per kernel of nvdisasm's SASS, in the order of its text: the sizes of its groups of
    global loads, a group ending at the first instruction that reads a register one of
    its loads wrote (which waits for it), so a group is what a thread has in flight at
    once there."""
    out: dict[str, list[int]] = {}
    for m in _SASS_KERNEL.finditer(sass):
        loaded: set[int] = set()
        count, sizes = 0, []
        for ins in _SASS_INSTRUCTION.finditer(m.group(2)):
            load = _SASS_LOAD.match(ins.group(1))
            if load:
                count += 1
                loaded.update(_loaded_registers(load))
            elif loaded and any(r in loaded for r in _sources_read(ins.group(1))):
                sizes.append(count)
                loaded, count = set(), 0
        out[m.group(1)] = sizes
    return out


def test_weight_loads_in_flight_stop_at_the_first_use() -> None:
    sass = """//--------------------- .text.ahead --------------------------
.text.ahead:
        /*0010*/                   MOV R5, c[0x0][0x210] ;
        /*0020*/              @!P1 LDG.E.64 R8, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.128.CONSTANT R12, desc[UR4][R4.64] ;
        /*0040*/                   LDG.E.U16 R10, desc[UR4][R6.64+0x40] ;
        /*0050*/                   IADD3 R20, R12, R11, RZ ;
        /*0060*/                   I2FP.F32.S32 R21, R9 ;
        /*0070*/                   LDG.E R22, desc[UR4][R6.64] ;
//--------------------- .text.serial --------------------------
.text.serial:
        /*0010*/                   LDG.E R8, desc[UR4][R2.64] ;
        /*0020*/              @P0 SHF.R.U32.HI R9, RZ, 0x8, R8 ;
        /*0030*/                   LDG.E R10, desc[UR4][R2.64+0x4] ;
"""
    # R9 (the second word of a 64-bit load) is read after two weight loads; the read-only
    # load and an address's own register are no use of them
    assert _weight_loads_in_flight(sass) == {"ahead": 2, "serial": 1}
    # every global load counts in a group (the read-only one too); a group never used is none
    assert _load_groups(sass) == {"ahead": [3], "serial": [1]}


# Weight loads a lane has in flight before it waits for the first, in each decode product
# of mmv.cu with one tile: its two rows' value loads over the steps its type loads ahead
# (2 x mmv.cu's unroll; the scale words come on top); with two or four tiles, those of
# MMV_UNROLL = 4 tile-steps. Until 2026-12-07 every quantized type's loads were each
# used at once (2-5 in flight: a lane waited for each 4 or 8 bytes of weights in turn).
MMV_LOADS_AHEAD = {"bf16": 8, "f16": 8, "q4_0": 32, "q4_1": 16, "q8_0": 16, "q4_k": 16, "q5_k": 8, "q6_k": 16}
# moe.cu's, where they differ: half the steps ahead for Q4_0 and Q4_K (moe.cu Ahead)
MOE_LOADS_AHEAD = dict(MMV_LOADS_AHEAD, q4_0=16, q4_k=8)


@needs_nvcc
@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm: the [test] "
                                             "extras on Linux x86-64)")
@pytest.mark.parametrize("arch", ARCHS)
def test_mmv_kernels_have_their_weight_loads_in_flight_at_once(arch: str, compiled: dict) -> None:
    """ptxas's SASS of every mmv.cu and moe.cu kernel: a warp issues the weight loads of the
    steps it loads ahead before it uses any of them, so that at batch 1 -- where the
    weights' trip from memory is the whole cost -- enough bytes are on their way an SM."""
    short = {}
    for file in MMV_FILES:
        *_, in_flight, _ = compiled[(file, arch)].result()
        assert in_flight is not None
        kernels = list(cuda_kernels.KERNELS[file])
        assert kernels and set(kernels) <= set(in_flight), sorted(set(kernels) - set(in_flight))
        for k in kernels:
            tiles, wtype = re.match(r"(?:mmv3|mmv_glu|mmv_qkv_rope|moe_glu|moe_down)(x[24])?_(\w+)", k).groups()
            want = 8 if tiles else (MOE_LOADS_AHEAD if file == "moe.cu" else MMV_LOADS_AHEAD)[wtype]
            if in_flight[k] < want:
                short[k] = (in_flight[k], want)
    assert not short, f"weight loads in flight (SASS, {arch}) under what the kernel should issue at once: {short}"


# sample.cu SAMPLE_AHEAD: the entries a thread of sample_rows loads at once in a pass
SAMPLE_AHEAD = 8


@needs_nvcc
@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm: the [test] "
                                             "extras on Linux x86-64)")
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_passes_keep_a_threads_loads_in_flight(arch: str, compiled: dict) -> None:
    """ptxas's SASS of sample_rows, one block a row: the grammar mask's pass, the
    maximum's, the two radix histograms' (top-k's and top-p's, each inlined once), the
    draw's sums and its walk each issue a batch of SAMPLE_AHEAD loads before using any.
    Until 2026-12-07 all but the maximum's used each load where it was made: an L2 round
    trip a thread an entry (or four), ~125 in turn over a 128k-entry row (2 groups of 8
    or more in the kernel, where there are 7)."""
    sample = next(src for src in SOURCES if src.name == "sample.cu")
    *_, groups = compiled[(sample.name, arch)].result()
    assert groups is not None
    batches = [n for n in groups["sample_rows"] if n >= SAMPLE_AHEAD]
    assert len(batches) >= 6, f"sample_rows' groups of loads ({arch}): {groups['sample_rows']}"


def test_dependency_sync_order_sees_a_late_wait() -> None:
    ptx = """.entry good( .param .u64 a ) { ld.param.u64 %rd1, [a]; griddepcontrol.wait;
    ld.global.f32 %f1, [%rd1]; }
.entry late( .param .u64 a ) { ld.param.u64 %rd1, [a];
    ld.global.nc.f32 %f1, [%rd1];
    griddepcontrol.wait; }
.entry none( .param .u64 a ) { st.shared.f32 [%r1], %f1; }"""
    assert _dependency_sync_order(ptx) == {"good": "", "late": "ld.global.nc.f32", "none": "no griddepcontrol.wait"}
    fetched = ptx.replace("{ ld.param.u64 %rd1, [a]; griddepcontrol.wait;",
                          "{ ld.param.u64 %rd1, [a]; prefetch.global.L2 [%rd1]; griddepcontrol.wait;")
    assert _dependency_sync_order(fetched)["good"] == ""   # a prefetch is no access
    assert _prefetch_before_wait(fetched) == {"good": True, "late": False, "none": False}
    near = fetched.replace("griddepcontrol.wait;\n    ld.global.f32",
                           "griddepcontrol.wait; prefetch.global.L1 [%rd1];\n    ld.global.f32")
    assert _activations_fetched_after_wait(near) == {"good": True, "late": False, "none": False}
    early = fetched.replace("prefetch.global.L2 [%rd1];", "prefetch.global.L1 [%rd1];")
    assert _activations_fetched_after_wait(early)["good"] is False


def test_sources_paste_the_header_in() -> None:
    """What NVRTC is given: one self-contained text per file (CuPy's compile cache is keyed
    by it, so a changed common.cuh recompiles)."""
    for src in SOURCES:
        text = cuda_kernels.kernel_source(src.name)
        assert "#include" not in text, src.name
        if '"common.cuh"' in src.read_text():
            assert "deq8_q6_k" in text


CPP = shutil.which("g++") or shutil.which("cpp")


def _unit_id(unit: cuda_kernels.KernelUnit) -> str:
    return unit[0] + ("" if unit[1] is None else "-" + unit[1].name)
_KERNEL_DEF = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')


@pytest.mark.skipif(CPP is None, reason="no C++ preprocessor (g++ or cpp)")
@pytest.mark.parametrize("unit", cuda_kernels.kernel_units(), ids=_unit_id)
def test_each_compile_unit_makes_its_own_kernels(unit: cuda_kernels.KernelUnit) -> None:
    """ops/cuda.py compiles linear.cu and mmv.cu one weight type at a time (common.cuh
    ELLM_ONLY_TYPE): the text of each unit, preprocessed, defines exactly the kernels
    KERNEL_UNITS looks for in it -- none missing, none of another type."""
    args = [CPP, "-E", "-P", "-x", "c++", "-"] if CPP.endswith("++") else [CPP, "-P", "-x", "c++", "-"]
    proc = subprocess.run(args, input=cuda_kernels.unit_source(unit), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    made = set(_KERNEL_DEF.findall(proc.stdout))
    assert made == {name for name, u in cuda_kernels.KERNEL_UNITS.items() if u == unit}


def _nvrtc() -> ctypes.CDLL | None:
    names = [ctypes.util.find_library("nvrtc")] + glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*") \
        + glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia/cu*/lib/libnvrtc.so*"))
    for n in names:
        if n:
            try:
                # the cu13 wheel's libnvrtc has no RUNPATH: it finds its builtins (opened by
                # name at the first compile) only if they are loaded already
                for builtins in glob.glob(os.path.join(os.path.dirname(n), "libnvrtc-builtins.so*")):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(n)
            except OSError:
                continue
    return None


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="no libnvrtc found (optional: pip install nvidia-cuda-nvrtc "
                                                  "for the NVRTC compile check)")
@pytest.mark.parametrize("arch", ("compute_80", "compute_90"))
@pytest.mark.parametrize("unit", cuda_kernels.kernel_units(), ids=_unit_id)
def test_nvrtc_compiles(unit: cuda_kernels.KernelUnit, arch: str) -> None:
    """The exact text CuPy is given for each unit (ops/cuda.py unit_source)."""
    lib = NVRTC
    prog = ctypes.c_void_p()
    text = cuda_kernels.unit_source(unit).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, unit[0].encode(), 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-ftz=true"] + [o.encode() for o in cuda_kernels.NVRTC_OPTIONS]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    ptx = b""
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, out)
        ptx = out.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, buf.value.decode(errors="replace")
    if arch == "compute_90":   # what CuPy runs on Hopper: every kernel waits before touching memory
        late = [k for k, why in _dependency_sync_order(ptx.decode()).items() if why]
        assert not late, f"kernels touching global memory before grid_dependency_sync: {late}"
        if unit[0] == "mmv.cu":
            unfetched = [k for k, early in _prefetch_before_wait(ptx.decode()).items() if not early]
            assert not unfetched, f"mmv kernels without an L2 prefetch before the wait: {unfetched}"
        if unit[0] in MMV_FILES:
            unfetched = [k for k, after in _activations_fetched_after_wait(ptx.decode()).items() if not after]
            assert not unfetched, f"mmv kernels without their activations' L1 prefetch: {unfetched}"

