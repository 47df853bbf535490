"""The bundled model: the tiny Qwen3-MoE shipped inside the package (``pagedexperts/data``).

Owns its path and its routing traces' paths, with the standard library only (``preflight``,
``simulate`` and ``--model-path bundled`` import no torch). Does not: load it or quantize it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUNDLED_MODEL = "tiny-qwen3-moe"


def bundled_model_path() -> Path:
    """Directory of the tiny Qwen3-MoE model shipped inside the package."""
    return Path(str(resources.files("pagedexperts") / "data" / BUNDLED_MODEL))


def bundled_traces_path() -> Path:
    """Directory of the bundled model's own routing traces (``generate --record-trace`` on a few
    prompts; how, in its README.md), shipped inside the package: ``simulate --trace bundled``."""
    return Path(str(resources.files("pagedexperts") / "data" / "traces" / BUNDLED_MODEL))
