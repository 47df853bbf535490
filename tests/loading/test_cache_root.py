"""Every cache of the project under one directory: $PAGEDEXPERTS_CACHE, else
$XDG_CACHE_HOME/pagedexperts, else ~/.cache/pagedexperts (``loading.cache_root``): the bundled
model's variants and the stored kernel layouts of checkpoints alike, and --help says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedexperts.cli import main
from pagedexperts.loading import stored_layout
from pagedexperts.loading.cache_root import cache_root
from pagedexperts.loading.stored_layout import default_cache_dir  # bound before conftest's patch to a tmp dir
from support.paths import DATA
from support.tiny import host_budget_gb

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"


@pytest.mark.parametrize("env, want", [
    ({"PAGEDEXPERTS_CACHE": "/p", "XDG_CACHE_HOME": "/x"}, "/p"),
    ({"PAGEDEXPERTS_CACHE": "", "XDG_CACHE_HOME": "/x"}, "/x/pagedexperts"),
    ({}, "HOME/.cache/pagedexperts"),
])
def test_the_stored_layout_cache_follows_the_cache_variables(env, want, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("PAGEDEXPERTS_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root = Path(want.replace("HOME", str(tmp_path)))
    assert cache_root() == root
    assert default_cache_dir() == root / "kernel-layouts"


def test_a_first_load_writes_its_stored_layout_under_pagedexperts_cache(monkeypatch, tmp_path):
    from pagedexperts.loading.loader import load_model

    monkeypatch.setattr(stored_layout, "default_cache_dir", default_cache_dir)  # the real one, not conftest's
    monkeypatch.setenv("PAGEDEXPERTS_CACHE", str(tmp_path / "cache"))
    opts = dict(num_resident=2, experts_implementation="packed")
    model, _ = load_model(INT4, host_memory_gb=host_budget_gb(INT4, 2, **opts), **opts)
    path = Path(model.pagedexperts.stored_layout)
    assert path.is_file() and path.parent.parent == tmp_path / "cache" / "kernel-layouts"


def test_help_names_the_cache_variables(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--stored-layout-dir DIR" in text and "kernel-layouts/ in $PAGEDEXPERTS_CACHE, else $XDG_CACHE_HOME" in text
