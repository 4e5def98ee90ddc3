"""A clear error when the compiled part of ellm is missing or cannot load."""
from __future__ import annotations


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
