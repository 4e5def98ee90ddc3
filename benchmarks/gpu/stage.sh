#!/usr/bin/env bash
# On the GPU machine: keep one carried part of the models (benchmarks/gpu/prepare.sh) in
# /tmp/ellm-gpu/parts, which outlives the call while the machine stays warm.
set -euo pipefail
mkdir -p /tmp/ellm-gpu/parts
cp "$1"/* /tmp/ellm-gpu/parts/
ls -la /tmp/ellm-gpu/parts
