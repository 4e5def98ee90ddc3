"""ellm: a PyTorch-free LLM inference engine."""
__version__ = "0.1.0"
