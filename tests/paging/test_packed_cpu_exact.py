"""Packed experts (the default on a CPU for int formats at bfloat16, ``--experts-implementation
auto``; asked at float32): paged == the same packed kernels with all E resident.

Tool-written checkpoints of every int format torch's CPU kernels take (GPTQModel GPTQ int4,
AutoRound's GPTQ export and its own int4 and W8A16 int8, compressed-tensors W4A16 symmetric and
asymmetric), at K < E against K = E with the same body: prefill and decode logits torch.equal,
batch 1 and 3, float32 and bfloat16 run dtypes, default threads and 1 thread. Each loaded model
must have run packed on every layer (its slot tables in the kernels' layouts, no fallback); a
format the kernels cannot take runs grouped_mm with the reason in the stats. And against
transformers' dequantized model: within ``tools.check_fused``'s tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.tiny import DEFAULT_THREADS, greedy_logits
from pagedexperts.formats.cpu_pack import CpuPackedSlots
from pagedexperts.loading.loader import load_model
from pagedexperts.paging.steps.host_packed import HostPackedStep
from support.paths import DATA

PACKED_FIXTURES = {  # name -> (directory, what the kernels run)
    "gptqmodel-gptq-int4": ("gptqmodel/qwen3_moe-gptq-experts", "int4"),
    "autoround-gptq-int4": ("autoround/qwen3_moe-auto_gptq", "int4"),
    "autoround-int4": ("autoround/qwen3_moe-auto_round-experts", "int4"),
    "autoround-w8a16": ("autoround/qwen3_moe-auto_round-W8A16-experts", "int8"),
    "ct-w4a16-asym": ("llmc/qwen3_moe-W4A16_ASYM-g32", "int4"),
    "ct-w4a16-sym-whole": ("llmc_whole/qwen3_moe-W4A16-g32", "int4"),
}


def _load(path: Path, k: int | None, dtype: str, **options):
    """The model packed: at bfloat16 as users load it (default options: auto, packed on a CPU for
    these formats), at float32 with packed asked (auto runs grouped_mm there: the int4 kernel's
    scalar path); or with ``options``."""
    options = options or ({} if dtype == "bfloat16" else {"experts_implementation": "packed"})
    model, _ = load_model(path, num_resident=k, dtype=dtype, **options)
    return model.eval()


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(2, 100, (batch, 6), generator=torch.Generator().manual_seed(batch))


def _kinds(model) -> set[str]:
    """The kernel kinds the model's layers run; asserts every layer runs packed."""
    rt = model.pagedexperts
    assert rt.resolved.experts_fallbacks == {} and rt.stats().fallbacks == []
    kinds = set()
    for runner in rt.runners.values():
        assert isinstance(runner.body, HostPackedStep) and runner.inner == "packed"
        assert isinstance(runner.slots, CpuPackedSlots)
        kinds |= {p.kind for p in runner.slots.plans.values()}
    return kinds


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(PACKED_FIXTURES))
def test_paged_packed_equals_all_resident(name, dtype):
    path, kind = DATA / PACKED_FIXTURES[name][0], PACKED_FIXTURES[name][1]
    oracle = _load(path, None, dtype)
    num_experts, top_k = oracle.pagedexperts.num_experts, oracle.pagedexperts.top_k
    oracle = _load(path, num_experts, dtype)
    paged = _load(path, top_k + 1, dtype)
    assert _kinds(oracle) == _kinds(paged) == {kind}
    for threads in dict.fromkeys((DEFAULT_THREADS, 1)):
        torch.set_num_threads(threads)
        for batch in (1, 3):
            want, got = greedy_logits(oracle, _ids(batch), steps=4), greedy_logits(paged, _ids(batch), steps=4)
            diff = (want.float() - got.float()).abs()
            assert torch.equal(want, got), (f"{name} {dtype} {threads} threads batch {batch}: max diff "
                                            f"{diff.max():.3g}, mean {diff.mean():.3g}")
    stats = paged.pagedexperts.stats()
    assert sum(s.misses for s in stats.layers.values()) > num_experts  # K < E paged: experts were evicted


def test_fallback_layers_run_grouped_mm_and_say_why(caplog):
    """FP8 block experts: no CPU int kernel; each layer runs grouped_mm over the slot table grouped_mm
    gets (exact to transformers' own grouped_mm), one WARNING naming the layers and the reason, the reason in the stats."""
    path = DATA / "llmc/qwen3_moe-fp8_block"
    with caplog.at_level("WARNING"):
        model = _load(path, 4, "float32", experts_implementation="packed")
    rt = model.pagedexperts
    fallbacks = rt.resolved.experts_fallbacks
    assert set(fallbacks) == set(rt.runners) and all("e4m3" in why for why in fallbacks.values())
    warned = [r.getMessage() for r in caplog.records if "run grouped_mm instead" in r.getMessage()]
    assert len(warned) == 1 and f"MoE layers {sorted(rt.runners)} run grouped_mm instead" in warned[0], warned
    assert len(rt.stats().fallbacks) == len(rt.runners)
    assert all(r.inner == "grouped_mm" and not isinstance(r.body, HostPackedStep) for r in rt.runners.values())
    grouped, _ = load_model(path, num_resident=4, dtype="float32")
    ids = _ids(2)
    assert torch.equal(greedy_logits(model, ids, steps=3), greedy_logits(grouped.eval(), ids, steps=3))


