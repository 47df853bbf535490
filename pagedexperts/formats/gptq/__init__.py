"""Checkpoints of the GPTQ family of tools (GPTQ / GPTQModel, AWQ, AutoRound): their formats and
the per-module overrides they share (``dynamic``: GPTQModel's ``dynamic``, AutoRound's ``extra_config``).
"""
