"""A clear error when the compiled part of ellm is missing or cannot load, and the
ELLM_SIMD override of the kernel level it picks."""
from __future__ import annotations

import os


class NativeModuleError(ImportError):
    pass


def check_native() -> None:
    try:
        from ._native import _core  # noqa: F401
    except ImportError as e:
        raise NativeModuleError(
            "ellm's compiled extension (ellm._native._core) could not be loaded: "
            f"{e}. Reinstall ellm from a wheel for this platform, or build it from source "
            "with a C compiler (`pip install --force-reinstall --no-binary ellm-engine ellm-engine`)."
        ) from e


def apply_simd_override() -> None:
    """ELLM_SIMD=<level> (scalar, avx2, avx512, amx, neon) runs the kernels of that level in
    place of the best one the CPU offers: a machine without the higher levels is then timed
    or reproduced bit for bit on one that has them. A level this CPU cannot run is an error,
    not a silent fallback."""
    name = os.environ.get("ELLM_SIMD", "").strip()
    if not name:
        return
    from ._native import _core
    try:
        _core.set_simd_level(name)
    except ValueError as e:
        raise ValueError(f"ELLM_SIMD={name!r}: {e}; this CPU runs "
                         f"{', '.join(_core.supported_simd_levels())}") from None
