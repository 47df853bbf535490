"""Decode over static buffers (``generation.graphs``, ``generation.static_decode``) on CPU.

The CUDA backend captures the same static-buffer step function the eager backend calls here
(tests/generation/test_cuda_graphs.py checks capture == eager on a GPU). Oracles: the unpaged
transformers model decoded through the same static-buffer runner (logits torch.equal, every
step, routing changing), transformers' own greedy ``generate`` (tokens), the runners a repage
attaches (invalidation counted), the option checks' messages (each names its flag).

Legend: B batch, K slots, k top_k, E experts.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from support.tiny import PAD_ID
from pagedexperts.formats.slots import DequantizingSlots
from pagedexperts import load_model
from pagedexperts.cli import main
from pagedexperts.generation.config import SamplingConfig
from pagedexperts.generation.generate import generate_text
from pagedexperts.generation.capture_checks import capture_problem_of, runner_problem
from pagedexperts.generation.graphs import DecodeGraphs
from pagedexperts.paging.kernels import HAVE_TRITON
from pagedexperts.generation.static_decode import DecodeOptions, static_generate
from pagedexperts.loading import runners
from pagedexperts.loading.config import ConfigError, PagingConfig, check_config, graph_problems, resolve_cuda_graphs

STEPS = 20


def prompt(rows: int, seed: int = 0):
    ids = torch.randint(2, 100, (rows, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :3], mask[1, :3] = PAD_ID, 0  # left padding
    return ids, mask


def decode_logits(model, graphs, ids, mask, tokens) -> list[torch.Tensor]:
    """Prefill, then one decode step per column of ``tokens`` [B, n] (fed, not chosen):
    the logits [B, V] of the prefill and of every step."""
    st = graphs.step_for(ids.shape[0], ids.shape[1] + tokens.shape[1] + 1)
    with torch.no_grad():
        out = [st.prefill(ids, mask)]
        for i in range(tokens.shape[1]):
            out.append(graphs.decode(st, tokens[:, i], ids.shape[1] + i))
    return out


@pytest.fixture(scope="module")
def reference(tiny_moe_model):
    return tiny_moe_model


def paged(path, **kw):
    opts = dict(num_resident=4, decide="device", device_kernels="torch", policy="lru", cuda_graphs="eager")
    opts.update(kw)
    return load_model(path, check_independence=False, **opts)[0]


def _fed_tokens(reference, ids, mask):
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, pad_token_id=PAD_ID)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("rows", [1, 3], ids=["batch1", "batch3-multiwave"])
@pytest.mark.parametrize("decide", ["device", "host"])
@pytest.mark.default_threads
def test_static_decode_logits_equal_the_unpaged_model_run_the_same_way(tiny_moe_dir, reference, rows, decide):
    model = paged(tiny_moe_dir, decide=decide)
    ids, mask = prompt(rows)
    tokens = _fed_tokens(reference, ids, mask)
    got = decode_logits(model, DecodeGraphs(model, backend="eager", max_batch=4), ids, mask, tokens)
    want = decode_logits(reference, DecodeGraphs(reference, backend="eager", max_batch=4), ids, mask, tokens)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}"
    stats = model.pagedexperts.stats().as_dict()
    fills = len(stats["layers"]) * model.pagedexperts.num_resident
    assert stats["misses"] > 2 * fills, "routing must change over the steps (evictions, not only the first fill)"
    if rows == 3:
        assert stats["multi_wave_steps"] > 0


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.default_threads
def test_static_generate_tokens_equal_transformers_greedy_generate(tiny_moe_dir, reference, rows):
    model = paged(tiny_moe_dir)
    ids, mask = prompt(rows, seed=1)
    graphs = DecodeGraphs(model, backend="eager", max_batch=1)  # batch 2 runs the step eagerly
    got = static_generate(model, graphs, ids, mask, DecodeOptions(max_new_tokens=STEPS, ignore_eos=True))
    want = torch.cat([ids, _fed_tokens(reference, ids, mask)], dim=1)
    assert torch.equal(got, want)
    s = graphs.summary()
    if rows == 1:
        assert (s["captures"], s["replays"], s["eager_steps"]) == (1, STEPS - 2, 0)
    else:
        assert (s["captures"], s["eager_steps"]) == (0, STEPS - 1)


def test_repage_invalidates_the_captured_step(tiny_moe_dir, reference):
    model = paged(tiny_moe_dir)
    ids, mask = prompt(1)
    tokens = _fed_tokens(reference, ids, mask)[:, :6]
    graphs = DecodeGraphs(model, backend="eager", max_batch=2)
    decode_logits(model, graphs, ids, mask, tokens)
    assert (graphs.counters.captures, graphs.counters.invalidations) == (1, 0)
    decode_logits(model, graphs, ids, mask, tokens)  # same runners: the capture is kept
    assert (graphs.counters.captures, graphs.counters.invalidations) == (1, 0)
    runners.repage(model, mode="paged", num_resident=8)
    got = decode_logits(model, graphs, ids, mask, tokens)
    assert (graphs.counters.captures, graphs.counters.invalidations) == (2, 1)
    want = decode_logits(reference, DecodeGraphs(reference, backend="eager", max_batch=2), ids, mask, tokens)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    graphs.invalidate()
    assert graphs.counters.invalidations == 2 and graphs.summary()["batch_sizes"] == []


def test_generate_text_decodes_through_the_graphs_and_reports_them(tiny_moe_dir):
    import pagedexperts

    path = pagedexperts.bundled_model_path()
    sampling = SamplingConfig(max_new_tokens=8)
    on, tok = load_model(path, num_resident=8, cuda_graphs="eager", check_independence=False)
    off, _ = load_model(path, num_resident=8, cuda_graphs="off", check_independence=False)
    a = generate_text(on, tok, "The capital of France is", sampling)
    b = generate_text(off, tok, "The capital of France is", sampling)
    assert a.text == b.text and a.new_tokens == b.new_tokens == 8
    assert a.cuda_graphs["enabled"] and a.cuda_graphs["replays"] == 6 and a.cuda_graphs["captures"] == 1
    assert b.cuda_graphs == dict(enabled=False, reason="--no-cuda-graphs")
    assert a.decode["tokens"] == b.decode["tokens"]


def test_a_step_that_cannot_be_captured_falls_back_with_a_warning_or_raises(tiny_moe_dir, caplog):
    model = paged(tiny_moe_dir, decide="host")
    problem = capture_problem_of(model)
    assert "HostExecutor reads the step back" in problem and "--decide device" in problem
    ids, mask = prompt(1)
    graphs = DecodeGraphs(model, backend="eager", max_batch=2)
    st = graphs.step_for(1, 16)
    st.prefill(ids, mask)
    with caplog.at_level(logging.WARNING):
        graphs._fall_back(st, problem, graphs._runners_key())
    assert "without a CUDA graph" in caplog.text
    graphs.decode(st, ids[:, -1], ids.shape[1] + 1)
    s = graphs.summary()
    assert s["fallbacks"] == [problem] and s["eager_steps"] == 2 and s["captures"] == 0
    runners.repage(model, mode="paged", num_resident=8)  # new runners: the step is judged again
    graphs.decode(st, ids[:, -1], ids.shape[1] + 2)
    s = graphs.summary()
    assert s["fallbacks"] == [] and s["captures"] == 1 and s["invalidations"] == 0
    strict = DecodeGraphs(model, backend="eager", max_batch=2, strict=True)
    with pytest.raises(ValueError, match="--no-cuda-graphs"):
        strict._fall_back(strict.step_for(1, 16), problem, ())


def test_runner_problem_names_the_syncing_kernels(tiny_moe_dir):
    model = paged(tiny_moe_dir, experts_implementation="grouped_mm")
    runner = next(iter(model.pagedexperts.runners.values()))
    assert "--dtype bfloat16" in runner_problem(runner, torch.float32)
    assert runner_problem(runner, torch.bfloat16) is None
    runner.inner = "batched_mm"
    assert runner_problem(runner, torch.float32) is None
    table = DequantizingSlots(None, dict(runner.slots), {})  # packed slots of a quantized format
    runner.setup = dataclasses.replace(runner.setup, slots=table)
    runner.inner = "batched_mm"  # its body, rebuilt over the setup, reads a table that dequantizes each wave
    assert "quantized format" in runner_problem(runner, torch.float32)


def test_graph_options_are_checked_with_their_flags(caplog):
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA device"):
        check_config(PagingConfig(device="cpu", cuda_graphs="on"))
    with pytest.raises(ConfigError, match="--cuda-graph-max-batch 0 must be"):
        check_config(PagingConfig(cuda_graph_max_batch=0))
    with pytest.raises(ConfigError, match="unknown cuda_graphs 'yes'"):
        check_config(PagingConfig(cuda_graphs="yes"))
    cuda = PagingConfig(device="cuda", decide="host")
    assert any("--decide device" in p for p in graph_problems(cuda, "host"))
    assert graph_problems(cuda, "device") == []
    assert any("mode 'offload'" in p for p in graph_problems(PagingConfig(device="cuda", mode="offload"), "host"))
    with caplog.at_level(logging.WARNING):
        assert resolve_cuda_graphs(PagingConfig(device="cpu"), "host")[0] == "off"
        assert caplog.text == ""  # CPU: graphs never apply, no warning
        backend, reason = resolve_cuda_graphs(cuda, "host")
    assert backend == "off" and "--decide device" in reason and "decode runs without CUDA graphs" in caplog.text
    assert resolve_cuda_graphs(cuda, "device") == ("cuda", None)
    assert resolve_cuda_graphs(PagingConfig(cuda_graphs="off"), "device") == ("off", "--no-cuda-graphs")


def test_cli_refuses_cuda_graphs_on_cpu(capsys):
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2", "--cuda-graphs"]) != 0
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err


def test_a_failed_capture_falls_back_under_auto_and_raises_when_strict(tiny_moe_dir, reference, monkeypatch, caplog):
    from pagedexperts.generation import graphs as graphs_module

    def failing_build(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module.EagerBackend, "build", failing_build)
    model = paged(tiny_moe_dir)
    ids, mask = prompt(1)
    graphs = DecodeGraphs(model, backend="eager", max_batch=2)
    with caplog.at_level(logging.WARNING):
        got = static_generate(model, graphs, ids, mask, DecodeOptions(max_new_tokens=6, ignore_eos=True))
    assert "capture of batch 1 failed" in caplog.text
    s = graphs.summary()
    assert s["captures"] == 0 and s["eager_steps"] == 4 and s["fallbacks"][0].startswith("capture failed")
    model.pagedexperts.reset_stats()
    strict = DecodeGraphs(model, backend="eager", max_batch=2, strict=True)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        static_generate(model, strict, ids, mask, DecodeOptions(max_new_tokens=6, ignore_eos=True))
    assert torch.equal(got[:, ids.shape[1]:], _fed_tokens(reference, ids, mask)[:, :6])  # decoded eagerly, right


def test_stats_json_says_why_graphs_are_off(tmp_path):
    import json

    out = tmp_path / "stats.json"
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "3", "--quiet", "--stats-json", str(out)]) == 0
    field = json.loads(out.read_text())["cuda_graphs"]
    assert field["enabled"] is False and "needs a CUDA device" in field["reason"]
    assert "drop --cuda-graphs" not in field["reason"], field["reason"]  # auto: no flag was given to drop
    out2 = tmp_path / "off.json"
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "3", "--quiet", "--no-cuda-graphs",
                 "--stats-json", str(out2)]) == 0
    assert json.loads(out2.read_text())["cuda_graphs"] == dict(enabled=False, reason="--no-cuda-graphs")


@pytest.mark.default_threads
@pytest.mark.skipif(not HAVE_TRITON, reason="the gpu extra (triton): the kernels run under TRITON_INTERPRET=1")
def test_static_decode_with_the_triton_kernels_equals_unpaged(tiny_moe_dir, reference):
    """The Triton decide / page-in / remap kernels (TRITON_INTERPRET=1 on CPU) through the
    static-buffer step: the kernels a CUDA capture holds."""
    model = paged(tiny_moe_dir, device_kernels="triton")
    ids, mask = prompt(2)
    tokens = _fed_tokens(reference, ids, mask)[:, :8]
    got = decode_logits(model, DecodeGraphs(model, backend="eager", max_batch=4), ids, mask, tokens)
    want = decode_logits(reference, DecodeGraphs(reference, backend="eager", max_batch=4), ids, mask, tokens)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert model.pagedexperts.stats().as_dict()["misses"] > 2 * 2 * 4
