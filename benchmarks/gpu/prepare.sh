#!/usr/bin/env bash
# Prepare, on a machine WITHOUT a GPU, everything benchmarks/gpu/check.sh needs on the
# lent GPU machine (which can fetch nothing): a cp312 ellm wheel, the wheels missing
# there (llguidance, gguf), and the real models cut into parts small enough to travel
# (a device call carries at most 64 MiB: the working tree plus its `carry` paths).
#
#   bash benchmarks/gpu/prepare.sh [smollm2|all]      (default: smollm2; all adds Gemma 3)
#
# Writes .gpu-carry/ (git-ignored through .git/info/exclude): wheels/ and part-NN/
# folders, and prints the device calls to make, in order (docs/gpu.md).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
which="${1:-smollm2}"
LIMIT=$((64 * 1024 * 1024))   # bytes a device call may carry, the working tree included
OUT=.gpu-carry
PART_MB=56
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF "/$OUT/" "$EXCLUDE" 2>/dev/null || echo "/$OUT/" >> "$EXCLUDE"
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/split"
CACHE="${ELLM_HOME:-$HOME/.cache/ellm}"

# 1. the ellm wheel for CPython 3.12 (the GPU machine's Python), built here
PY312="$(PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12 || true)"
if [ -n "$PY312" ]; then
  "$PY312" -m pip wheel --no-deps -q -w "$OUT/wheels" .
else
  echo "prepare.sh: no Python 3.12 here; check.sh will build ellm from source there (needs gcc)" >&2
fi

# 2. wheels the GPU machine lacks (its package list: /work/.library/device/KINDS.md)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT/wheels" llguidance gguf

# 3. the models, cut into parts, with their sha256 (check.sh puts them back together)
files=("$CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
[ "$which" = all ] && files+=("$CACHE/models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf")
: > "$OUT/wheels/models.sha256"
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "prepare.sh: $f is missing: run 'ellm pull' for it first" >&2; exit 1; }
  (cd "$(dirname "$f")" && sha256sum "$(basename "$f")") | sed "s|  |  $(basename "$(dirname "$f")")/|" >> "$OUT/wheels/models.sha256"
  split -b "${PART_MB}M" -d -a 2 "$f" "$OUT/split/$(basename "$(dirname "$f")")__$(basename "$f").part"
done
# one part per carry folder; the wheels (a few MB) ride with the last call
i=0
for p in "$OUT"/split/*; do
  d=$(printf "%s/part-%02d" "$OUT" "$i"); mkdir -p "$d"; mv "$p" "$d/"; i=$((i + 1))
done
rmdir "$OUT/split"
du -sh "$OUT"/* | sed 's/^/  /'

# 4. every call fits: what the device tool copies (tracked + untracked-not-ignored files of
# the working tree) plus that call's carry folders, under 64 MiB
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels=$(du -sb "$OUT/wheels" | cut -f1)
echo "  working tree $((tree / 1024)) KiB (git archive HEAD: $(( $(git archive HEAD | wc -c) / 1024 )) KiB)"
n_parts=$(ls -d "$OUT"/part-* | wc -l)
for k in $(seq 0 $((n_parts - 1))); do
  d=$(printf "%s/part-%02d" "$OUT" "$k")
  size=$(( tree + $(du -sb "$d" | cut -f1) ))
  [ "$k" -eq $((n_parts - 1)) ] && size=$(( size + wheels ))
  echo "  call $((k + 1)) carries $((size / 1024 / 1024)) MiB of 64"
  if [ "$size" -gt "$LIMIT" ]; then
    echo "prepare.sh: call $((k + 1)) would carry $size bytes, over the 64 MiB a device call takes" >&2
    exit 1
  fi
done
echo
echo "Device calls, one right after the other (the machine stays warm ~30 s between calls):"
n=$((i - 1))
for k in $(seq 0 "$n"); do
  d=$(printf "%s/part-%02d" "$OUT" "$k")
  if [ "$k" -lt "$n" ]; then
    echo "  run(carry=[\"$d\"], command=\"bash benchmarks/gpu/stage.sh $d\", timeout_s=120)"
  else
    echo "  run(carry=[\"$d\", \"$OUT/wheels\"], command=\"bash benchmarks/gpu/stage.sh $d && bash benchmarks/gpu/check.sh\", timeout_s=560)"
  fi
done
