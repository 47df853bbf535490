"""The repository passes its linter: ruff with the rules and line length of pyproject.toml
(``[tool.ruff]``: pyflakes, a few pycodestyle rules, 150 columns).

Skipped, saying why, where ruff is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from support.paths import ROOT



@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[test]' installs it)")
def test_ruff_passes_on_the_repository():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
