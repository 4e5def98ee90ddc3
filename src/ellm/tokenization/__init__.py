"""Pieces of ellm's tokenizer: building a `tokenizers` tokenizer from a GGUF vocabulary,
rendering chat templates in a sandbox, and streaming detokenization.

The public names live in `ellm.tokenizer`; import them from there.
"""
