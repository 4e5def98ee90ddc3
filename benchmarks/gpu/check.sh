#!/usr/bin/env bash
# The GPU check, on the lent GPU machine (one H100 or H200: Python 3.12, CUDA 13,
# cupy-cuda13x, torch, transformers; nothing can be fetched). Under 8 minutes (480 s). Prepared by
# benchmarks/gpu/prepare.sh on a machine without a GPU; SmolLM2's GGUF arrives in two
# parts through benchmarks/gpu/stage.sh (docs/gpu.md says the order of the calls).
#
#   1. the models put back together from /tmp/ellm-gpu/parts and checked (sha256)
#   2. ellm installed from the carried cp312 wheel (or built from this checkout if there
#      is none and gcc + cmake are there), llguidance and gguf from carried wheels
#   3. SmolLM2's bf16 Hugging Face folder made from the GGUF (tests/goldens/make.py)
#   4. the GPU tests (at most ~150 s): tests/test_cuda.py and the cuda rows of
#      tests/test_backends.py (every op and fused op against the reference, both
#      SmolLM2 files' logits against the CPU f32 path, short and long prompts,
#      greedy ids, batched == single, graphs == eager, greedy steps launched one ahead
#      == one at a time on a tiny llama the machine's transformers make, the device
#      sampler), then the cuda rows of tests/test_lora.py (at most 120 s: the adapters' logits against peft's,
#      whose tiny models and adapters the machine's own torch, transformers and peft make)
#   5. the GPU's copy bandwidth and bf16 peak, measured (device_figures.py: every "% of
#      HBM" and "% of peak" below is of these), an 8B-shaped decode product alone in each
#      weight type (mmv_types.py: GB/s by type), an 8B-shaped layer of a 2,048-token prefill
#      part by part (prefill_parts.py: the products' and attention's TFLOP/s), then one decode step of SmolLM2 and of the Llama-3.2-1B shape: its graph replay time
#      with and without programmatic dependent launches, then (where ncu is) each of its
#      kernels measured alone, and those of a 64-sequence 1B step
#      (benchmarks/gpu/step_profile.py)
#   6. benchmarks/gpu/bench.py until 460 s: SmolLM2 (GGUF, folder), random bf16 folders
#      of Llama-3.2-1B and Llama-3-8B shape made here, the 8B quantized to q8_0 at load;
#      ellm (fused graphs, unfused graphs, eager) and transformers (compiled static
#      cache, eager) side by side, in priority order (bench.py)
# Everything goes to $OUT (check.log, pytest.log, pytest_lora.log, device.json, step_time.md,
# mmv_types.md / .json, prefill_parts.md / .json, step_kernels_*.md / .csv, ncu_*.log, gpu_bench.md, gpu_bench.json).
# CHECK_BENCH_ONLY=1 skips 3-5 (a second run for the figures alone).
set -uo pipefail
T0=$(date +%s)
W=/tmp/ellm-gpu
OUT="${OUT:-$W/out}"
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/check.log") 2>&1
say() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
CARRY=.gpu-carry/wheels
PY="${CHECK_PY:-python3}"   # (another Python: a rehearsal on a machine without a GPU)

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
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the distribution is ellm-engine: its wheels are ellm_engine-*.whl
if ! ls "$CARRY"/ellm_engine-*-cp312-*.whl >/dev/null 2>&1; then
  say "  no ellm wheel for CPython 3.12 was carried: building from source"
  if command -v gcc >/dev/null && command -v cmake >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . \
      || { say "FAIL: building ellm here"; exit 2; }
  else
    say "FAIL: no ellm wheel and no gcc/cmake to build one (run prepare.sh with Python 3.12)"; exit 2
  fi
fi
$PY -c "import ellm, ellm.ops.cuda_kernels as c; print('ellm', ellm.__version__, 'at', ellm.__file__); print('kernels in', c.kernel_dir())"

say "3. bf16 folders"
if [ "${CHECK_BENCH_ONLY:-0}" != 1 ]; then
  args=()
  for m in "${MODELS[@]}"; do args+=(--gguf "$m=$(ls "$ELLM_HOME/models/$m"/*.gguf)"); done
  timeout 100 $PY tests/goldens/make.py --folders "$ELLM_HOME/hf" --models "${MODELS[@]}" "${args[@]}" --threads 16 \
    || say "  making the folders failed: the folder tests and benchmarks will say so"
