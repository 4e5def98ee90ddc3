#!/usr/bin/env bash
# Test ellm from a clean clone, in one command:   bash tests/run.sh [pytest args...]
#
#   1. .venv      ellm built from this checkout (C rebuilt every run, incrementally)
#                 plus the [test] extras;
#   2. .venv-ref  the reference implementation: torch (its CPU build), transformers, gguf;
#   3. the real models pulled into ellm's cache ($ELLM_HOME, default ~/.cache/ellm)
#                 and, when missing, the Hugging Face folders made from them under
#                 $ELLM_HOME/hf by tests/goldens/make.py (the goldens are committed);
#   4. pytest, with any arguments given to this script.
#
# Every step is skipped or incremental when its work is already done, so a second
# run costs little more than the tests. Set PYTHON to choose the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
REF="$ROOT/.venv-ref"
export ELLM_HOME="${ELLM_HOME:-$HOME/.cache/ellm}"
HF_DIR="$ELLM_HOME/hf"
MODELS=(smollm2-135m-instruct gemma-3-270m)
# The reference versions the committed goldens were made with; torch comes first and
# alone so that nothing else can pull in a CUDA build of it. On Linux and Windows the
# package index's torch is a CUDA build (several GB): the CPU build ("+cpu") comes from
# PyTorch's CPU index, or from any wheel pip already finds (find-links, a mirror).
# macOS wheels on the package index are CPU builds and carry no "+cpu" label.
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ "$(uname -s)" = Darwin ]; then
    REF_TORCH="torch==$TORCH_VERSION"
else
    REF_TORCH="torch==$TORCH_VERSION+cpu"
fi
# (accelerate: transformers needs it to load a GGUF; gguf does the dequantizing.)
# peft: the reference for LoRA adapters.
REF_REST=("transformers==5.24.0" "gguf==0.19.0" "accelerate==1.15.0" "sentencepiece" "peft==0.21.2")
# A build directory of our own, so this never fights another checkout's build.
BUILD_DIR_SETTING="--config-settings=build-dir=build/tests-{wheel_tag}"

step() { printf '\n== [%ss] %s\n' "$SECONDS" "$*" >&2; }

# -- 1. the test venv ---------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# Dependencies are installed again only when pyproject.toml changes.
deps_key="$("$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())' < pyproject.toml)"
if [ "$(cat "$VENV/.ellm-deps" 2>/dev/null || true)" != "$deps_key" ]; then
    step "installing build tools and ellm-engine[test] into .venv"
    # The build-system requirements of pyproject.toml, plus cmake and ninja, so the
    # build needs no build isolation (isolation would rebuild all C every run).
    mapfile -t build_reqs < <("$VPY" - <<'PY'
import re
text = open("pyproject.toml").read()
block = re.search(r"\[build-system\](.*?)(?:\n\[|\Z)", text, re.S).group(1)
reqs = re.search(r"requires\s*=\s*\[(.*?)\]", block, re.S).group(1)
for r in re.findall(r"['\"]([^'\"]+)['\"]", reqs):
    print(r)
PY
)
    "$VPY" -m pip install -q "${build_reqs[@]}" cmake ninja
    "$VPY" -m pip install -q --no-build-isolation "$BUILD_DIR_SETTING" -e ".[test]"
    echo "$deps_key" > "$VENV/.ellm-deps"
else
    step "rebuilding ellm in .venv"
    "$VPY" -m pip install -q --no-build-isolation --no-deps "$BUILD_DIR_SETTING" -e .
fi

