"""The optional extras (pyproject's ``[project.optional-dependencies]``): which module each
provides, and ``require``, the one check a feature makes before work that needs one (the
message names the extra and its ``pip install`` line). Imports nothing at module import;
standard library only.
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
    """Import the modules of ``extra`` (a key of ``EXTRAS``; ``modules``: a subset) for ``feature``
    (the flag or command that needs it).

    Raises:
        MissingExtra: a module does not import; names the feature, the module and the install line.
        KeyError: ``extra`` is not an extra of this package.
    """
    for name in modules or EXTRAS[extra]:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingExtra(f"{feature} needs {name}, from the '{extra}' extra: pip install -e '.[{extra}]' "
                               f"(or pip install 'pagedexperts[{extra}]')") from exc
