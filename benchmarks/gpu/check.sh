#!/usr/bin/env bash
# The GPU check, on the lent GPU machine (one H200: Python 3.12, CUDA 13, cupy-cuda13x,
# torch, transformers; nothing can be fetched). Under 8 minutes. Prepared by
# benchmarks/gpu/prepare.sh on a machine without a GPU; the models arrive in parts
# through benchmarks/gpu/stage.sh (docs/gpu.md says the order of the calls).
#
#   1. the models put back together from /tmp/ellm-gpu/parts and checked (sha256)
#   2. ellm installed from the carried cp312 wheel (or built from this checkout if there
#      is none and gcc + cmake are there), llguidance and gguf from carried wheels
#   3. the bf16 Hugging Face folders made from the GGUFs (tests/goldens/make.py)
#   4. the GPU tests: tests/test_cuda_compile.py (nvcc + NVRTC), tests/test_cuda.py and the
#      cuda rows of tests/test_backends.py
#      (every op against the CPU reference by NMSE, both models' logits against the CPU
#      f32 path, greedy ids up to small-margin steps, batched == single, graphs == eager,
#      the device sampler)
#   5. benchmarks/gpu/bench.py: ellm (graphs / eager) and transformers side by side
#   6. with the time left: tests/test_tiny_models.py's cuda rows (every family, tiny random
#      models, against transformers in a subprocess)
# Everything goes to $OUT (check.log, pytest.log, gpu_bench.md, gpu_bench.json).
set -uo pipefail
T0=$(date +%s)
W=/tmp/ellm-gpu
OUT="${OUT:-$W/out}"
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/check.log") 2>&1
say() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
CARRY=.gpu-carry/wheels
PY=python3

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || say "no nvidia-smi"
$PY -c "import sys, cupy; print(sys.version.split()[0], 'cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" \
  || { say "FAIL: CuPy does not see a GPU"; exit 2; }

say "1. models"
export ELLM_HOME="$W/home"
MODELS=()
if [ -f "$CARRY/models.sha256" ]; then
  while read -r sum rel; do
    name=${rel%%/*}; file=${rel#*/}
    mkdir -p "$ELLM_HOME/models/$name"
    dest="$ELLM_HOME/models/$name/$file"
    if [ ! -f "$dest" ]; then
      parts=("$W/parts/${name}__${file}.part"*)
      [ -e "${parts[0]}" ] && cat "${parts[@]}" > "$dest"
    fi
    if [ -f "$dest" ] && echo "$sum  $dest" | sha256sum -c --quiet; then
      MODELS+=("$name"); say "  $name ok"
    else
      say "  $name: parts missing or damaged (was every part staged?); skipped"; rm -f "$dest"
    fi
  done < "$CARRY/models.sha256"
fi
[ ${#MODELS[@]} -gt 0 ] || { say "FAIL: no model arrived"; exit 2; }

say "2. packages"
SITE="$W/site"
mkdir -p "$SITE"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/*.whl \
  || { say "FAIL: installing the carried wheels"; exit 2; }
export PYTHONPATH="$SITE"
if ! ls "$CARRY"/ellm-*-cp312-*.whl >/dev/null 2>&1; then
  say "  no ellm wheel for CPython 3.12 was carried: building from source"
  if command -v gcc >/dev/null && command -v cmake >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . \
      || { say "FAIL: building ellm here"; exit 2; }
  else
    say "FAIL: no ellm wheel and no gcc/cmake to build one (run prepare.sh with Python 3.12)"; exit 2
  fi
fi
$PY -c "import ellm, ellm.ops.cuda as c; print('ellm', ellm.__version__, 'at', ellm.__file__); print('kernels in', c.kernel_dir())"

say "3. bf16 folders"
args=()
for m in "${MODELS[@]}"; do args+=(--gguf "$m=$(ls "$ELLM_HOME/models/$m"/*.gguf)"); done
timeout 150 $PY tests/goldens/make.py --folders "$ELLM_HOME/hf" --models "${MODELS[@]}" "${args[@]}" --threads 16 \
  || say "  making the folders failed: the folder tests and benchmarks will say so"

say "4. GPU tests"
timeout 200 $PY -m pytest tests/test_cuda_compile.py tests/test_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
say "  pytest exit ${PIPESTATUS[0]}"
# the backend suite's cuda rows (every op and memory method, the runner against the reference)
timeout 90 $PY -m pytest tests/test_backends.py -k cuda -q -rs -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest.log"
say "  pytest (backends) exit ${PIPESTATUS[0]}"

say "5. benchmark"
bargs=()
for m in "${MODELS[@]}"; do
  short=${m%%-*}
  bargs+=(--gguf "$short=$(ls "$ELLM_HOME/models/$m"/*.gguf)")
  [ -d "$ELLM_HOME/hf/$m-bf16" ] && bargs+=(--folder "$short=$ELLM_HOME/hf/$m-bf16")
done
left=$(( 430 - ($(date +%s) - T0) ))
timeout "$(( left > 60 ? left : 60 ))" $PY benchmarks/gpu/bench.py "${bargs[@]}" --out "$OUT"
say "  bench exit $?"

say "6. tiny models of every family on cuda against transformers (whatever time is left)"
left=$(( 475 - ($(date +%s) - T0) ))
if [ "$left" -gt 20 ]; then
  ELLM_REF_PYTHON=$PY timeout "$left" $PY -m pytest tests/test_tiny_models.py -k cuda -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_tiny.log" | tail -15
fi
say "done"
