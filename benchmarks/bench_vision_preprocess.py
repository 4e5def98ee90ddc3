"""Image decoding + preprocessing time: ellm.vision beside transformers' Pillow image
processors, on the same files, alternating, medians of several runs.

    python benchmarks/bench_vision_preprocess.py [--repeats 7]

Needs ELLM_REF_PYTHON (torch + transformers) and Pillow for it (tests/vision_data.py
installs one beside the reference); the photos are scikit-image's (fetched once).
Prints, per image and processor setting, the median ms of each and the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vision_data import ref_env, ref_python, skimage_photos  # noqa: E402

from ellm.vision.images import decode_image  # noqa: E402
from ellm.vision.preprocess import Gemma3Processing, Idefics3Processing  # noqa: E402

SETTINGS = {
    "smolvlm (1456 / 364 tiles)": ("idefics3", {}, Idefics3Processing()),
    "gemma3 (896)": ("gemma3", {"size": {"height": 896, "width": 896}}, Gemma3Processing()),
}
IMAGES = ["chelsea.png", "hubble_deep_field.jpg", "motorcycle_left.png"]

REF = r"""
import json, sys, time
from PIL import Image, ImageOps
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
job = json.load(open(sys.argv[1]))
out = {}
for case in job["cases"]:
    cls = Idefics3ImageProcessorPil if case["family"] == "idefics3" else Gemma3ImageProcessorPil
    proc = cls(**case["kwargs"])
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        img = ImageOps.exif_transpose(Image.open(case["path"]))
        proc(images=[[img]] if case["family"] == "idefics3" else [img])
        times.append(time.perf_counter() - t0)
    out[case["name"]] = times
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    photos = skimage_photos()
    cases = [{"name": f"{s}|{n}", "path": str(photos / n), "family": fam, "kwargs": kw}
             for s, (fam, kw, _) in SETTINGS.items() for n in IMAGES]
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"cases": cases, "repeats": args.repeats}))
        ref = subprocess.run([ref_python(), "-c", REF, str(job)], env=ref_env(), capture_output=True, text=True,
                             check=True)
    theirs = json.loads(ref.stdout.strip().splitlines()[-1])
    print(f"{'setting':28} {'image':24} {'ellm ms':>8} {'HF ms':>8} {'HF/ellm':>8}")
    for case in cases:
        processing = SETTINGS[case["name"].split("|")[0]][2]
        ours = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            processing.preprocess(decode_image(case["path"]))
            ours.append(time.perf_counter() - t0)
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs[case["name"]]) * 1e3
        setting, name = case["name"].split("|")
        print(f"{setting:28} {name:24} {a:8.1f} {b:8.1f} {b / a:8.2f}")


if __name__ == "__main__":
    main()
