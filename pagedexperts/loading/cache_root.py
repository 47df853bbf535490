"""The project's cache directory (``cache_root``), with the standard library only: the bundled
model's quantized variants and the stored kernel layouts (``kernel-layouts/``) live under it.
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
