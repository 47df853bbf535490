"""The optional extras (pyproject's ``[project.optional-dependencies]``) and the one check a
feature makes before it starts work that needs one.

Owns: which module each extra provides and the message a user sees when it is missing (the
extra's name and the ``pip install`` line). Does not: import anything at module import (the
package imports with no extra installed; ``tests/project/test_optional_extras.py`` keeps it so).
Standard library only.
"""

from __future__ import annotations

import importlib

# extra -> the modules it installs that the package imports (pyproject.toml)
EXTRAS = {
    "gpu": ("triton",),
    "server": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
    "plots": ("matplotlib",),
    "quant": ("compressed_tensors", "accelerate"),
    "modelopt": ("modelopt",),
}


class MissingExtra(ImportError, ValueError):
    """A feature needs an optional extra that is not installed. An ``ImportError`` (what an
    import of a module that needs the extra raises) and a ``ValueError``, so that the CLI answers
    it like any bad input: one line, exit 2, before any work."""


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Import the modules of ``extra`` (or the given subset) or raise.

    Args:
        extra: a key of ``EXTRAS``.
        feature: what needs it, as the user asked for it (a flag or a command), for the message.
        modules: the modules to check (default: all of the extra's).
    Raises:
        MissingExtra: a module does not import; names the feature, the module and the install line.
        KeyError: ``extra`` is not an extra of this package (a programming error).
    """
    for name in modules or EXTRAS[extra]:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingExtra(f"{feature} needs {name}, from the '{extra}' extra: pip install -e '.[{extra}]' "
                               f"(or pip install 'pagedexperts[{extra}]')") from exc
