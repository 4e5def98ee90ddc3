"""Built-in chat templates for models whose files carry none.

Each family that has a fixed, documented turn format ships it as `CHAT_TEMPLATE` in its
module (models/<family>.py); this looks it up by architecture.
"""
from __future__ import annotations


def builtin_template(architecture: str | None) -> str | None:
    """The template to use for `architecture` (a GGUF `general.architecture` or a config.json
    `model_type`) when the model files hold none, or None if there is no standard one."""
    from .models import builtin_chat_template
    return builtin_chat_template(architecture.lower() if architecture else None)


def __getattr__(name: str) -> str:
    # GEMMA_TEMPLATE moved to models/gemma.py (CHAT_TEMPLATE); kept reachable here.
    if name == "GEMMA_TEMPLATE":
        from .models.gemma import CHAT_TEMPLATE
        return CHAT_TEMPLATE
    raise AttributeError(name)
