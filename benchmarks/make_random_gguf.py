"""Random-weight GGUF files of real model shapes, for speed measurements at 1B-8B.

Speed does not depend on the weights' values, so a file of Llama-3.2-1B's or
Llama-3-8B's exact shape with random weights times like the real one, and needs no
download. Three stages, each skipped when its output is already there:

1. folder: a Hugging Face folder of the shape (transformers' LlamaConfig, the model made
   on the meta device, its tensors filled from one random tile -- a full randn of 8B
   values takes long on 2 cores), in bf16, with a small byte-level BPE tokenizer (the
   converter pads the vocabulary to the shape's size).
2. f16: llama.cpp's own convert_hf_to_gguf.py (ELLM_LLAMA_CPP_DIR, as tests/run.sh
   fetches it) writes <shape>-f16.gguf.
3. quantize: llama-cpp-python's llama_model_quantize writes <shape>-Q4_K_M.gguf and
   <shape>-Q8_0.gguf (or the --types given) with llama.cpp's own quantizer.

Stages 1-2 run in a Python with torch + transformers (--ref-python, default the
reference venv .venv-ref), stage 3 in one with llama-cpp-python (--llamacpp-python,
default benchmarks/.venv-llamacpp, which `vs_llamacpp.py --install-llamacpp` builds).

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b
    python benchmarks/make_random_gguf.py --shape llama-3-8b --types Q4_K_M --out /data/random
    python benchmarks/make_random_gguf.py --shape qwen3-30b-a3b --layers 6 --types Q4_K_M
    python benchmarks/vs_llamacpp.py --models ~/.cache/ellm/random/llama-3.2-1b-Q4_K_M.gguf

Costs: the 1B shape writes ~2.5 GB twice (folder and f16) and takes a few minutes;
the 8B shape ~15 GB of RAM, ~35 GB of disk and ~25 minutes on 2 cores (the folder is
deleted once the f16 file is written unless --keep-folder). --layers N keeps the first N
layers of a shape (the file <shape>-<N>l-<type>.gguf): each layer reads and computes what
it does in the whole model, so the cost of a layer is the difference of two such files'
times. Qwen3-30B-A3B's 48 layers would take ~61 GB in bf16; 6 of them take ~8 GB of RAM
and ~2 minutes. Random routers send tokens to the experts less evenly than trained ones
(docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMACPP_VERSION = "0.3.36"

# Llama-family shapes (the published configs' sizes; values are random)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0),
    # Qwen3-MoE: 8 of 128 experts 768 wide a token (~3.3B of 30.5B weights read a token)
    "qwen3-30b-a3b": dict(config="Qwen3MoeConfig", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False, rope_theta=1000000.0),
}
# llama-cpp-python's names of the file types it writes (llama_ftype)
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
          "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}
TILE = 1_000_003  # values in the random tile (a prime, so rows do not repeat in step)
TOKENIZER_TEXT = """\
A model of this shape reads the same number of weight bytes per token as the real one,
whatever the numbers are, so its speed is the real model's speed. 0123456789 ( ) [ ] { }
"""


def ellm_home() -> Path:
    return Path(os.environ.get("ELLM_HOME", Path.home() / ".cache" / "ellm"))


def default_llamacpp_dir() -> Path:
    env = os.environ.get("ELLM_LLAMA_CPP_DIR")
    if env:
        return Path(env)
    return ellm_home() / f"llama-cpp-python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp"


# -- stage 1: the folder (reference Python) ----------------------------------------------

def make_folder(shape: str, folder: Path, seed: int, layers: int = 0) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sizes = dict(SHAPES[shape])
    config_class = getattr(tf, sizes.pop("config", "LlamaConfig"))
    if layers:
        sizes["num_hidden_layers"] = layers
    config = config_class(**sizes, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    model = model.to(dtype=torch.bfloat16).to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.tie_weights()  # to_empty gave the head storage of its own: one tensor again, as in the real file
    gen = torch.Generator().manual_seed(seed)
    tile = (torch.randn(TILE, generator=gen) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if "norm" in name:
                flat.fill_(1.0)
                continue
            # start each tensor at its own offset of the tile, then repeat the tile
            start = int(torch.randint(0, TILE, (1,), generator=gen))
            rolled = torch.cat([tile[start:], tile[:start]])
            n, at = flat.numel(), 0
            whole = n // TILE
            if whole:
                flat[:whole * TILE].view(whole, TILE).copy_(rolled.expand(whole, TILE))
                at = whole * TILE
            flat[at:].copy_(rolled[:n - at])
    # (the rotary inv_freq buffer is left empty: it is not saved, and nothing here runs the model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="2GB")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], bos_token=specials[1],
                                      eos_token=specials[2], unk_token=None)
    fast.save_pretrained(folder)
    (folder / "random_weights.json").write_text(json.dumps({"shape": shape, "layers": config.num_hidden_layers,
                                                            "seed": seed, "tile": TILE}))


# -- stage 2: the f16 GGUF (reference Python, llama.cpp's converter) ------------------------

def convert(folder: Path, out: Path, llama_cpp: Path) -> None:
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{llama_cpp} does not hold llama.cpp's convert_hf_to_gguf.py: run tests/run.sh once "
                         "(it fetches it into $ELLM_HOME), or set ELLM_LLAMA_CPP_DIR / --llama-cpp-dir")
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    import convert_hf_to_gguf
    from conversion import base

    # the converter knows pre-tokenizers by a hash of how they split a fixed text; this
    # small tokenizer is GPT-2's byte-level scheme, so it is named rather than hashed
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    tmp = out.with_name(out.name + ".part")
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outfile", str(tmp), "--outtype", "f16"]
    convert_hf_to_gguf.main()
    tmp.replace(out)


# -- stage 3: quantize (a Python with llama-cpp-python) ------------------------------------

def quantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    import ctypes

    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[qtype])
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {qtype}) returned {rc}")
    tmp.replace(dst)


# -- driver ----------------------------------------------------------------------------

def run_stage(python: str, *args: str) -> None:
    cmd = [python, str(Path(__file__).resolve()), *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def check_python(python: str, module: str, hint: str) -> None:
    if not Path(python).exists() and shutil.which(python) is None:
        raise SystemExit(f"{python} not found: {hint}")
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{python} cannot import {module}: {hint}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default $ELLM_HOME/random)")
    ap.add_argument("--types", default="Q4_K_M,Q8_0",
                    help=f"quantized files to write, of {','.join(FTYPES)} (empty: stop at f16)")
    ap.add_argument("--layers", type=int, default=0,
                    help="keep this many of the shape's layers (a file of <shape>-<n>l: each layer times as in the "
                         "whole model, in a fraction of the disk; 0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--ref-python", default=str(ROOT / ".venv-ref" / "bin" / "python"),
                    help="a Python with torch + transformers (stages 1-2)")
    ap.add_argument("--llamacpp-python", default=str(HERE / ".venv-llamacpp" / "bin" / "python"),
                    help="a Python with llama-cpp-python (stage 3)")
    ap.add_argument("--llama-cpp-dir", type=Path, default=None,
                    help="llama.cpp's source tree with convert_hf_to_gguf.py (default $ELLM_LLAMA_CPP_DIR, "
                         "else where tests/run.sh puts it)")
    ap.add_argument("--keep-folder", action="store_true", help="keep the Hugging Face folder after converting")
    ap.add_argument("--stage", choices=["folder", "convert", "quantize"], help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if not 0 <= args.layers <= SHAPES[args.shape]["num_hidden_layers"]:
        ap.error(f"--layers must be 0 (all) to {SHAPES[args.shape]['num_hidden_layers']} for {args.shape}, "
                 f"got {args.layers}")
    if args.stage == "folder":
        make_folder(args.shape, args.dst, args.seed, args.layers)
        return 0
    if args.stage == "convert":
        convert(args.src, args.dst, args.llama_cpp_dir)
        return 0
    if args.stage == "quantize":
        quantize(args.src, args.dst, args.types, args.threads)
        return 0

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        ap.error(f"unknown --types {','.join(unknown)}: choose from {','.join(FTYPES)}")
    out = (args.out or ellm_home() / "random").expanduser()
    out.mkdir(parents=True, exist_ok=True)
    llama_cpp = (args.llama_cpp_dir or default_llamacpp_dir()).expanduser()
    name = f"{args.shape}-{args.layers}l" if args.layers else args.shape
    folder = out / name
    f16 = out / f"{name}-f16.gguf"
    if any(not (out / f"{name}-{t}.gguf").exists() for t in types):  # before the long stages
        check_python(args.llamacpp_python, "llama_cpp",
                     "pass --llamacpp-python, or build one with benchmarks/vs_llamacpp.py --install-llamacpp")
    if not f16.exists():
        check_python(args.ref_python, "transformers", "pass --ref-python (torch + transformers)")
        if not (folder / "random_weights.json").exists():
            run_stage(args.ref_python, "--stage", "folder", "--shape", args.shape, "--seed", str(args.seed),
                      "--layers", str(args.layers), "--dst", str(folder))
        run_stage(args.ref_python, "--stage", "convert", "--src", str(folder), "--dst", str(f16),
                  "--llama-cpp-dir", str(llama_cpp))
        if not args.keep_folder:
            shutil.rmtree(folder)
    print(f"{f16} ({f16.stat().st_size / 1e9:.2f} GB)")
    for t in types:
        dst = out / f"{name}-{t}.gguf"
        if not dst.exists():
            run_stage(args.llamacpp_python, "--stage", "quantize", "--src", str(f16), "--dst", str(dst),
                      "--types", t, "--threads", str(args.threads))
        print(f"{dst} ({dst.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
