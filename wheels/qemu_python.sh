#!/usr/bin/env bash
# Runs the ellm Python package itself on aarch64 under qemu-aarch64: an arm64 CPython
# (Debian's), arm64 wheels of the runtime dependencies (PyPI), and ellm's native modules
# cross-built from this tree. Checks that the NEON level is chosen at run time and that
# `python -m ellm info` reports it, on three emulated CPUs:
#
#   cortex-a53  Armv8.0, plain NEON      -> "SIMD kernels: neon"
#   cortex-a76  Armv8.2 + dotprod (SDOT) -> "SIMD kernels: neon+dotprod"
#   max         + i8mm (SMMLA)           -> "SIMD kernels: neon+dotprod+i8mm"
#
# then decodes GEN_TOKENS greedy tokens from SmolLM2-135M's GGUF (Q4_1: the NEON int8 dots,
# SDOT and SMMLA kernels) on each of them. The three must give the same ids and logprobs
# bit for bit; against this (x86-64) machine's run the ids must agree up to the first near
# tie and the logprobs within 0.25 nats (x86 runs other kernels for the float ops, and its
# own levels differ too: up to 0.07 on SmolLM2, 0.13 between x86 and arm64 on Gemma 3). Ends with "N passed, M failed" (exit 1 on any failure).
# Usage:
#
#   wheels/qemu_python.sh                 # after tests/run.sh (its .venv: cmake, cython, ellm)
#   GEN_TOKENS=0 wheels/qemu_python.sh    # `ellm info` only
#
# Environment: CACHE (downloads; default ~/.cache/ellm/arm64-py311), MODEL (a GGUF; default
# the pulled smollm2-135m-instruct's), GEN_TOKENS (default 8), HOST_PYTHON (default
# .venv/bin/python: Python 3.11 with cython and cmake, and ellm built for this machine).
# Needs: gcc-aarch64-linux-gnu qemu-user (Debian), apt-get and dpkg-deb, PyPI.
#
# How it is put together (no root, no change to this machine's apt or dpkg):
# 1. The arm64 CPython: `apt-get download` with a private apt state under $CACHE/apt
#    (APT::Architecture=arm64, its own sources list and lists folder), and `dpkg-deb -x` of
#    python3.11-minimal, its standard library, headers (libpython3.11-dev) and the shared
#    libraries they load (libc6, libffi8, libssl3 ...) into $CACHE/root. qemu-aarch64 runs
#    $CACHE/root/usr/bin/python3.11 with `-L $CACHE/root` (the loader and libraries).
# 2. The dependencies of pyproject.toml's [project] as arm64 wheels: `pip install --target
#    $CACHE/site --platform manylinux2014_aarch64 ... --only-binary=:all:` run by the host's
#    pip (nothing is built; numpy, tokenizers and llguidance ship aarch64 wheels).
# 3. The native modules: the project's own CMakeLists.txt, configured for
#    CMAKE_SYSTEM_PROCESSOR=aarch64 with aarch64-linux-gnu-gcc (-Werror), the host Python
#    for Cython (it writes portable C) and Python_INCLUDE_DIR from the arm64 headers. CMake
#    gives the modules no SOABI when cross-compiling, so after `cmake --install` into a
#    staging folder the script renames each to the suffix the arm64 interpreter reports
#    (.cpython-311-aarch64-linux-gnu.so), beside a copy of src/ellm. (scikit-build-core is
#    not used: pip would ask it for a wheel of the host's platform.)
# Downloads are cached, so a rerun only rebuilds what changed and runs the checks.
# qemu emulates: the times printed say nothing about the speed of any arm64 machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${CACHE:-$HOME/.cache/ellm/arm64-py311}"
SYSROOT="$CACHE/root"
SITE="$CACHE/site"
BUILD="$ROOT/build/qemu-aarch64"
STAGE="$BUILD/stage"
HOST_PYTHON="${HOST_PYTHON:-$ROOT/.venv/bin/python}"
CMAKE="${CMAKE:-$(command -v cmake || echo "$ROOT/.venv/bin/cmake")}"
GEN_TOKENS="${GEN_TOKENS:-8}"
MODEL="${MODEL:-$(ls "$HOME"/.cache/ellm/models/smollm2-135m-instruct/*.gguf 2>/dev/null | head -n 1 || true)}"
need() { command -v "$1" >/dev/null || { echo "missing $1 (apt-get install $2)" >&2; exit 2; }; }
need aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu
need qemu-aarch64 qemu-user
need apt-get apt
need dpkg-deb dpkg
[[ -x "$HOST_PYTHON" ]] || { echo "missing $HOST_PYTHON (run tests/run.sh first, or set HOST_PYTHON)" >&2; exit 2; }
"$HOST_PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null \
    || { echo "HOST_PYTHON must be Python 3.11 (Debian 12's arm64 CPython is 3.11)" >&2; exit 2; }
t_start=$SECONDS

# --- 1. the arm64 CPython (Debian 12) ------------------------------------------------------
PKGS=(libc6 libgcc-s1 libstdc++6 gcc-12-base zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5
      libuuid1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libcrypt1 libzstd1 media-types
      python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev)
if [[ "$(cat "$SYSROOT/.packages" 2>/dev/null)" != "${PKGS[*]}" ]]; then
    echo "== arm64 CPython: downloading Debian packages into $CACHE"
    A="$CACHE/apt"
    rm -rf "$SYSROOT" "$A/debs"
    mkdir -p "$A/lists/partial" "$A/archives/partial" "$A/debs" "$A/preferences.d" "$SYSROOT"
    : >"$A/status"
    key=/usr/share/keyrings/debian-archive-keyring.gpg
    cat >"$A/sources.list" <<EOF
deb [arch=arm64 signed-by=$key] http://deb.debian.org/debian bookworm main
deb [arch=arm64 signed-by=$key] http://deb.debian.org/debian-security bookworm-security main
EOF
    APT=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o "APT::Sandbox::User=$(id -un)"
         -o "Dir::State=$A" -o "Dir::State::Lists=$A/lists" -o "Dir::State::status=$A/status"
         -o "Dir::Cache=$A" -o "Dir::Cache::archives=$A/archives" -o "Dir::Etc::SourceList=$A/sources.list"
         -o Dir::Etc::SourceParts=/nonexistent -o "Dir::Etc::Preferences=$A/preferences"
         -o "Dir::Etc::PreferencesParts=$A/preferences.d")
    apt-get "${APT[@]}" -q update >"$A/update.log" 2>&1 || { cat "$A/update.log" >&2; exit 1; }
    (cd "$A/debs" && apt-get "${APT[@]}" -q download "${PKGS[@]}" >"$A/download.log" 2>&1) \
        || { cat "$A/download.log" >&2; exit 1; }
    for deb in "$A/debs"/*.deb; do dpkg-deb -x "$deb" "$SYSROOT"; done
    printf '%s' "${PKGS[*]}" >"$SYSROOT/.packages"
fi
PY_ARM=(qemu-aarch64 -L "$SYSROOT")  # + -cpu MODEL, then $SYSROOT/usr/bin/python3.11 ...

# --- 2. the runtime dependencies as arm64 wheels ---------------------------------------------
DEPS="$("$HOST_PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$ROOT/pyproject.toml")"
if [[ "$(cat "$SITE/.requirements" 2>/dev/null)" != "$DEPS" ]]; then
    echo "== arm64 wheels of: $(echo $DEPS)"
    rm -rf "$SITE"
    mapfile -t deps <<<"$DEPS"
    "$HOST_PYTHON" -m pip install -q --target "$SITE" --only-binary=:all: --implementation cp \
        --python-version 3.11 --abi cp311 --abi abi3 --abi none --platform manylinux2014_aarch64 \
        --platform manylinux_2_28_aarch64 --platform manylinux_2_34_aarch64 "${deps[@]}" 2>&1 \
        | grep -v "^WARNING: Location" || true
    [[ -d "$SITE/numpy" ]] || { echo "pip could not install the arm64 wheels" >&2; exit 1; }
    printf '%s' "$DEPS" >"$SITE/.requirements"
fi

# --- 3. ellm's native modules, cross-built --------------------------------------------------
"$CMAKE" -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
    -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc \
    "-DCMAKE_C_FLAGS=-Werror -I$SYSROOT/usr/include" "-DPython_EXECUTABLE=$HOST_PYTHON" \
    "-DPython_INCLUDE_DIR=$SYSROOT/usr/include/python3.11" >"$BUILD.configure.log" 2>&1 \
    || { cat "$BUILD.configure.log" >&2; echo "1 failed: the aarch64 configure"; exit 1; }
nice "$CMAKE" --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" >"$BUILD/build.log" 2>&1 \
    || { cat "$BUILD/build.log" >&2; echo "1 failed: the aarch64 build (see above)"; exit 1; }
rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -r "$ROOT/src/ellm" "$STAGE/"
find "$STAGE" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
"$CMAKE" --install "$BUILD" --prefix "$STAGE" >/dev/null
EXT="$("${PY_ARM[@]}" "$SYSROOT/usr/bin/python3.11" -c 'import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])')"
for mod in "$STAGE"/ellm/_native/_*.so; do mv "$mod" "${mod%.so}$EXT"; done
echo "== built in $((SECONDS - t_start))s; modules: $(cd "$STAGE/ellm/_native" && echo *.so)"

# --- 4. the checks -------------------------------------------------------------------------
passed=0 failed=0
ok() { echo "PASSED $1"; passed=$((passed + 1)); }
bad() { echo "FAILED $1"; failed=$((failed + 1)); }
# runs the arm64 Python on one CPU model, from the staging folder (so -m finds the staged ellm)
arm_python() {
    local cpu="$1"; shift
    (cd "$STAGE" && PYTHONPATH="$STAGE:$SITE" PYTHONNOUSERSITE=1 \
        "${PY_ARM[@]}" -cpu "$cpu" "$SYSROOT/usr/bin/python3.11" "$@")
}
CPUS=(cortex-a53 cortex-a76 max)
declare -A LEVEL=([cortex-a53]=neon [cortex-a76]=neon+dotprod [max]=neon+dotprod+i8mm)

for cpu in "${CPUS[@]}"; do
    t=$SECONDS
    echo "== qemu-aarch64 -cpu $cpu: python -m ellm info"
    out="$(arm_python "$cpu" -m ellm info 2>&1)" || true
    printf '%s\n' "$out" | sed 's/^/   /'
    want="SIMD kernels: ${LEVEL[$cpu]} (CPU supports: scalar, neon)"
    if grep -qxF "$want" <<<"$out" && grep -q "^ellm .* on aarch64 / Python 3\.11" <<<"$out" \
        && grep -qF "native module: $STAGE/ellm/_native/_core$EXT" <<<"$out"; then
        ok "info_$cpu ($((SECONDS - t))s)"
    else
        bad "info_$cpu: expected the line '$want' and the staged aarch64 module"
    fi
done

if [[ "$GEN_TOKENS" -gt 0 ]]; then
    if [[ -z "$MODEL" || ! -f "$MODEL" ]]; then
        bad "generate: no model (set MODEL to a GGUF, or pull smollm2-135m-instruct: tests/run.sh does)"
    else
        # greedy decoding of one prompt: a JSON line of the ids, each chosen token's logprob
        # and its margin over the runner-up
        # The x86-64 run is held to the AVX2 level (FORCE_LEVEL), so the comparison is the
        # same on an AVX-512 host as on the AVX2 machine it was measured on.
        GEN='import importlib, json, os, pkgutil, sys, ellm, ellm._native
from ellm._native import _core
level = os.environ.get("FORCE_LEVEL")
if level and level in _core.supported_simd_levels():
    for info in pkgutil.iter_modules(ellm._native.__path__):
        mod = None if info.name.startswith("lib") else importlib.import_module("ellm._native." + info.name)
        if hasattr(mod, "set_simd_level"):
            mod.set_simd_level(level)
llm = ellm.load(sys.argv[1], threads=2, progress=False, max_model_len=128)
out = llm.generate("The capital of France is", temperature=0, max_tokens=int(sys.argv[2]), logprobs=2)
print(json.dumps({"level": "+".join([_core.simd_level(), *_core.simd_extensions()]), "ids": out.token_ids,
                  "logprob": [t.logprob for t in out.logprobs],
                  "margin": [t.top[0][1] - t.top[1][1] for t in out.logprobs]}))'
        echo "== greedy decoding, $GEN_TOKENS tokens of $(basename "$MODEL")"
        (cd /tmp && FORCE_LEVEL=avx2 "$HOST_PYTHON" -c "$GEN" "$MODEL" "$GEN_TOKENS" >"$BUILD/gen-x86_64.json" 2>"$BUILD/gen-x86_64.err") \
            || { tail -n 5 "$BUILD/gen-x86_64.err"; bad "generate_x86_64: the host run failed ($HOST_PYTHON)"; }
        for cpu in "${CPUS[@]}"; do
            t=$SECONDS
            arm_python "$cpu" -c "$GEN" "$MODEL" "$GEN_TOKENS" >"$BUILD/gen-$cpu.json" 2>"$BUILD/gen-$cpu.err" \
                || { tail -n 5 "$BUILD/gen-$cpu.err"; : >"$BUILD/gen-$cpu.json"; }
            echo "   -cpu $cpu: $((SECONDS - t))s"
        done
        # Every NEON variant runs the same accumulation order, so the three emulated CPUs must
        # give the same logprobs bit for bit. Against x86-64 (other kernels, other float
        # order; its own levels differ too) the ids must agree up to the first near tie (the
        # runner-up within NEAR_TIE nats on either side), with the chosen logprobs close.
        verdicts="$("$HOST_PYTHON" - "$BUILD" "${CPUS[@]}" <<'EOF'
import json, sys
NEAR_TIE, LOGPROB_TOL = 0.1, 0.25
build, cpus = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        return json.load(open(f"{build}/gen-{name}.json"))
    except (OSError, ValueError):
        return None
x86 = load("x86_64")
if x86:
    print(f"INFO x86-64 ({x86['level']}): ids {x86['ids']}")
first = None
for cpu in cpus:
    run = load(cpu)
    if run is None:
        print(f"FAILED generate_{cpu}: no result (see build/qemu-aarch64/gen-{cpu}.err)")
        continue
    print(f"INFO aarch64 -cpu {cpu} ({run['level']}): ids {run['ids']}")
    if first is None:
        first = (cpu, run)
    elif (run["ids"], run["logprob"]) != (first[1]["ids"], first[1]["logprob"]):
        print(f"FAILED generate_{cpu}_equals_{first[0]}: the NEON variants differ")
    else:
        print(f"PASSED generate_{cpu}_equals_{first[0]} (ids and logprobs bit for bit)")
    if x86 is None:
        continue
    n = 0
    while (n < min(len(run["ids"]), len(x86["ids"])) and run["ids"][n] == x86["ids"][n]
           and min(run["margin"][n], x86["margin"][n]) >= NEAR_TIE):
        n += 1
    tie = n < min(len(run["ids"]), len(x86["ids"])) and min(run["margin"][n], x86["margin"][n]) < NEAR_TIE
    diff = max((abs(a - b) for a, b in zip(run["logprob"][:n], x86["logprob"][:n])), default=0.0)
    agree = (n == len(x86["ids"]) == len(run["ids"]) or tie) and n >= 1 and diff <= LOGPROB_TOL
    where = f"the first {n} ids agree" + (f", then a near tie at token {n + 1}" if tie else "")
    print(f"{'PASSED' if agree else 'FAILED'} generate_{cpu}_vs_x86_64 ({where}; logprobs within {diff:.3f})")
EOF
)" || verdicts="FAILED generate: the comparison did not run"
        while IFS= read -r line; do
            case "$line" in
                PASSED*) ok "${line#PASSED }" ;;
                FAILED*) bad "${line#FAILED }" ;;
                *) echo "   ${line#INFO }" ;;
            esac
        done <<<"$verdicts"
    fi
fi
echo "== $((SECONDS - t_start))s in all (emulated: no measure of arm64 speed)"
echo "$passed passed, $failed failed"
[[ $failed == 0 ]]
