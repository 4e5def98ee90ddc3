"""Folders the reference scripts make (peft goldens, converted GGUFs), kept between test
sessions under $ELLM_HOME/test-goldens, keyed by everything that decides their bytes:
the scripts' own text, the reference packages' versions and any other input given.

A script that takes a minute of torch and peft then runs once per change of its inputs,
not once per session. A folder is made in a temporary sibling and renamed into place
whole, so two sessions at once never see half of one."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

REF_PACKAGES = ("torch", "transformers", "peft", "gguf", "safetensors", "numpy")
_versions: dict[str, str] = {}


def ref_versions(python: str) -> str:
    """The reference interpreter's versions of the packages the scripts use (asked once)."""
    if python not in _versions:
        code = ("import importlib.metadata as m\n"
                f"for p in {REF_PACKAGES!r}:\n"
                "    try: print(p, m.version(p))\n"
                "    except m.PackageNotFoundError: print(p, None)\n")
        _versions[python] = subprocess.run([python, "-c", code], check=True, capture_output=True,
                                           text=True).stdout
    return _versions[python]


def cached_folder(name: str, inputs: Iterable[bytes | str | Path], make: Callable[[Path], None]) -> Path:
    """The folder `make(path)` fills, made once for these inputs (files are read: their
    bytes count, not their names) and reused by every later session."""
    digest = hashlib.sha256()
    for item in inputs:
        data = item.read_bytes() if isinstance(item, Path) else item.encode() if isinstance(item, str) else item
        digest.update(len(data).to_bytes(8, "little") + data)
    root = Path(os.environ.get("ELLM_HOME", Path.home() / ".cache" / "ellm")) / "test-goldens"
    final = root / f"{name}-{digest.hexdigest()[:20]}"
    if (final / ".complete").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        make(work / "out")
        (work / "out" / ".complete").write_text("")
        try:
            os.rename(work / "out", final)
        except OSError:   # another session put it there first (or a stale half: replaced)
            if not (final / ".complete").is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(work / "out", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
