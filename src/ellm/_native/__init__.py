"""Compiled extension modules (built from csrc/ through Cython)."""
