"""Trace-driven routing: the top-k ids a synthetic model's experts receive come from a trace.

Expected ids are read straight from the trace's request streams (``simulate.request_streams``)
by the mapping of the module docstring, worked out by hand per case.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from pagedexperts.analysis import simulate as sim
from pagedexperts.analysis.trace import load_trace
from pagedexperts.analysis.trace_routing import TraceRouting, install
from support.paths import DATA

SYNTHETIC = DATA / "synthetic_trace.npz"  # E=16, top_k=2, layers (1, 3), 6 streams


@pytest.fixture(scope="module")
def trace():
    return load_trace(SYNTHETIC)


@pytest.fixture(scope="module")
def streams(trace):
    return sim.request_streams(trace, min_streams=4)  # what one group asks for: the 6 as recorded


def test_two_groups_take_two_streams_each_shifted(trace):
    driver = TraceRouting(trace, num_experts=32, top_k=4)  # c = 2 groups of 16, 2 ids each
    streams = sim.request_streams(trace, min_streams=8)  # 4 per group: the 6 cut in halves
    first = driver.topk_ids(0, 1)
    want = np.concatenate([streams[0][1][0, :2], streams[1][1][0, :2] + 16])
    assert first.tolist() == [want.tolist()]
    second = driver.topk_ids(0, 1)  # decode: the next token of the same streams
    assert second.tolist() == [np.concatenate([streams[0][1][1, :2], streams[1][1][1, :2] + 16]).tolist()]
    # layer number 1 reads trace layer 3, streams shifted by c = 2
    other = driver.topk_ids(1, 1)
    assert other.tolist() == [np.concatenate([streams[2][3][0, :2], streams[3][3][0, :2] + 16]).tolist()]


def test_batch_rows_are_sequences_of_consecutive_tokens(trace, streams):
    driver = TraceRouting(trace, num_experts=16, top_k=2)
    driver.batch_size = 2
    ids = driver.topk_ids(0, 6)  # 2 sequences x 3 positions
    assert ids.tolist() == streams[0][1][:3].tolist() + streams[1][1][:3].tolist()
    driver.batch_size = 1
    assert driver.topk_ids(0, 1).tolist() == [streams[0][1][3].tolist()]
    driver.rewind()
    assert driver.topk_ids(0, 1).tolist() == [streams[0][1][0].tolist()]


def test_streams_wrap_around_and_ids_stay_distinct_and_in_range(trace):
    driver = TraceRouting(trace, num_experts=32, top_k=4)
    driver.batch_size = 8
    for _ in range(40):  # past the 30 tokens of each stream
        ids = driver.topk_ids(0, 8)
        assert ids.min() >= 0 and ids.max() < 32
        assert all(len(set(row)) == 4 for row in ids.tolist())


@pytest.mark.parametrize("experts,top_k,match", [(8, 2, "E=16 experts but the model only 8"),
                                                  (32, 3, "top_k=3 cannot be taken as 2 groups"),
                                                  (16, 4, "top_k=4 cannot be taken as 1 groups")])
def test_trace_that_does_not_fit_is_refused(trace, experts, top_k, match):
    with pytest.raises(ValueError, match=match):
        TraceRouting(trace, num_experts=experts, top_k=top_k)


def test_installed_on_a_model_its_experts_receive_the_trace_ids(tiny_moe_dir, trace, streams):
    from pagedexperts.loading.loader import load_model

    model, _ = load_model(tiny_moe_dir, num_resident=4)  # E=16, top_k=2: one group
    seen = {}
    for layer, pager in model.pagedexperts.runners.items():
        pager.trace_hook = lambda ly, ids, w: seen.setdefault(ly, []).append(ids.clone())
    install(model, trace)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    first = sorted(seen)[0]
    want = streams[0][1][:3].tolist() + streams[1][1][:3].tolist()
    assert seen[first][0].tolist() == want
    second = sorted(seen)[1]  # layer number 1: trace layer 3, streams 1 and 2
    assert seen[second][0].tolist() == streams[1][3][:3].tolist() + streams[2][3][:3].tolist()
