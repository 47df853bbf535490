"""A directory given as ``--trace`` is one set of traces of one model, and the bundled model's
own routing traces ship with the package, so ``simulate --trace bundled`` runs from a fresh
clone (issue 36 part 3.3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedexperts.analysis.trace import TraceWriter, load_trace
from pagedexperts.cli import main
from pagedexperts.loading.bundled import bundled_traces_path
from support.paths import ROOT


def _write(path, *, num_experts=8, top_k=2, first_expert=0, decode_steps=3):
    """A trace of two requests: one prefill step (3 rows: request 0, request 1, a padding row),
    then ``decode_steps`` decode steps of both; expert ids start at ``first_expert``."""
    w = TraceWriter(num_experts=num_experts, top_k=top_k, layers=[0, 2], model_id="m")
    w.begin_step(phase="prefill", request_ids=[0, 1, -1])
    for layer in (0, 2):
        w.add(layer=layer, topk_ids=np.full((3, top_k), first_expert) + np.arange(top_k), topk_weights=np.ones((3, top_k)))
    for t in range(decode_steps):
        w.begin_step(phase="decode", request_ids=[0, 1])
        ids = (first_expert + np.array([[t, t + 1], [t + 2, t + 3]])[:, :top_k]) % num_experts
        for layer in (0, 2):
            w.add(layer=layer, topk_ids=ids, topk_weights=np.ones((2, top_k)))
    w.save(path)


def test_a_directory_is_one_set_each_file_s_requests_their_own_streams(tmp_path):
    _write(tmp_path / "a.npz", first_expert=0)
    _write(tmp_path / "b.npz", first_expert=4, decode_steps=2)
    (tmp_path / "README.md").write_text("how these were recorded")  # not a trace: ignored
    a, b, both = load_trace(tmp_path / "a.npz"), load_trace(tmp_path / "b.npz"), load_trace(tmp_path)
    assert len(both) == len(a) + len(b) == 4 + 3 and both.num_tokens == a.num_tokens + b.num_tokens == 8 + 6
    assert [s.request_ids.tolist() for s in both][:1] + [s.request_ids.tolist() for s in both][4:5] == [[0, 1, -1],
                                                                                                     [2, 3, -1]]
    streams = both.streams()
    assert sorted(streams) == [0, 1, 2, 3]  # b's requests 0 and 1 are the set's 2 and 3
    for layer in (0, 2):
        assert np.array_equal(streams[2][layer], b.streams()[0][layer])
        assert np.array_equal(streams[1][layer], a.streams()[1][layer])
    assert both.meta.num_experts == 8 and "2 traces" in both.meta.notes[0] and "a.npz, b.npz" in both.meta.notes[0]


def test_simulate_replays_the_set_as_the_files_one_after_another(tmp_path, capsys):
    """LRU, K=4, by hand per layer. a: prefill {0,1} 2 misses, decode {0..3} 2, {1..4} 1, {2..5} 1
    = 6. b alone: prefill {4,5} 2, {4..7} 2, {5,6,7,0} 1 = 5. b after a (slots {2,3,4,5}):
    prefill hits, then 2 + 1 = 3. Two layers: a 12, b 10, the set 12 + 6 = 18 (residency carries
    over from one file to the next, as one long run)."""
    _write(tmp_path / "a.npz", first_expert=0)
    _write(tmp_path / "b.npz", first_expert=4, decode_steps=2)
    argv = ["simulate", "--num-resident", "4", "--policy", "lru", "--no-uniform", "--json", "--trace"]
    misses, tokens = {}, {}
    for name in ("a.npz", "b.npz", ""):
        assert main(argv + [str(tmp_path / name)]) == 0
        row = json.loads(capsys.readouterr().out)["results"][0]
        misses[name], tokens[name] = round(row["misses_per_token"] * row["tokens"]), row["tokens"]
    assert misses == {"a.npz": 12, "b.npz": 10, "": 18} and tokens == {"a.npz": 8, "b.npz": 6, "": 14}


def test_a_directory_of_two_models_is_refused_naming_both(tmp_path, capsys):
    _write(tmp_path / "a.npz")
    _write(tmp_path / "b.npz", num_experts=16)
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "a.npz (E=8, top_k=2" in err and "b.npz (E=16, top_k=2" in err and "different models" in err


def test_an_empty_directory_is_refused_saying_what_it_reads(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no traces here")
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    assert f"{tmp_path}: a directory with no trace files (*.npz, *.jsonl)" in capsys.readouterr().err


def test_simulate_trace_bundled_runs_from_the_package_and_shows_reuse(capsys):
    """The bundled model's own routing (generate --record-trace on four prompts): LFU at K=16 of
    64 hits more than uniform routing can (1 - 48/64 = 25% at best in steady state)."""
    files = sorted(p.name for p in bundled_traces_path().glob("*.npz"))
    assert len(files) >= 2, files
    assert main(["simulate", "--trace", "bundled", "--num-resident", "16", "--policy", "lfu", "--json",
                 "--batch-sizes", "1,2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["meta"]["num_experts"], out["meta"]["top_k"], out["meta"]["layers"]) == (64, 4, [0, 1, 2, 3, 4, 5])
    rows = {(r["routing"], r["batch_size"]): r for r in out["results"]}
    assert rows[("trace", 1)]["tokens"] > 300
    assert rows[("trace", 1)]["hit_rate"] > 0.5 > 0.3 > rows[("uniform", 1)]["hit_rate"]


@pytest.mark.parametrize("name", ["bundled", "pagedexperts/data/traces/tiny-qwen3-moe"])
def test_the_bundled_set_loads_by_name_and_by_path(name, capsys, monkeypatch):

    monkeypatch.chdir(ROOT)
    assert main(["simulate", "--trace", name, "--num-resident", "8", "--policy", "lru", "--no-uniform"]) == 0
    assert capsys.readouterr().out.startswith(f"{len(list(bundled_traces_path().glob('*.npz')))} traces in ")
