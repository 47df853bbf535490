"""Speculative decoding inside the engine's continuous batching (docs/speculative-decoding.md):
options, proposers (n-gram, draft model), the acceptance rule and ``decoder.SpeculativeDecoder``.
"""
