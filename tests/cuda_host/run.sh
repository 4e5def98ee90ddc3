#!/usr/bin/env bash
# The GPU tests with ellm's CUDA kernels running on the CPU (tests/cuda_host/README.md):
#   bash tests/cuda_host/run.sh                      # the op-level checks (a few minutes)
#   bash tests/cuda_host/run.sh --all                # and the model-level ones (~30 minutes)
#   bash tests/cuda_host/run.sh tests/test_cuda.py -k attention   # anything pytest takes
#   bash tests/cuda_host/run.sh --asan [...]         # the same under AddressSanitizer
#   ELLM_CUDA_HOST_DEFER=1 bash tests/cuda_host/run.sh   # stream work queued until the host waits
#   ELLM_CUDA_HOST_ORDER=reverse bash tests/cuda_host/run.sh   # blocks and threads run last to first
# Needs g++ and libffi's header (Debian: libffi-dev). Run after `bash tests/run.sh` has
# built ellm into .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/tests/cuda_host${PYTHONPATH:+:$PYTHONPATH}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
# the LoRA rows compare with PEFT in the reference venv tests/run.sh made
[ -z "${ELLM_REF_PYTHON:-}" ] && [ -x .venv-ref/bin/python ] && export ELLM_REF_PYTHON="$PWD/.venv-ref/bin/python"
if [ "${1:-}" = "--asan" ]; then   # kernels built with -fsanitize=address, libasan preloaded
    shift
    export ELLM_CUDA_HOST_ASAN=1 LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
    export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
fi
if [ "${1:-}" = "--all" ]; then
    shift
    exec "$PY" -m pytest -p no:randomly tests/test_cuda.py tests/test_backends.py tests/test_lora.py \
        -k "cuda or not (test_backends or test_lora)" "$@"
elif [ $# -eq 0 ]; then
    exec "$PY" -m pytest -p no:randomly tests/test_cuda.py tests/test_backends.py tests/test_lora.py -k \
        "(test_cuda and not model_logits and not batched_equals) or (test_backends and cuda and not runner and not layer_stack) or (test_lora and cuda)"
fi
exec "$PY" -m pytest -p no:randomly "$@"
