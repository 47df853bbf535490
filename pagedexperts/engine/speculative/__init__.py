"""Speculative decoding (see the modules)."""
