"""The chat template's error type, apart from the Jinja sandbox (template.py) so that
loading a model need not import jinja2: the sandbox is imported at the first chat."""
from __future__ import annotations


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, raised on purpose (raise_exception),
    tried to reach Python internals, or went past its size or time limit."""