@pytest.mark.parametrize("name", ["gptqmodel-gptq-int4", "autoround-int4", "autoround-w8a16"])  # tokenizers that tokenize
def test_packed_within_tolerance_of_transformers(name, reference_model):
    """The second verdict: teacher-forced logits of paged packed vs the unpaged reference
    (transformers' own loading where it reads the format, else the package's resident model)."""
    from pagedexperts.tools.check import DEFAULT_PROMPTS, load_reference_with_choice
    from pagedexperts.tools.check_fused import tolerance_check
    from transformers import AutoTokenizer

    path = DATA / PACKED_FIXTURES[name][0]
    reference, _ = load_reference_with_choice(path, device="cpu", dtype="float32", experts_implementation="grouped_mm")
    paged = _load(path, 3, "float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    result = tolerance_check(paged, reference, None, tokenizer, list(DEFAULT_PROMPTS), max_new_tokens=4)
    assert result.passed and 0 < result.max_abs_diff <= result.bound, result


def test_host_store_holds_the_kernel_layout_and_a_page_in_copies_it():
    """Converted once at load: the store's rows are the kernels' (a page-in copies them as they
    are), equal to converting the checkpoint's rows; a repage keeps them."""
    from pagedexperts.loading.independence import reference_rows
    from pagedexperts.loading.checkpoint import KeyMap
    from pagedexperts.loading.loader import read_checkpoint_config
    from pagedexperts.loading.checkpoint import format_for_checkpoint
    from pagedexperts.loading.runners import repage

    path = DATA / PACKED_FIXTURES["ct-w4a16-asym"][0]
    model = _load(path, 3, "float32")
    rt = model.pagedexperts
    site = rt.sites[0]
    store, slots = rt.stores[site.name], rt.runners[site.layer].slots
    assert set(store.tensors) == set(slots)
    _, config, files = read_checkpoint_config(path)
    fmt = format_for_checkpoint(config, files)
    keymap = KeyMap(model.config.model_type, {site.name: site}, fmt)
    ref = reference_rows(files, keymap, {site.name: rt.layouts[site.name].packed_specs}, {site.name: [5]})[site.name][5]
    for name, row in slots.convert(ref).items():
        assert torch.equal(store.tensors[name][5], row), name
    repage(model, num_resident=4)
    assert set(rt.stores[site.name].tensors) == set(rt.runners[site.layer].slots)


@pytest.mark.default_threads
def test_disk_tier_rows_convert_at_page_in_and_stay_exact():
    """With the disk tier (a few host rows per layer) the rows come from the checkpoint in the
    format's layout and are converted at page-in: logits equal packed with all E resident."""
    from support.tiny import host_budget_gb

    path = DATA / PACKED_FIXTURES["autoround-int4"][0]
    oracle = _load(path, None, "float32")
    num_experts, top_k = oracle.pagedexperts.num_experts, oracle.pagedexperts.top_k
    oracle = _load(path, num_experts, "float32")
    budget = host_budget_gb(path, 2, num_resident=top_k, dtype="float32", experts_implementation="packed")
    tiered, _ = load_model(path, num_resident=top_k, dtype="float32", experts_implementation="packed",
                           host_memory_gb=budget)
    assert tiered.pagedexperts.host_memory.host_rows < num_experts  # the disk tier is on
    _kinds(tiered)
    ids = _ids(2)
    want, got = greedy_logits(oracle, ids, steps=4), greedy_logits(tiered.eval(), ids, steps=4)
    assert torch.equal(want, got), (want.float() - got.float()).abs().max()


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_prefill_is_exact_whatever_the_waves(dtype):
    """A prefill of 1920 tokens (16 x 120): the waves of K = 3 hold ~1400 rows each, past the
    size where an elementwise kernel splits its rows over threads (and float32 SiLU's vector and
    scalar paths differ in the last bits): the gate's rows must sit where they sit with all E
    resident, so paged logits equal all-resident logits."""
    path = DATA / PACKED_FIXTURES["ct-w4a16-asym"][0]
    oracle = _load(path, None, dtype)
    oracle = _load(path, oracle.pagedexperts.num_experts, dtype)
    paged = _load(path, 3, dtype)
    ids = torch.randint(2, 200, (16, 120), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = oracle(input_ids=ids).logits, paged(input_ids=ids).logits
    assert torch.equal(want, got), f"max diff {(want.float() - got.float()).abs().max():.3g}"
