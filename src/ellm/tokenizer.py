"""Text <-> token ids for a model, its chat template, and streaming detokenization.

A Tokenizer wraps a Hugging Face `tokenizers.Tokenizer` (Rust) built either from a model
folder (tokenizer.json + tokenizer_config.json, ...) or from the vocabulary in a GGUF file.
encode / decode follow transformers' semantics, so ids match the Python reference:
special tokens written in the text are parsed as special tokens, and add_special_tokens
adds BOS only where the model adds it.

    tok = Tokenizer.from_gguf(GGUFFile("model.gguf"))
    ids = tok.encode("Hello")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    detok = tok.incremental(ids)
    for t in new_ids: print(detok.push(t), end="")
    print(detok.flush())
"""
from __future__ import annotations

import gc
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from .chat_templates import builtin_template
from .formats.errors import FormatError
from .formats.files import read_regular_file
from .tokenization.gguf_vocab import backend_from_gguf, template_processor
from .tokenization.incremental import IncrementalDetokenizer
from .tokenization.template_errors import ChatTemplateError

if TYPE_CHECKING:
    from .formats.gguf import GGUFFile

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

# Control tokens that end a turn or a document in common vocabularies. Like llama.cpp, we
# stop generation on any of them that the vocabulary has as a special token, besides the
# configured EOS: Gemma's <end_of_turn> ends every chat reply while its EOS is <eos>.
# Side files of a model folder are read whole; these bound them (Gemma 3's tokenizer.json
# is 33 MB, configs are a few kB).
_MAX_TOKENIZER_JSON = 1 << 30
_MAX_SIDE_JSON = 64 << 20

_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<|return|>")


class Tokenizer:
    """A model's tokenizer. Build with `from_folder` or `from_gguf`."""

    def __init__(self, backend: Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, pad_token: str | None = None,
                 eos_token_ids: Sequence[int] = (), chat_template: str | None = None,
                 name: str = "", chat_template_builtin: bool = False) -> None:
        self.backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id: int | None = self._id_of(bos_token)
        self.pad_token_id: int | None = self._id_of(pad_token)
        self.chat_template: str | None = chat_template
        # True when the model files carry no template and ellm supplied its family's
        # standard one (Gemma GGUFs): such a model may be a base model, not a chat model.
        self.chat_template_builtin = chat_template_builtin
        added = backend.get_added_tokens_decoder()
        special = {t.content for t in added.values() if t.special}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # SentencePiece byte-fallback tokens; the streaming detokenizer treats their runs whole
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self.byte_token_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None)
        ids: list[int] = []
        for i in [*eos_token_ids, self._id_of(eos_token),
                  *(self._id_of(t) for t in _END_OF_GENERATION if t in special)]:
            if i is not None and i not in ids:
                ids.append(int(i))
        self.eos_token_ids: list[int] = ids
        self.eos_token_id: int | None = ids[0] if ids else None
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos: bool = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]

    def _id_of(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token else None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """The tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata. A
        vocabulary that cannot be built is a FormatError naming the file."""
        with _vocabulary_errors(gguf.path, "tokenizer.ggml.* metadata"), _collector_paused():
            return cls._from_gguf(gguf)

    @classmethod
    def _from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        from .hub import cache_dir
        meta = gguf.metadata
        backend = backend_from_gguf(meta, merges_cache=cache_dir() / "tokenizers")
        tokens = meta["tokenizer.ggml.tokens"]

        def named(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return backend.id_to_token(int(i)) if i is not None and 0 <= int(i) < len(tokens) else None

        arch = meta.get("general.architecture")
        own = meta.get("tokenizer.chat_template")
        return cls(backend, bos_token=named("bos_token_id"), eos_token=named("eos_token_id"),
                   unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
                   chat_template=own or builtin_template(arch), name=str(gguf.path),
                   chat_template_builtin=not own)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A Hugging Face model folder: tokenizer.json, plus tokenizer_config.json (special
        tokens, add_bos_token, chat template), chat_template.jinja, generation_config.json
        and config.json (end-of-generation ids, architecture) where present. A folder
        without tokenizer.json is a FileNotFoundError; malformed files are a FormatError."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json")
        with _vocabulary_errors(folder, "tokenizer files"), _collector_paused():
            return cls._from_folder(folder, path)

    @classmethod
    def _from_folder(cls, folder: Path, path: Path) -> Tokenizer:
        backend = Backend.from_str(read_regular_file(path, _MAX_TOKENIZER_JSON).decode("utf-8"))
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        # Tokens listed in tokenizer_config but missing from tokenizer.json are added, as
        # transformers does on load.
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        extra = []
        for spec in (cfg.get("added_tokens_decoder") or {}).values():
            if isinstance(spec, dict) and spec.get("content") and spec["content"] not in known:
                extra.append(AddedToken(spec["content"], special=bool(spec.get("special", False)),
                                        normalized=bool(spec.get("normalized", False)),
                                        lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                                        single_word=bool(spec.get("single_word", False))))
        if extra:
            backend.add_tokens(extra)

        names = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if names["bos_token"] is None:
            names["bos_token"] = _name_of(backend, _first_id(model_cfg, gen_cfg, "bos_token_id"))
        if names["eos_token"] is None:
            names["eos_token"] = _name_of(backend, _first_id(model_cfg, gen_cfg, "eos_token_id"))
        # An explicit add_bos_token / add_eos_token rebuilds the post-processor, as in transformers.
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            def pair(name: str, flag: str) -> tuple[str, int] | None:
                tok = names[name]
                tid = backend.token_to_id(tok) if tok else None
                return (tok, tid) if cfg.get(flag) and tok is not None and tid is not None else None
            backend.post_processor = template_processor(pair("bos_token", "add_bos_token"),
                                                        pair("eos_token", "add_eos_token"))

        eos_ids = _id_list(gen_cfg.get("eos_token_id")) + _id_list(model_cfg.get("eos_token_id")) + \
            _id_list((model_cfg.get("text_config") or {}).get("eos_token_id"))
        # the architecture picks a built-in template; a tokenizer-only folder names its class
        arch = model_cfg.get("model_type") or (model_cfg.get("text_config") or {}).get("model_type") or \
            str(cfg.get("tokenizer_class") or "").lower()
        own = _folder_template(folder, cfg)
        return cls(backend, **names, eos_token_ids=eos_ids, chat_template=own or builtin_template(arch),
                   name=str(folder), chat_template_builtin=not own)

    # ---- text <-> ids ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text become their ids;
        add_special_tokens adds BOS (and EOS) only where the model's tokenizer adds them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (in parallel, in Rust)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text for `ids`; with skip_special_tokens, special tokens are left out."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def incremental(self, prompt_ids: Sequence[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming detokenizer that continues after `prompt_ids`."""
        backend = self.backend

        def decode(ids: list[int], skip: bool) -> str:
            return backend.decode(ids, skip_special_tokens=skip)

        return IncrementalDetokenizer(decode, prompt_ids, skip_special_tokens,
                                      byte_ids=self.byte_token_ids, special_ids=self.special_token_ids)

    # ---- chat --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for a conversation, rendered by the model's chat template the way
        transformers' `apply_chat_template(tokenize=False)` renders it. Extra keyword
        arguments reach the template as variables. Raises ChatTemplateError when the model
        has no template or the template fails."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if not template:
            raise ChatTemplateError(f"{self.name or 'this tokenizer'} has no chat template")
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                   "unk_token": self.unk_token, "pad_token": self.pad_token}
        from .tokenization.template import render_chat  # jinja2: at the first chat, not at load
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           special_tokens=special, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation, as transformers' `apply_chat_template`
        (tokenize=True) gives them: the template writes any BOS itself, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, add_bos={self.add_bos})")


