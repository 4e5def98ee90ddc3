"""The part of cupy_backends that ops/cuda.py uses, for the host stand-in (tests/cuda_host)."""
