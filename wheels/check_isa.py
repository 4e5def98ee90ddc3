"""Checks by disassembly that ellm's x86-64 binaries run on every x86-64 CPU.

The wheel has one build of the C kernels for all x86-64 machines: plain code compiled
for the x86-64 baseline (SSE2), plus variants (AVX2, AVX-512, AMX ...) that CMake
compiles with that ISA's -m flags and that csrc/dispatch.c calls only after CPUID said
yes. One stray -mavx (or -march=native) anywhere else would make the wheel die with
SIGILL on an older CPU, and nothing on a new machine would notice.

Which objects are variants is read from the build itself, not from a list of names: the
build's compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS) holds every object's
compiler flags, and an object is a variant exactly when those flags raise the ISA
(-mavx2, -mamx-tile, -mfma ...). So a new level or file needs no edit here. Then:

1. every object that is not a variant must hold no instruction beyond the baseline;
2. -march= / -mcpu= (other than x86-64) are refused everywhere: a variant names its
   extensions, never a CPU. The objects that choose the level (those defining
   ellm_simd_best) and the Python extension modules must be baseline objects: a flag
   added to every object would otherwise make every object a "variant" and the check
   vacuous;
3. in the linked libraries, every function that holds such an instruction must be one
   that a variant object defines (this catches what the linker brings in). Installed
   libraries are stripped, and in a stripped file the code of a static function looks
   like the tail of the global one before it, so the check reads the build folder's
   unstripped copy instead, after making sure its .text is byte for byte the same.

Usage: python wheels/check_isa.py BUILD_DIR [MODULE.so | WHEEL.whl ...]
BUILD_DIR holds one or more CMake build folders (each with compile_commands.json).
(on Linux, with binutils' objdump and nm; elsewhere it says it skipped)
"""
from __future__ import annotations

import json
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# x86-64 baseline = SSE2. Mnemonics (Intel syntax) of the later extensions a compiler
# emits: SSE3/SSSE3, SSE4.1/4.2, POPCNT/LZCNT, BMI1/2, MOVBE. AVX, FMA, F16C and AVX-512
# are caught by their 'v' prefix and registers. (tzcnt is left out: GCC writes
# `rep bsf` for __builtin_ctz, which objdump shows as tzcnt and which old CPUs run as
# bsf.)
_LATER_MNEMONICS = frozenset("""
addsubps addsubpd haddps haddpd hsubps hsubpd lddqu movddup movshdup movsldup
pabsb pabsw pabsd palignr phaddw phaddd phaddsw phsubw phsubd phsubsw pmaddubsw
pmulhrsw pshufb psignb psignw psignd
blendpd blendps blendvpd blendvps dppd dpps extractps insertps movntdqa mpsadbw
packusdw pblendvb pblendw pcmpeqq pextrb pextrd pextrq phminposuw pinsrb pinsrd pinsrq
pmaxsb pmaxsd pmaxud pmaxuw pminsb pminsd pminud pminuw pmovsxbw pmovsxbd pmovsxbq
pmovsxwd pmovsxwq pmovsxdq pmovzxbw pmovzxbd pmovzxbq pmovzxwd pmovzxwq pmovzxdq
pmuldq pmulld ptest roundps roundpd roundss roundsd
pcmpgtq pcmpestri pcmpestrm pcmpistri pcmpistrm crc32 popcnt lzcnt
andn bextr blsi blsmsk blsr bzhi mulx pdep pext rorx sarx shlx shrx movbe
""".split())
_WIDE_REG = re.compile(r"\b(?:[yz]mm\d+|k[0-7])\b")
_FUNC = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")
_INSN = re.compile(r"^\s+[0-9a-f]+:\s+(?P<mnem>[a-z][a-z0-9.]*)(?P<ops>.*)$")
_PREFIXES = frozenset({"rep", "repz", "repe", "repnz", "repne", "lock", "notrack", "bnd",
                       "data16", "addr32", "cs", "ds", "es", "ss", "fs", "gs"})
# Compiler flags that let the compiler emit instructions beyond SSE2: -mavx2, -mfma,
# -mf16c, -mamx-tile, -mavx512vnni, -msse4.2, -mbmi2 ... (not -mno-*, -mtune=, -mabi=).
_ISA_FLAG = re.compile(r"^-m(?!no-|tune=|abi=|arch=|cpu=)(?:avx|amx|sse[3-4]|ssse3|fma|f16c|bmi|"
                       r"lzcnt|popcnt|movbe|pclmul|aes|sha|gfni|vaes|vpclmul|adx|rdrnd|rdseed|"
                       r"xsave|fsgsbase|prfchw|lwp|xop|tbm|kl|widekl|cx16)")
_MARCH = re.compile(r"^-m(?:arch|cpu)=(?!x86-64$)")  # a CPU; -march=x86-64 is the baseline
# The level chooser: code in an object defining this runs before any CPUID answer.
_CHOOSER = "ellm_simd_best"


def beyond_baseline(mnemonic: str, operands: str) -> bool:
    """True for an instruction that an x86-64 CPU without SSE3+ / AVX may lack."""
    if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
        return True  # VEX / EVEX encoded: AVX, AVX2, FMA, F16C, AVX-512
    if mnemonic.startswith("k") and _WIDE_REG.search(operands):
        return True  # AVX-512 mask-register instructions
    return mnemonic in _LATER_MNEMONICS or bool(_WIDE_REG.search(operands))


