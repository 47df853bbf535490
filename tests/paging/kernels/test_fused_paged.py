"""``--experts-implementation fused`` on the device-planned path: paged == all E resident, bit for bit.

The oracle is the same fused kernel with every expert resident (K = E: one wave, every expert
in a slot); paged runs at K = top_k, 2 top_k and E/2, at batch 1 and at a batch whose step
routes to more experts than K holds (several waves), prefill and decode (greedy, logits of
every step compared with torch.equal), on the bundled model, ``bundled:w4a16`` and
``bundled:fp8-block``. The Triton kernels run under ``TRITON_INTERPRET=1`` (conftest); the
decide / page-in / remap kernels as their torch references (``device_kernels="torch"``, tested
against the Triton ones elsewhere) to keep the interpreter's time to the fused kernels.

Legend: E experts, k top_k, K slots.
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.loading.config import ConfigError, PagingConfig, check_config
from pagedexperts.loading.loader import bundled_model_path, load_model
from pagedexperts.paging.kernels._triton import HAVE_TRITON
from support import bundled

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")

FORMATS = ("dense", "w4a16", "fp8-block")
PROMPT = 2  # tokens per prompt row
BATCHES = (1, 2)  # batch 2: a 16-entry prefill routes to more experts than K = 4 or 8 hold
LAYERS = 2  # the bundled model's first layers (its shapes, E and top_k): the interpreter is slow


@pytest.fixture(scope="session")
def bundled_source(tmp_path_factory):
    """The bundled model cut to its first LAYERS decoder layers (every shape kept), with its tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    src = bundled_model_path()
    config = AutoConfig.from_pretrained(src, num_hidden_layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32)  # later layers dropped
    path = tmp_path_factory.mktemp("bundled-2-layers")
    model.save_pretrained(path)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


def variant(name: str, source, tmp_path_factory):
    """``source`` ("dense") or its ``bundled:name``-style variant, built once per session."""
    if name == "dense":
        return source
    from pagedexperts.tools.quantize import bundled_variant_path

    return bundled_variant_path(name, cache_dir=tmp_path_factory.getbasetemp() / "bundled-variants", source=source)


def fused_model(path, k: int, **kw):
    model, _ = load_model(path, num_resident=k, experts_implementation="fused", device_kernels="torch",
                          **{"check_independence": False, **kw})
    return model


def greedy(model, ids, mask):
    """Prefill and one decode step: (sequences, [prefill logits, decode logits])."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, out.logits


def prompts(batch: int):
    """[B, PROMPT] token ids (the second row left-padded when B > 1) and the mask."""
    ids = torch.randint(1, 4000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, 0], mask[1, 0] = 0, 0
    return ids, mask


@pytest.fixture(scope="module", params=FORMATS)
def fused(request, bundled_source, tmp_path_factory):
    """(format, one fused model of it, the oracle's runs at each of BATCHES: the same kernel, K = E)."""
    # the independence check compares the fused kernels' own reads of sampled slots with the checkpoint
    model = fused_model(variant(request.param, bundled_source, tmp_path_factory), bundled.E, check_independence=True)
    with torch.no_grad():
        return request.param, model, {b: greedy(model, *prompts(b)) for b in BATCHES}


@pytest.mark.slow
@pytest.mark.default_threads
@pytest.mark.parametrize("k", [bundled.TOP_K, 2 * bundled.TOP_K, bundled.E // 2])
def test_paged_fused_equals_all_resident(fused, k):
    """Batch 1 and 2, prefill and decode, logits torch.equal at every step. The batch-2 prefill
    (16 entries) routes to more experts than K = 4 or 8 hold: several waves per step. (K = E/2
    with a batch beyond K is the kernels' own test, tests/paging/kernels/test_fused_moe.py, at tiny shapes.)"""
    from pagedexperts.loading import runners

    name, model, oracle = fused
    runners.repage(model, mode="paged", num_resident=k)
    with torch.no_grad():
        for batch in BATCHES:
            seq, logits = greedy(model, *prompts(batch))
            ref_seq, ref_logits = oracle[batch]
            diffs = [(a - b).abs().max().item() for a, b in zip(logits, ref_logits)]
            assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), (name, k, batch, diffs)
            assert torch.equal(seq, ref_seq)
    stats = model.pagedexperts.stats().total()
    assert stats.misses > 0 and (k == bundled.E // 2 or stats.multi_wave_steps > 0), (k, stats)
    runner = next(iter(model.pagedexperts.runners.values()))
    assert type(runner.slots) is PackedSlots and "scratch" not in model.pagedexperts.buffers  # read packed
    if name != "dense":
        assert any(t.dtype in (torch.int32, torch.float8_e4m3fn, torch.uint8) for t in runner.slots.values())


def test_fused_on_cpu_without_the_interpreter_names_the_flag(monkeypatch):
    import pagedexperts.loading.config as config

    monkeypatch.setattr(config, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="--experts-implementation fused.*TRITON_INTERPRET=1"):
        check_config(PagingConfig(experts_implementation="fused", decide="auto"))


def test_fused_refuses_the_host_decide_and_the_baselines():
    with pytest.raises(ConfigError, match="--decide device") as err:
        check_config(PagingConfig(experts_implementation="fused", decide="host"))
    assert "fused" in str(err.value)
    with pytest.raises(ConfigError, match="mode paged"):
        check_config(PagingConfig(experts_implementation="fused", mode="resident"))


def test_auto_decide_is_device_for_fused():
    from pagedexperts.loading.config import resolve_decide

    cfg = PagingConfig(experts_implementation="fused")
    assert resolve_decide(cfg, disk_tier=False, pinned=True, quantized=True) == "device"


@pytest.mark.slow
@pytest.mark.default_threads
def test_packed_quantized_slots_are_accepted_for_capture_and_decode_the_same(bundled_source, tmp_path_factory):
    """``generation.graphs`` accepts a fused step over packed int4 slots (no capture problem:
    the dequantizing path is refused for them) and its static-buffer decode (the function a
    CUDA graph captures, run by the eager backend) gives the logits the same fused kernel gives
    with all E experts resident, decoded the same way."""
    from pagedexperts.generation.capture_checks import capture_problem_of
    from pagedexperts.generation.graphs import DecodeGraphs
    path = variant("w4a16", bundled_source, tmp_path_factory)
    dequantizing, _ = load_model(path, num_resident=bundled.TOP_K, decide="device", device_kernels="torch",
                                 slot_format="packed", cuda_graphs="eager", check_independence=False)
    assert "quantized format" in capture_problem_of(dequantizing)
    ids, mask = prompts(1)
    steps = 2
    tokens = torch.randint(1, 4000, (1, steps), generator=torch.Generator().manual_seed(7))
    logits = {}
    for k in (bundled.TOP_K, bundled.E):
        model = fused_model(path, k, cuda_graphs="eager")
        assert capture_problem_of(model) is None
        graphs = DecodeGraphs(model, backend="eager", max_batch=1)
        st = graphs.step_for(1, PROMPT + steps + 1)
        with torch.no_grad():
            logits[k] = [st.prefill(ids, mask)] + [graphs.decode(st, tokens[:, i], PROMPT + i) for i in range(steps)]
        assert graphs.summary()["captures"] == 1 and graphs.summary()["fallbacks"] == []
    assert all(torch.equal(a, b) for a, b in zip(logits[bundled.TOP_K], logits[bundled.E]))
