"""``--threads auto``, the default of every model command: the cores the machine's other work
leaves idle, so that a shared machine does not lose several-fold to threads waiting for a busy
core (issue 36 part 3.1; the measurement is ``bench/threads_bench.py``, docs/threads.md)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedexperts.cli import main
from pagedexperts.commands.common import auto_threads, resolve_threads


@pytest.mark.parametrize("default_threads,cpu_count,load,want", [
    (2, 2, 11.2, 1),   # the shared 2-core machine the issue measured: 1, not 2
    (2, 2, 1.0, 1),    # one core busy elsewhere
    (2, 2, 0.4, 2),    # idle: every core, as torch's default
    (16, 16, 5.4, 11),  # round(16 - 5.4)
    (8, 64, 10.0, 8),  # a process allowed 8 CPUs of an idle-ish 64: never above torch's default
    (4, 4, 0.0, 4),
])
def test_auto_threads_by_hand(default_threads, cpu_count, load, want):
    assert auto_threads(default_threads=default_threads, cpu_count=cpu_count, load_average=load) == want


@pytest.mark.parametrize("value,want", [(3, (3, "--threads")), ("auto", None)])
def test_resolve_threads_explicit_wins_and_auto_reads_the_load(value, want, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1e6, 0.0, 0.0))  # a machine far busier than its cores
    n, how = resolve_threads(value)
    if want:
        assert (n, how) == want
    else:
        assert n == 1 and how.startswith(f"auto: {os.cpu_count()} CPUs at load average 1000000.0")


@pytest.mark.parametrize("load,expect_default", [(1e6, False), (0.0, True)])
def test_generate_without_threads_runs_at_the_idle_cores(load, expect_default, monkeypatch):
    """No --threads: a busy machine gets 1 thread, an idle one torch's default (the load is
    stopped before the model builds; conftest starts each test at 1 thread, so 1 is set too)."""
    import pagedexperts.loading.loader
    from support.tiny import DEFAULT_THREADS

    seen = []

    def stop(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ValueError("stopped at the load")

    torch.set_num_threads(DEFAULT_THREADS)  # as a fresh process starts
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(pagedexperts.loading.loader, "build_paged_model", stop)
    assert main(["generate", "--prompt", "x"]) == 2
    assert DEFAULT_THREADS > 1, "needs a machine of 2 CPUs or more to tell the two apart"
    assert seen == [DEFAULT_THREADS if expect_default else 1]


def test_threads_flag_refuses_words_other_than_auto(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--threads", "many"])
    assert "'many': want auto or an integer >= 0" in capsys.readouterr().err