def offending_functions(binary: Path) -> dict[str, str]:
    """{function: first offending instruction} for one object or shared library."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-M", "intel", str(binary)],
                         check=True, capture_output=True, text=True).stdout
    found: dict[str, str] = {}
    func = "?"
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            func = m.group("name")
            continue
        m = _INSN.match(line)
        if not m or func in found:
            continue
        words = (m.group("mnem") + m.group("ops")).split(None, 1)
        while words and words[0] in _PREFIXES and len(words) > 1:
            words = words[1].split(None, 1)
        mnem, ops = words[0], (words[1] if len(words) > 1 else "")
        if beyond_baseline(mnem, ops):
            found[func] = f"{mnem} {ops}".strip()
    return found


def defined_functions(obj: Path) -> set[str]:
    """Names of the text symbols (global and static) an object file defines."""
    out = subprocess.run(["nm", "--defined-only", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    return {parts[2] for parts in (ln.split() for ln in out.splitlines())
            if len(parts) == 3 and parts[1] in "Tt"}


def _modules(paths: list[Path], scratch: Path) -> list[Path]:
    """The .so files named, or found inside the wheels named."""
    mods: list[Path] = []
    for p in paths:
        if p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                for name in z.namelist():
                    if name.endswith(".so"):
                        mods.append(Path(z.extract(name, scratch / p.stem)))
        else:
            mods.append(p)
    return mods


def _has_symtab(binary: Path) -> bool:
    out = subprocess.run(["readelf", "-S", "-W", str(binary)], check=True, capture_output=True,
                         text=True).stdout
    return ".symtab" in out


def _text(binary: Path, scratch: Path) -> bytes:
    dump = scratch / "text.bin"
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(binary), str(dump)],
                   check=True, capture_output=True)
    return dump.read_bytes()


def _with_symbols(mod: Path, build_dir: Path, scratch: Path) -> Path | None:
    """mod itself when it has a symbol table, else its unstripped twin in build_dir."""
    if _has_symtab(mod):
        return mod
    want = _text(mod, scratch)
    for twin in sorted(build_dir.rglob(mod.name)):
        if _has_symtab(twin) and _text(twin, scratch) == want:
            return twin
    return None


def _object_flags(build: Path) -> dict[Path, list[str]]:
    """{object file: compiler arguments} from one build folder's compile_commands.json."""
    flags: dict[Path, list[str]] = {}
    for entry in json.loads((build / "compile_commands.json").read_text()):
        args = entry.get("arguments") or shlex.split(entry["command"])
        where = Path(entry.get("directory", build))
        out = entry.get("output")
        if out is None and "-o" in args:
            out = args[args.index("-o") + 1]
        if out is not None:
            flags[(where / out).resolve()] = args
    return flags


def classify(build: Path) -> tuple[list[Path], list[Path], list[str]]:
    """(baseline objects, variant objects, problems) of one CMake build folder."""
    flags = _object_flags(build)
    baseline: list[Path] = []
    variants: list[Path] = []
    problems: list[str] = []
    for obj in sorted(build.rglob("*.o")):
        args = flags.get(obj.resolve())
        rel = obj.relative_to(build)
        if args is None:
            problems.append(f"{rel}: not in compile_commands.json (flags unknown)")
            continue
        if any(_MARCH.match(a) for a in args):
            problems.append(f"{rel}: built with {[a for a in args if _MARCH.match(a)]}; "
                            f"a variant names its extensions (-mavx2 ...), never a CPU")
        (variants if any(_ISA_FLAG.match(a) for a in args) else baseline).append(obj)
    for obj in variants:
        rel = obj.relative_to(build)
        if _CHOOSER in defined_functions(obj):
            problems.append(f"{rel}: defines {_CHOOSER} (the level chooser) but is built with "
                            f"ISA flags: it must run on every CPU")
        if not str(rel).startswith("CMakeFiles/ellm_kernels.dir/"):
            problems.append(f"{rel}: a Python extension module's object built with ISA flags")
    if not any(_CHOOSER in defined_functions(o) for o in baseline):
        problems.append(f"no baseline object defines {_CHOOSER}")
    return baseline, variants, problems


def check(build_dir: Path, binaries: list[Path]) -> list[str]:
    """Every problem found, as lines to print; empty when the baseline is clean."""
    builds = sorted(p.parent for p in build_dir.rglob("compile_commands.json"))
    if not builds:
        return [f"no compile_commands.json under {build_dir} (CMAKE_EXPORT_COMPILE_COMMANDS)"]
    problems: list[str] = []
    allowed: set[str] = set()
    for build in builds:
        baseline, variants, found = classify(build)
        problems += found
        for obj in variants:
            allowed |= defined_functions(obj)
        for obj in baseline:
            for func, insn in offending_functions(obj).items():
                problems.append(f"{obj.relative_to(build_dir)}: {func}: {insn}")
        print(f"{build}: {len(baseline)} baseline objects checked, {len(variants)} variant "
              f"objects ({', '.join(sorted({o.name.split('.')[0] for o in variants}))})")
    print(f"variant objects define {len(allowed)} functions")
    with tempfile.TemporaryDirectory() as tmp:
        for mod in _modules(binaries, Path(tmp)):
            twin = _with_symbols(mod, build_dir, Path(tmp))
            if twin is None:
                problems.append(f"{mod.name}: stripped, and no unstripped copy with the same "
                                f"code under {build_dir}")
                continue
            bad = offending_functions(twin)
            stray = {f: i for f, i in bad.items() if f.split("@")[0] not in allowed}
            print(f"{mod.name}: {len(bad)} functions use AVX-class instructions, "
                  f"{len(stray)} of them outside the variant objects")
            problems += [f"{mod.name}: {f}: {i}" for f, i in stray.items()]
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"baseline ISA check: skipped on {platform.machine()} (it reads x86-64 code)")
        return 0
    problems = check(Path(argv[0]), [Path(a) for a in argv[1:]])
    for line in problems:
        print("beyond the x86-64 baseline:", line, file=sys.stderr)
    print("baseline ISA check:", "FAILED" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
