"""The project's cache directory, with the standard library only.

Owns: where every cache of the project lives (``cache_root``): the bundled model's quantized
variants (``commands.quantize``) and the stored kernel layouts of checkpoints
(``loading.stored_layout``, in its ``kernel-layouts/`` subdirectory). Does not: write anything.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PAGEDEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/pagedexperts``, else ``~/.cache/pagedexperts``
    (an empty variable counts as unset), read when called."""
    if os.environ.get("PAGEDEXPERTS_CACHE"):
        return Path(os.environ["PAGEDEXPERTS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedexperts"