# -- 2. the reference venv ----------------------------------------------------
ref_key="$REF_TORCH ${REF_REST[*]}"
if [ "$(cat "$REF/.ellm-ref" 2>/dev/null || true)" != "$ref_key" ]; then
    step "installing the reference ($ref_key) into .venv-ref"
    [ -x "$REF/bin/python" ] || "$PYTHON" -m venv "$REF"
    if ! "$REF/bin/python" -m pip install -q --extra-index-url "$TORCH_CPU_INDEX" "$REF_TORCH"; then
        # No CPU build reachable (the CPU index offline, no local wheel): the index's build
        # works as well, only larger.
        echo "warning: $REF_TORCH not found (CPU index $TORCH_CPU_INDEX unreachable?);" \
             "installing torch==$TORCH_VERSION from the package index (on Linux a CUDA build)" >&2
        "$REF/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    fi
    "$REF/bin/python" -m pip install -q "${REF_REST[@]}"
    echo "$ref_key" > "$REF/.ellm-ref"
fi
export ELLM_REF_PYTHON="$REF/bin/python"

# -- 3. models and Hugging Face folders ---------------------------------------
step "pulling the models into $ELLM_HOME"
"$VPY" -c 'import sys; from ellm.hub import pull; [pull(m) for m in sys.argv[1:]]' "${MODELS[@]}"

need=()
for m in "${MODELS[@]}"; do
    for dtype in f32 bf16; do
        if [ ! -f "$HF_DIR/$m-$dtype/config.json" ]; then
            need+=("$m")
            break
        fi
    done
done
if [ ${#need[@]} -gt 0 ]; then
    step "making Hugging Face folders for ${need[*]} in $HF_DIR (a few minutes)"
    "$REF/bin/python" tests/goldens/make.py --folders "$HF_DIR" --models "${need[@]}"
fi

# -- 3b. llama.cpp's converter, for the tiny models' GGUF files ------------------
# tests/test_tiny_models.py converts tiny folders with llama.cpp's own converter; it ships
# in the llama-cpp-python sdist (only it and gguf-py are kept: ~2 MB, fetched once).
LLAMACPP_VERSION=0.3.36
if [ -z "${ELLM_LLAMA_CPP_DIR:-}" ]; then
    ELLM_LLAMA_CPP_DIR="$ELLM_HOME/llama-cpp-python-$LLAMACPP_VERSION/vendor/llama.cpp"
    if [ ! -f "$ELLM_LLAMA_CPP_DIR/convert_hf_to_gguf.py" ]; then
        step "fetching llama.cpp's converter (llama-cpp-python $LLAMACPP_VERSION sdist) into $ELLM_HOME"
        tmp="$(mktemp -d)"
        "$VPY" -m pip download -q --no-deps --no-binary llama-cpp-python --no-build-isolation \
            "llama-cpp-python==$LLAMACPP_VERSION" -d "$tmp"
        tar -xzf "$tmp"/llama_cpp_python-"$LLAMACPP_VERSION".tar.gz -C "$tmp" --wildcards \
            '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
        rm -rf "$ELLM_HOME/llama-cpp-python-$LLAMACPP_VERSION"
        mv "$tmp/llama_cpp_python-$LLAMACPP_VERSION" "$ELLM_HOME/llama-cpp-python-$LLAMACPP_VERSION"
        rm -rf "$tmp"
    fi
fi
export ELLM_LLAMA_CPP_DIR

# -- 4. the tests -------------------------------------------------------------
# Two worker processes (pytest-xdist) where there are two cores or more, each test file on
# one of them (module fixtures -- a server, a Ray cluster, a model -- start once): on a
# 2-vCPU machine the suite took 523 s against 740 s in one process, the model tests'
# thread pools leaving a core idle while the other file's Python runs. ELLM_TEST_WORKERS=N
# sets the count (0: one process); `-n 0` among the arguments does the same for one run
# (--pdb and -s need it).
cores="$("$VPY" -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)')"
workers="${ELLM_TEST_WORKERS:-$(( cores >= 2 ? 2 : 0 ))}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
    echo "ELLM_TEST_WORKERS must be a whole number of worker processes (0: one process), not '$workers'" >&2
    exit 2
fi
parallel=()
if [ "$workers" -gt 0 ]; then
    parallel=(-n "$workers" --dist loadfile)
fi
step "running pytest ${parallel[*]} $*"
exec "$VPY" -m pytest "${parallel[@]}" "$@"
