"""Integrations with other libraries (each imports its library lazily): ``transformers`` (attn_implementation)."""
