"""trace: the npz format round trip, the JSON-lines loader, and clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pagedexperts.analysis.trace import DUMMY_MIN_ROWS, TraceWriter, load_trace
from support.trace_fixtures import TRACES, needs_real_traces
from support import paths

ROOT = str(paths.ROOT)
SYNTHETIC = os.path.join(ROOT, "tests", "data", "synthetic_trace.npz")


def _write(path, *, num_experts=8, top_k=2):
    w = TraceWriter(num_experts=num_experts, top_k=top_k, layers=[1, 3], model_id="test/tiny")
    w.begin_step(phase="prefill", request_ids=[7, 7, 9])
    w.add(layer=1, topk_ids=np.array([[0, 1], [2, 3], [4, 5]]), topk_weights=np.full((3, 2), 0.5))
    w.add(layer=3, topk_ids=torch.tensor([[7, 6], [5, 4], [3, 2]]), topk_weights=torch.full((3, 2), 0.25))
    w.add_extra(layer=1, name="predicted_next", values=[2, 5, 6])
    w.begin_step(phase="decode", request_ids=[7, 9])
    w.add(layer=1, topk_ids=np.array([[1, 0], [6, 7]]), topk_weights=np.array([[0.75, 0.25], [0.6, 0.4]]))
    w.add(layer=3, topk_ids=np.array([[2, 3], [4, 1]]), topk_weights=np.full((2, 2), 0.5))
    w.add_extra(layer=3, name="compute_s", values=0.0125)
    w.save(path)


def test_round_trip(tmp_path):
    path = tmp_path / "t.npz"
    _write(path)
    tr = load_trace(path)
    assert (tr.meta.num_experts, tr.meta.top_k, tr.meta.layers, tr.meta.model_id) == (8, 2, (1, 3), "test/tiny")
    assert set(tr.meta.extras) == {"compute_s", "predicted_next"}
    assert [s.phase for s in tr] == ["prefill", "decode"] and tr.num_tokens == 5
    s0, s1 = tr.steps
    assert s0.request_ids.tolist() == [7, 7, 9]
    assert s0.topk_ids[3].tolist() == [[7, 6], [5, 4], [3, 2]]
    np.testing.assert_allclose(s1.topk_weights[1], [[0.75, 0.25], [0.6, 0.4]], atol=1e-3)
    assert s0.extras[(1, "predicted_next")].tolist() == [2, 5, 6]
    assert s1.extras[(3, "compute_s")].tolist() == [0.0125]
    streams = tr.streams()
    assert sorted(streams) == [7, 9] and streams[9][1].tolist() == [[6, 7]]


def test_writer_errors():
    w = TraceWriter(num_experts=8, top_k=2, layers=[0])
    with pytest.raises(ValueError, match="before begin_step"):
        w.add(layer=0, topk_ids=np.zeros((1, 2)), topk_weights=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="phase"):
        w.begin_step(phase="warmup", request_ids=[0])
    w.begin_step(phase="decode", request_ids=[0, 1])
    with pytest.raises(ValueError, match="expected \\[T, k\\]=\\(2, 2\\)"):
        w.add(layer=0, topk_ids=np.zeros((1, 2), int), topk_weights=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="outside \\[0, E=8\\)"):
        w.add(layer=0, topk_ids=np.array([[0, 8], [1, 2]]), topk_weights=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="not one of the trace's MoE layers"):
        w.add(layer=5, topk_ids=np.zeros((2, 2), int), topk_weights=np.zeros((2, 2)))
    w.add(layer=0, topk_ids=np.zeros((2, 2), int), topk_weights=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="added twice"):
        w.add(layer=0, topk_ids=np.zeros((2, 2), int), topk_weights=np.zeros((2, 2)))


def test_empty_truncated_and_mismatched_files(tmp_path):
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty trace file"):
        load_trace(empty)
    full = tmp_path / "full.npz"
    _write(full)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(full.read_bytes()[: len(full.read_bytes()) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_trace(cut)
    with pytest.raises(ValueError, match="E=8, top_k=2; the model has E=64, top_k=8"):
        load_trace(full, num_experts=64, top_k=8)
    jl = tmp_path / "cut.jsonl"
    jl.write_text('{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "lay')
    with pytest.raises(ValueError, match="cut.jsonl:2: truncated"):
        load_trace(jl)
    meta_only = tmp_path / "meta.jsonl"
    meta_only.write_text('{"type": "meta", "top_k": 2}\n')
    with pytest.raises(ValueError, match="no route rows"):
        load_trace(meta_only)


def _row(token_idx, ids, weights=(0.5, 0.5)):
    return {"type": "route", "req_id": "r0", "token_idx": token_idx, "layer": 0,
            "topk_ids": list(ids), "topk_weights": list(weights)}


def test_jsonl_warmup_dropped_and_steps_recovered(tmp_path):
    """A dummy step, a 3-row prefill, two decode steps of 2 requests, one shrunk to 1."""
    rows = [_row(i, (0, 1)) for i in range(DUMMY_MIN_ROWS)]
    rows += [_row(i, ids) for i, ids in enumerate([(2, 3), (4, 5), (6, 7)])]
    rows += [_row(0, (1, 2)), _row(1, (3, 4))]
    rows += [_row(0, (5, 6)), _row(1, (0, 7))]
    rows += [_row(0, (2, 5))]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "meta", "model_id": "m", "top_k": 2,
                                                      "num_experts": 8}] + rows))
    tr = load_trace(path)
    assert [(s.phase, s.num_tokens) for s in tr] == [("prefill", 3), ("decode", 2), ("decode", 2), ("decode", 1)]
    assert [s.request_ids.tolist() for s in tr] == [[-2, -2, -2], [0, 1], [0, 1], [-2]]
    assert {r: v[0].tolist() for r, v in tr.streams().items()} == {0: [[1, 2], [5, 6]], 1: [[3, 4], [0, 7]]}


def test_committed_synthetic_trace():
    tr = load_trace(SYNTHETIC)
    assert (tr.meta.num_experts, tr.meta.top_k, tr.meta.layers) == (16, 2, (1, 3))
    assert len(tr) == 31 and len(tr.streams()) == 6


@needs_real_traces
def test_real_qwen15_trace_structure():
    tr = load_trace(os.path.join(TRACES, "qwen15moe_a27b_layer0_gsm8k.jsonl"))
    assert (tr.meta.num_experts, tr.meta.top_k) == (60, 4)
    assert len(tr) == 104 and tr.num_tokens == 2434  # the traces' own README: after the warm-up
    assert [s.num_tokens for s in tr if s.phase == "prefill"] == [65, 91]
    streams = tr.streams()
    assert len(streams) == 50 and {len(v[0]) for v in streams.values()} == {33}


@needs_real_traces
def test_real_olmoe_trace_structure():
    tr = load_trace(os.path.join(TRACES, "olmoe_1b7b_layer0_gsm8k.jsonl"))
    assert (tr.meta.num_experts, tr.meta.top_k) == (64, 8)
    assert tr.num_tokens == 4471 and len(tr) == 4471
    assert not np.all(tr.steps[0].topk_weights[0] == 0.125)


def test_padding_rows_are_not_tokens(tmp_path):
    w = TraceWriter(num_experts=4, top_k=1, layers=[0])
    w.begin_step(phase="prefill", request_ids=[-1, 3, 3])
    w.add(layer=0, topk_ids=np.array([[0], [1], [2]]), topk_weights=np.ones((3, 1)))
    w.save(tmp_path / "p.npz")
    (step,) = load_trace(tmp_path / "p.npz").steps
    assert (step.num_tokens, step.num_padding) == (2, 1)
