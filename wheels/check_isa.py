"""Checks by disassembly that ellm's x86-64 binaries run on every x86-64 CPU.

The wheel has one build of the C kernels for all x86-64 machines: plain code compiled
for the x86-64 baseline (SSE2), plus AVX2 / AVX-512 variants in the files named
*_avx2.c / *_avx512.c, which csrc/dispatch.c calls only after CPUID said yes. One
stray -mavx (or -march=native) anywhere else would make the wheel die with SIGILL on an
older CPU, and nothing on this AVX2 machine would notice. So:

1. every object file of the build that is not a variant (csrc/*.c, the Cython modules)
   must hold no instruction beyond the baseline;
2. in the linked libraries, every function that holds such an instruction must be one
   that a variant object defines (this catches what the linker brings in). Installed
   libraries are stripped, and in a stripped file the code of a static function looks
   like the tail of the global one before it, so the check reads the build folder's
   unstripped copy instead, after making sure its .text is byte for byte the same.

Usage: python wheels/check_isa.py BUILD_DIR [MODULE.so | WHEEL.whl ...]
(on Linux, with binutils' objdump and nm; elsewhere it says it skipped)
"""
from __future__ import annotations

import platform
import re
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
_VARIANT = re.compile(r"_(?:avx2|avx512)\.c\.o(?:bj)?$")


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


def check(build_dir: Path, binaries: list[Path]) -> list[str]:
    """Every problem found, as lines to print; empty when the baseline is clean."""
    objects = sorted(build_dir.rglob("*.o"))
    if not objects:
        return [f"no object files under {build_dir}"]
    problems: list[str] = []
    allowed: set[str] = set()
    n_variant = 0
    for obj in objects:
        if _VARIANT.search(obj.name):
            n_variant += 1
            allowed |= defined_functions(obj)
            continue
        for func, insn in offending_functions(obj).items():
            problems.append(f"{obj.relative_to(build_dir)}: {func}: {insn}")
    print(f"{len(objects) - n_variant} baseline objects checked, {n_variant} variant objects "
          f"define {len(allowed)} functions")
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
