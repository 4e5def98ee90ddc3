"""Readers for model files (safetensors, GGUF) over read-only memory maps."""
from .errors import FormatError

__all__ = ["FormatError"]
