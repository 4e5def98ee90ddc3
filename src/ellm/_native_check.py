"""A clear error when the compiled part of ellm is missing or cannot load, and the
ELLM_SIMD override of the kernel level it picks."""
from __future__ import annotations

import os
import sys


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


def started_as_the_cli() -> bool:
    """Whether this import of ellm is the `ellm` command starting (its console script, or
    `python -m ellm`), which reports an error in one line rather than as a traceback."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0).lower() in ("ellm", "ellm.exe", "ellm-script.py"):
        return True
    # `python -m ellm`: while Python looks for ellm.__main__, argv[0] is "-m"
    orig = getattr(sys, "orig_argv", [])
    return argv0 == "-m" and any(a == "-m" and b in ("ellm", "ellm.cli") for a, b in zip(orig, orig[1:]))


def check_startup() -> None:
    """The checks `import ellm` makes. Their errors stop the import; the `ellm` command
    prints them as its other errors are printed (`error: ...`, exit status 2)."""
    try:
        check_native()
        apply_simd_override()
    except (NativeModuleError, ValueError) as e:
        if not started_as_the_cli():
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
