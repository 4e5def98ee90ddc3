"""Images and reference processors for the vision input tests.

Real photos come from scikit-image's wheel on the package index (its skimage/data
holds a dozen photographs in PNG and JPEG), fetched once with pip into
$ELLM_HOME/skimage-data-<version>, as tests/run.sh fetches llama.cpp's converter.
transformers' image processors need Pillow, which the reference venv does not carry: it
is installed beside it (pip --target $ELLM_HOME/ref-pillow-<version>) and put on the
reference's PYTHONPATH, so .venv-ref itself is never changed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ellm import hub
from ref_python import ref_python

SKIMAGE_VERSION = "0.26.0"
PILLOW_VERSION = "13.0.0"
REF_SCRIPT = Path(__file__).resolve().parent / "goldens" / "vision_ref.py"
# The photographs used (name: what makes it useful)
PHOTOS = {
    "astronaut.png": "512x512 RGB",
    "chelsea.png": "451x300 RGB, landscape",
    "coffee.png": "600x400 RGB",
    "camera.png": "512x512 grayscale",
    "rocket.jpg": "427x640 JPEG, portrait",
    "hubble_deep_field.jpg": "872x1000 JPEG",
    "motorcycle_left.png": "741x500 RGB",
}


def _home() -> Path:
    return hub.cache_dir()


def skimage_photos() -> Path:
    """The folder holding PHOTOS (fetched on first use)."""
    out = _home() / f"skimage-data-{SKIMAGE_VERSION}"
    if all((out / name).is_file() for name in PHOTOS):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"scikit-image=={SKIMAGE_VERSION}", "-d", tmp], check=True, capture_output=True)
        wheel = next(Path(tmp).glob("scikit_image-*.whl"))
        part = Path(tmp) / "data"
        part.mkdir()
        with zipfile.ZipFile(wheel) as z:
            for name in PHOTOS:
                (part / name).write_bytes(z.read(f"skimage/data/{name}"))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(str(part), str(out))
    return out


def ref_env() -> dict[str, str]:
    """The environment for the reference: Pillow (installed beside .venv-ref) on PYTHONPATH."""
    target = _home() / f"ref-pillow-{PILLOW_VERSION}"
    if not (target / "PIL" / "__init__.py").is_file():
        subprocess.run([ref_python(), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"pillow=={PILLOW_VERSION}"], check=True, capture_output=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_ref(*args: str) -> None:
    proc = subprocess.run([ref_python(), str(REF_SCRIPT), *args], env=ref_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"vision_ref.py {args[0]} failed:\n{proc.stderr[-4000:]}")
