"""What `ellm`'s command line means, checked before a model loads: the words of `ellm run`,
whether `ellm serve` can have its port, and the NAME=PATH items of --lora-modules. A mistake
here costs the user a model load (seconds to minutes) when it is found only afterwards."""
from __future__ import annotations

import argparse
import errno
import socket

from . import hub


class CommandLineError(ValueError):
    """The command line cannot mean anything runnable; the message says what to type."""


def split_model_prompt(words: list[str]) -> tuple[str | None, str]:
    """`ellm run [MODEL] PROMPT...` -> (model or None for the default, prompt).

    The first of several words is the model when it names one (a known name, a path or an
    org/name repo id; see hub.names_a_model), or when the only word after it is a quoted
    prompt (so a misspelt model name is an error, not part of a prompt). Otherwise every word
    belongs to the prompt, so an unquoted prompt works: `ellm run Why is the sky blue?`.
    A lone word that names a model is refused: the user forgot the prompt, and sending the
    model's name to the default model as a prompt would hide that."""
    if not words:
        raise CommandLineError('no prompt: ellm run [MODEL] "PROMPT" (PROMPT - reads it from stdin)')
    first, rest = words[0], words[1:]
    if not rest:
        if first != "-" and not _has_space(first) and hub.names_a_model(first):
            raise CommandLineError(f'no prompt after the model {first!r}: ellm run {first} "PROMPT" '
                                   "(PROMPT - reads it from stdin)")
        return None, first
    if not _has_space(first) and (hub.names_a_model(first) or (len(rest) == 1 and _has_space(rest[0]))):
        return first, " ".join(rest)
    return None, " ".join(words)


def _has_space(word: str) -> bool:
    return any(c.isspace() for c in word)


def port_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (in use, not an address of this machine, not
    permitted), or None. Bound and released at once with SO_REUSEADDR, as uvicorn binds, so a
    port with only closed connections in TIME_WAIT is not refused; one with a listener is."""
    if not 0 < port < 65536:
        return None   # the server's own check names the range
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {host!r}: {e.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use (another server?); choose another with --port"
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def lora_modules(items: list[str] | None) -> dict[str, str]:
    """[lora] --lora-modules NAME=PATH ... (vLLM's spelling) -> {name: path}, in order."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise CommandLineError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in out:
            raise CommandLineError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def add_quantize_argument(p: argparse.ArgumentParser) -> None:
    """--quantize: ellm.load's quantize (the same choices), for every command that loads."""
    from .quantize import QUANTIZE_TYPES
    p.add_argument("--quantize", default=None, choices=sorted(QUANTIZE_TYPES),
                   help="quantize a Hugging Face folder's float weights at load (a GGUF keeps its own types)")


def device_arg(value: str) -> str:
    """--device: one of ops.DEVICES (also gpu, cuda:0); another GPU ordinal is refused
    with how to pick that GPU (CUDA_VISIBLE_DEVICES)."""
    from .ops import DEVICES, normalize_device
    try:
        device = normalize_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device not in DEVICES:
        raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose from {', '.join(DEVICES)})")
    return device
