"""Coverage-guided fuzzing (atheris / libFuzzer) of the model-file readers.

Targets:
  gguf         formats.gguf.GGUFFile, then every tensor read (raw, array, dequantize)
  safetensors  formats.safetensors.SafetensorsFile, then every tensor read
  vocab        GGUFFile -> Tokenizer.from_gguf (the GGUF vocabulary builder), then
               encode / decode of a fixed text
  config       GGUFFile -> ellm.models.config_from_gguf (the model config builder)

An input passes when it parses or is refused with FormatError / ConfigError; any other
exception (a TypeError, a RecursionError, a tokenizers PanicException, a MemoryError under
the address-space cap) is a crash that libFuzzer saves as crash-<sha1>. Each input may run
for at most -timeout seconds (else timeout-<sha1>: a hang), and the address space is capped
with resource.setrlimit at what the process has mapped at start plus --cap-mb (default
1024), so an input that tries to allocate far beyond its own size fails inside the cap.

Run (one target at a time, niced; needs `pip install -e '.[fuzz]'`):

    nice -n 10 .venv/bin/python tests/fuzz/fuzz_readers.py gguf -- \
        -max_total_time=600 -timeout=10 -print_final_stats=1 build/fuzz/gguf

The corpus folder is created and seeded with small valid files when empty. The last lines
libFuzzer prints give the executions (stat::number_of_executed_units) and whether it
stopped early on a crash, timeout or out-of-memory input (-rss_limit_mb, default 2048).
"""
from __future__ import annotations

import argparse
import inspect
import os
import resource
import sys
import tempfile
from pathlib import Path

import atheris

import numpy as np

from ellm.config import ConfigError
from ellm.formats.errors import FormatError
from ellm.formats.gguf import GGUFFile
from ellm.formats.safetensors import SafetensorsFile
from ellm.models import config_from_gguf
from ellm.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seeds import write_seeds  # noqa: E402

_SCRATCH = Path(tempfile.mkdtemp(prefix="ellm-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
_INPUT = {"gguf": "input.gguf", "safetensors": "input.safetensors", "vocab": "input.gguf", "config": "input.gguf"}


def _touch_gguf(g: GGUFFile) -> None:
    for name, info in g.tensors.items():
        g.raw(name).sum()
        if info.n_elements <= 1 << 16:
            try:
                g.dequantize(name)
            except FormatError:
                pass


def _touch_safetensors(f: SafetensorsFile) -> None:
    for name in f.tensors:
        f.array(name).reshape(-1).view(np.uint8).sum()


def _build_vocab(g: GGUFFile) -> None:
    tok = Tokenizer.from_gguf(g)
    ids = tok.encode("Hello world, 123 <s> héllo\n\t  !", add_special_tokens=True)
    tok.decode(ids)
    tok.decode(list(range(min(tok.vocab_size, 64))))


def one_input(target: str, data: bytes) -> None:
    path = _SCRATCH / _INPUT[target]
    path.write_bytes(data)
    try:
        if target == "gguf":
            _touch_gguf(GGUFFile(path))
        elif target == "safetensors":
            _touch_safetensors(SafetensorsFile(path))
        elif target == "vocab":
            _build_vocab(GGUFFile(path))
        else:
            config_from_gguf(GGUFFile(path))
    except (FormatError, ConfigError):
        pass


def instrument_ellm() -> int:
    """Adds coverage probes to every Python function of the loaded ellm modules.

    (ellm is installed editable, through an import hook that atheris' import-time
    instrumentation does not see, and instrument_all() would also instrument numpy and
    the standard library, which takes minutes.)"""
    done: set[int] = set()

    def visit(obj: object, module: str) -> None:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    visit(f, module)
            return
        if inspect.isfunction(obj) and obj.__module__ == module and id(obj.__code__) not in done:
            atheris.instrument_func(obj)
            done.add(id(obj.__code__))
        elif inspect.isclass(obj) and obj.__module__ == module:
            for value in vars(obj).values():
                visit(value, module)

    for name, mod in list(sys.modules.items()):
        if name == "ellm" or name.startswith("ellm."):
            for value in list(vars(mod).values()):
                visit(value, name)
    return len(done)


def cap_address_space(cap_mb: int) -> int:
    """RLIMIT_AS = what is mapped now + cap_mb; returns the limit in bytes."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + cap_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return limit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=sorted(_INPUT))
    ap.add_argument("--cap-mb", type=int, default=1024, help="address space allowed above the start")
    ap.add_argument("libfuzzer", nargs=argparse.REMAINDER, help="after --: libFuzzer flags and corpus folders")
    args = ap.parse_args()
    fuzz_args = [a for a in args.libfuzzer if a != "--"]
    for folder in (a for a in fuzz_args if not a.startswith("-")):
        Path(folder).mkdir(parents=True, exist_ok=True)
        if not any(Path(folder).iterdir()):
            write_seeds(args.target, Path(folder))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    limit = cap_address_space(args.cap_mb)
    print(f"fuzz {args.target}: address space capped at {limit / 2**30:.2f} GiB", flush=True)
    target = args.target
    print(f"instrumented {instrument_ellm()} functions of ellm", flush=True)
    atheris.Setup([sys.argv[0], *fuzz_args], lambda data: one_input(target, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
