"""scripts/bootstrap.sh installs only when there is something to do (issue 33 item 12): the
first run installs and leaves a stamp, a second run installs nothing, an edited pyproject.toml
or --force installs again, an unknown argument exits 2 before anything.

Runs the script in a copy of the repository's pyproject.toml and script, whose .venv/bin/python
is a wrapper: ``-m pip ...`` and the closing torch import are logged and skipped (no install, no
network, seconds), anything else runs this test's own interpreter, where pagedexperts is installed.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT


pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum")


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # the CPU-index probe answers as $RESOLVES says (1: download.pytorch.org resolves), as no network is asked
    python.write_text(f'#!/bin/sh\ncase "$*" in "-m pip "*|*"import torch"*) echo "$*" >> "{tmp_path}/pip.log"; exit 0;;\n'
                      f'  *getaddrinfo*) [ "$RESOLVES" = 1 ]; exit $?;; esac\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return tmp_path


def _bootstrap(repo: Path, *args: str, **env: str) -> tuple[int, str, list[str]]:
    """Run the script in ``repo``: (exit code, stdout + stderr, the install commands it ran).
    ``env``: extra environment (default: PyTorch's CPU index does not resolve)."""
    log = repo / "pip.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PAGEDEXPERTS_TORCH_INDEX"} | {"RESOLVES": "0"} | env
    proc = subprocess.run(["bash", "scripts/bootstrap.sh", *args], cwd=repo, capture_output=True, text=True,
                          timeout=120, env=env)
    return proc.returncode, proc.stdout + proc.stderr, log.read_text().splitlines() if log.exists() else []


INSTALL = ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0", "-m pip install -q -e .[all]",
           "-c import torch, transformers, pagedexperts; print('pagedexperts', pagedexperts.__version__, 'torch', "
           "torch.__version__, 'transformers', transformers.__version__)"]


def test_installs_once_then_only_when_pyproject_changes_or_forced(repo):
    rc, out, pip = _bootstrap(repo)
    assert (rc, pip) == (0, INSTALL), out
    assert (repo / ".venv" / ".bootstrap-stamp").exists()

    rc, out, pip = _bootstrap(repo)
    assert (rc, pip) == (0, []), out
    assert out.startswith("bootstrap: .venv up to date (pagedexperts ") and "nothing installed (--force reinstalls)" in out

    with (repo / "pyproject.toml").open("a") as f:
        f.write("# a new dependency would go here\n")
    rc, out, pip = _bootstrap(repo)
    assert (rc, pip) == (0, INSTALL), out

    rc, out, pip = _bootstrap(repo, "--force")
    assert (rc, pip) == (0, INSTALL), out


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("env, index", [
    ({"RESOLVES": "0"}, None),  # a machine with its own mirror (CI): pip's configured sources
    ({"RESOLVES": "1"}, CPU_INDEX if platform.system() == "Linux" else None),  # PyPI's Linux torch is the CUDA build
    ({"RESOLVES": "1", "PAGEDEXPERTS_TORCH_INDEX": ""}, None),
    ({"PAGEDEXPERTS_TORCH_INDEX": "https://mirror.example/whl"}, "https://mirror.example/whl"),
])
def test_torch_comes_from_the_cpu_index_where_it_resolves(repo, env, index):
    rc, out, pip = _bootstrap(repo, **env)
    torch_install = "-m pip install -q torch==2.13.0" + (f" --index-url {index}" if index else "")
    assert rc == 0 and pip == [INSTALL[0], torch_install, *INSTALL[2:]], out


def test_unknown_argument_exits_2_before_installing(repo):
    rc, out, pip = _bootstrap(repo, "--frce")
    assert (rc, pip) == (2, [])
    assert out == "bootstrap.sh: unknown argument '--frce' (only --force: reinstall even when up to date)\n"


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    """A ``license = {text = ...}`` table makes setuptools >= 77 print a deprecation box on every
    install (three per bootstrap): PEP 639's SPDX string instead, with the setuptools that reads it."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