fi

say "4. GPU tests"
if [ "${CHECK_BENCH_ONLY:-0}" != 1 ]; then
  # not tests/test_cuda_compile.py: CI runs it, and with an nvcc or a libnvrtc here its
  # ptxas and NVRTC passes over mmv.cu alone would take minutes of the 150 s
  ELLM_REF_PYTHON=$PY timeout 150 $PY -m pytest tests/test_cuda.py tests/test_backends.py -k "cuda or kernel" \
    -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
  say "  pytest exit ${PIPESTATUS[0]}"
  ELLM_REF_PYTHON=$PY timeout 120 $PY -m pytest tests/test_lora.py -k cuda -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_lora.log" | tail -8
  say "  LoRA pytest exit ${PIPESTATUS[0]}"
fi

say "5. the GPU's limits, then one decode step: replay time, then each kernel under Nsight Compute"
timeout 60 $PY benchmarks/gpu/device_figures.py --out "$OUT"
say "  device figures exit $?"
timeout 60 $PY benchmarks/gpu/mmv_types.py --out "$OUT"
say "  decode products by weight type exit $?"
timeout 45 $PY benchmarks/gpu/prefill_parts.py --out "$OUT"
say "  a 2,048-token prefill's layer by part exit $?"
if [ "${CHECK_BENCH_ONLY:-0}" != 1 ]; then
  sargs=()
  for m in "${MODELS[@]}"; do
    [ "${m%%-*}" = smollm2 ] && sargs+=(--gguf "smollm2=$(ls "$ELLM_HOME/models/$m"/*.gguf)")
  done
  timeout 75 $PY benchmarks/gpu/step_profile.py time "${sargs[@]}" --random llama-1b --work "$W/random" --batch 1 \
    2>&1 | tee "$OUT/step_time.md"
  say "  step time exit ${PIPESTATUS[0]}"
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    for spec in "${sargs[@]:1:1}" "llama-1b" "llama-1b@64"; do
      [ -n "$spec" ] || continue
      if [ $(( $(date +%s) - T0 )) -gt 300 ]; then say "  past 300 s: no more profiles (the benchmark needs the rest)"; break; fi
      name=${spec%%=*}
      batch=1; [ "$name" = llama-1b@64 ] && batch=64
      if [ "${name%@*}" = llama-1b ]; then src=(--random llama-1b --work "$W/random"); else src=(--gguf "$spec"); fi
      name=${name/@/_b}
      timeout 45 "$NCU" --profile-from-start off --graph-profiling node --clock-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
        -f -o "$W/step_$name" $PY benchmarks/gpu/step_profile.py profile "${src[@]}" --batch "$batch" \
        > "$OUT/ncu_$name.log" 2>&1
      say "  ncu $name exit $?"
      "$NCU" --import "$W/step_$name.ncu-rep" --csv --page raw --print-units base > "$OUT/step_kernels_$name.csv" 2>>"$OUT/ncu_$name.log" \
        && $PY benchmarks/gpu/step_profile.py summarize "$OUT/step_kernels_$name.csv" \
             --device-figures "$OUT/device.json" | tee "$OUT/step_kernels_$name.md"
    done
  else
    say "  no ncu on this machine: no per-kernel table"
  fi
fi

say "6. benchmark"
bargs=()
for m in "${MODELS[@]}"; do
  short=${m%%-*}
  bargs+=(--gguf "$short=$(ls "$ELLM_HOME/models/$m"/*.gguf)")
  [ -d "$ELLM_HOME/hf/$m-bf16" ] && bargs+=(--folder "$short=$ELLM_HOME/hf/$m-bf16")
done
left=$(( 460 - ($(date +%s) - T0) ))
timeout "$(( left > 60 ? left + 15 : 75 ))" $PY benchmarks/gpu/bench.py "${bargs[@]}" \
  --random llama-1b --random llama-8b --quantize llama-8b=q8_0 --work "$W/random" \
  --budget "$(( left > 60 ? left : 60 ))" --out "$OUT" --device-figures "$OUT/device.json"
say "  bench exit $?"
say "done"