# ---- folder helpers --------------------------------------------------------------------

@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a vocabulary is built. The build makes
    hundreds of thousands of small tuples (a merge list), and each 700 of them start a
    collection that walks the young objects, and now and then every object: on Gemma 3's
    515k merges, about 0.25 s of its 1.6 s load. The build makes no cycles, so nothing is left
    for the collector afterwards."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def _vocabulary_errors(path: str | Path, what: str) -> Iterator[None]:
    """Turns every way a malformed vocabulary can fail into FormatError(path, ...).

    The tokenizers library reports bad input as bare Exception, and a Rust panic inside it
    as pyo3_runtime.PanicException, which derives from BaseException and so escapes every
    `except Exception`; both come from the file's contents, not from a bug here."""
    try:
        yield
    except FormatError:
        raise
    except FileNotFoundError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        if not (isinstance(e, Exception) or _is_rust_panic(e)):
            raise
        raise FormatError(path, f"{what} do not make a tokenizer: {type(e).__name__}: {_first_line(e)}") from e


def _is_rust_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= limit else text[:limit] + "..."


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    data = json.loads(read_regular_file(path, _MAX_SIDE_JSON))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first_id(*cfgs_and_key: Any) -> int | None:
    *cfgs, key = cfgs_and_key
    for cfg in cfgs:
        ids = _id_list(cfg.get(key))
        if ids:
            return ids[0]
    return None


def _name_of(backend: Backend, token_id: int | None) -> str | None:
    return backend.id_to_token(token_id) if token_id is not None else None


def _folder_template(folder: Path, cfg: dict) -> str | None:
    """chat_template.jinja (transformers 5 writes it there), else chat_template.json, else
    the tokenizer_config entry (a string, or a list of named templates: take "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return read_regular_file(jinja, _MAX_SIDE_JSON).decode("utf-8")
    value = _read_json(folder / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) and value else None
