"""Converts tiny model folders (tests/goldens/tiny_models.py) to GGUF with llama.cpp's own
convert_hf_to_gguf.py, unchanged but for one thing: the tiny tokenizer is new to it.

The converter recognises a BPE pre-tokenizer by hashing how it splits a fixed text and
refuses one it has not seen; the tiny tokenizer is GPT-2's byte-level scheme with its own
320-token vocabulary, so it is named "gpt-2" here instead of hashed. Run it with the
reference Python (torch + transformers):
    python tests/goldens/convert_tiny.py LLAMA_CPP_DIR OUT_DIR FOLDER... [--outtypes f32,q8_0] [--mmproj]
writes OUT_DIR/<folder name>-<outtype>.gguf, and with --mmproj the vision tower of each
vision-language folder (tests/goldens/tiny_vision_models.py) as
OUT_DIR/mmproj-<folder name>-<outtype>.gguf. LLAMA_CPP_DIR is llama.cpp's source tree
(vendor/llama.cpp of the llama-cpp-python sdist; only the converter and gguf-py are used).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("llama_cpp", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--outtypes", default="f32,q8_0")
    p.add_argument("--mmproj", action="store_true",
                   help="also write each vision model's tower: OUT_DIR/mmproj-<folder name>-<outtype>.gguf")
    args = p.parse_args()
    sys.path[:0] = [str(args.llama_cpp / "gguf-py"), str(args.llama_cpp)]
    import convert_hf_to_gguf
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for folder in args.folders:
        for outtype in args.outtypes.split(","):
            out = args.out_dir / f"{folder.name}-{outtype}.gguf"
            sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outfile", str(out), "--outtype", outtype]
            if "phi3" in folder.name:
                # llama.cpp's vocabulary loader wants SentencePiece's <s>, </s> and <unk>
                # in any file whose general.name contains "phi3"; the tiny BPE has none.
                sys.argv += ["--model-name", "tiny-random"]
            convert_hf_to_gguf.main()
            if args.mmproj:
                sys.argv = ["convert_hf_to_gguf.py", str(folder), "--mmproj", "--outtype", outtype,
                            "--outfile", str(args.out_dir / f"mmproj-{folder.name}-{outtype}.gguf")]
                convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
