"""The disk tier over quantized checkpoints (issue 14): packed experts read at their file offsets.

Oracle for the bytes: the full-store load of the same checkpoint (``loading.fill``, whose paged
model is torch.equal to transformers' own loading: test_fp8_mxfp4, test_int4_paged): every
expert's packed rows read on demand by the tier equal the full store's rows, in every published layout (block FP8
per-expert and stacked, MXFP4 stacked with biases, compressed-tensors w4a16 symmetric and
asymmetric, GPTQ and AWQ whose gate and up sources sit side by side along dim 1). Oracle for
the logits: the full-store paged model (itself torch.equal to transformers' loading: test_fp8_mxfp4,
test_int4_paged), greedy decode at batch 1 and a left-padded batch of 3, packed and dense slots,
default thread count and 1 thread. The start-up independence check sees through the tier.

Legend: E routed experts, k top_k, K resident slots, R host rows per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pagedexperts
from pagedexperts import load_model
from pagedexperts.paging.steps.contract import PackedSlots
from support.tiny import greedy_logits, tier_budget_gb
from support.quantized_dirs import restack_fp8_experts, write_fp8_block, write_mxfp4
from support.families import E, TOP_K, VOCAB, build_model, save_char_tokenizer

pytest.importorskip("compressed_tensors")
R = 2
FP8_BLOCK = (16, 16)  # several blocks per expert tensor (H = 32, I = 64): a scale offset matters
FORMATS = ["fp8-block", "fp8-block-stacked", "mxfp4", "w4a16", "w4a16-asym", "gptq", "awq"]


def _source(root: Path, family: str) -> Path:
    src = root / f"src-{family}"
    if not src.exists():
        model = build_model(family)
        with torch.no_grad():  # gpt-oss initialises its expert biases to zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("_bias") and ".experts." in name:
                    p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        model.to(torch.bfloat16).save_pretrained(src)
        save_char_tokenizer(src)
    return src


def _build(root: Path, name: str) -> Path:
    from support.quantized_dirs import _oracle_pair, _w4a16_pair

    if name == "mxfp4":
        return write_mxfp4(_source(root, "gpt_oss"), root / name)
    src = _source(root, "qwen3_moe")
    if name.startswith("fp8-block"):
        per_expert = root / "fp8-block"
        if not per_expert.exists():
            write_fp8_block(src, per_expert, FP8_BLOCK)
        return per_expert if name == "fp8-block" else restack_fp8_experts(per_expert, root / name)
    if name.startswith("w4a16"):
        return _w4a16_pair(src, root, symmetric=name == "w4a16")[0]
    return _oracle_pair(src, root, name)[0]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """format name -> tiny quantized checkpoint directory, built on first use."""
    root, built = tmp_path_factory.mktemp("qdisk"), {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _build(root, name)
        return built[name]

    return get


def tier_gb(full_model, rows: int = R) -> float:
    """--host-memory-gb for ``rows`` host rows per layer (``support.tiny.tier_budget_gb``)."""
    return tier_budget_gb(full_model, rows)


def load_pair(path: Path, **kwargs):
    """(full-store model, disk-tier model with R host rows) of one checkpoint. The tier reads the
    checkpoint's own layout (no stored kernel layout: its rows would be re-made in the layout's
    bytes, tests/storage/test_stored_layout.py), so R rows are what the budget buys."""
    kwargs.setdefault("stored_layout", False)
    full, _ = load_model(path, num_resident=TOP_K, **kwargs)
    tiered, _ = load_model(path, num_resident=TOP_K, host_memory_gb=tier_gb(full), **kwargs)
    assert tiered.pagedexperts.host_memory.host_rows == R
    return full, tiered


@pytest.mark.parametrize("name", FORMATS)
def test_tier_rows_equal_the_full_store_rows(quantized, name):
    full, tiered = load_pair(quantized(name), experts_implementation="grouped_mm")  # the store holds the format's rows
    rt = tiered.pagedexperts
    assert rt.expert_format == name.removesuffix("-stacked").removesuffix("-asym")
    assert rt.expert_bytes < rt.dense_expert_bytes  # the rows hold packed bytes
    for site, store in rt.stores.items():
        reference = full.pagedexperts.stores[site]
        slots = PackedSlots({s.name: torch.zeros((1, *s.shape), dtype=s.dtype) for s in store.specs})
        for expert in range(E):
            store.copy_to_slot(expert, 0, slots)
            for spec in store.specs:
                assert torch.equal(slots[spec.name][0], reference.tensors[spec.name][expert]), (site, expert, spec.name)
        t = store.tier_stats  # experts 0..E-1 once each, R < E: every one a host miss and one read
        assert (t.host_hits, t.host_misses, t.disk_reads) == (0, E, E)
        assert t.disk_bytes_read == E * rt.expert_bytes


@pytest.mark.parametrize("slot_format", ["packed", "dense"])
@pytest.mark.parametrize("name", ["fp8-block", "w4a16", "gptq"])
def test_tier_logits_equal_the_full_store(quantized, name, slot_format, threads):
    full, tiered = load_pair(quantized(name), slot_format=slot_format)
    for batch in (1, 3):
        ids = torch.randint(2, VOCAB, (batch, 10), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        if batch > 1:
            ids[0, :3], mask[0, :3] = 0, 0  # left padding on the first row
        got, want = greedy_logits(tiered, ids, mask), greedy_logits(full, ids, mask)
        assert torch.equal(got, want), f"batch {batch}: max |diff| {(got - want).abs().max():.3e}"
    totals = tiered.pagedexperts.stats().as_dict()
    assert totals["disk_reads"] > 0
    assert totals["disk_bytes_read"] == totals["disk_reads"] * tiered.pagedexperts.expert_bytes


@pytest.mark.parametrize("slot_format, culprit", [("packed", r"from a packed tensor 'gate_up_proj_scale_inv'"),
                                                   ("dense", r"'gate_up_proj' dequantized at page-in")])
def test_the_independence_check_sees_through_the_tier(quantized, monkeypatch, slot_format, culprit):
    """A scale read one element off its offset by the tier: load_model fails naming the tensor."""
    from pagedexperts.loading.independence import IndependenceError
    from pagedexperts.loading import fill as reader

    path = quantized("fp8-block")
    full, _ = load_model(path, num_resident=TOP_K)
    original = reader.expert_extents

    def shifted(entry, *, spec, **kwargs):
        pairs = original(entry, spec=spec, **kwargs)
        if not spec.name.endswith("_scale_inv"):
            return pairs
        return [(e, ext._replace(offset=ext.offset + 4)) for e, ext in pairs]

    monkeypatch.setattr(reader, "expert_extents", shifted)
    with pytest.raises(IndependenceError, match=rf"expert 0 paged into slot 0: the kernel would read .*{culprit}"):
        load_model(path, num_resident=TOP_K, host_memory_gb=tier_gb(full), slot_format=slot_format)


def test_a_stacked_tensor_without_e_leading_is_refused_by_name(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    from support.tiny import copy_dir

    healthy, _ = load_model(quantized("fp8-block-stacked"), num_resident=TOP_K)
    path = copy_dir(quantized("fp8-block-stacked"), tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    key = next(k for k in tensors if k.endswith(".experts.down_proj"))
    tensors[key] = tensors[key].transpose(0, 1).contiguous()  # [H, E, I]: an expert's bytes are strided
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    for gb in (None, tier_gb(healthy)):  # the full store refuses it too

        with pytest.raises(ValueError, match=rf"{key}.* has 32 experts.*E=8"):  # H = 32
            load_model(path, num_resident=TOP_K, host_memory_gb=gb)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8-block", "w4a16"])
def test_check_and_generate_on_the_bundled_variant_with_the_tier(fmt, tmp_path, monkeypatch, capsys):
    """The real CLI entry point, in-process (no fresh interpreter per command):
    check exits non-zero unless torch.equal; two prompts of different lengths, each alone and as
    a left-padded batch of 2, 4 greedy steps, at K=8."""
    from pagedexperts.cli import main

    monkeypatch.setenv("PAGEDEXPERTS_CACHE", str(tmp_path / "cache"))
    # G = 0.6218 GB: the runtime allowance, slots, weights and KV take 0.6208, leaving ~1 MB of the store
    tier = ["--model-path", f"bundled:{fmt}", "--num-resident", "8", "--host-memory-gb", "0.6218"]
    for slot_format in ("packed", "dense"):
        rc = main(["check", *tier, "--slot-format", slot_format, "--prompt", "ROMEO:", "--prompt",
                   "The history of the city", "--max-new-tokens", "4"])
        assert rc == 0, capsys.readouterr().out
    out = tmp_path / "stats.json"
    assert main(["generate", *tier, "--prompt", "Once upon a time", "--max-new-tokens", "4",
                 "--stats-json", str(out), "--quiet"]) == 0
    paging = json.loads(out.read_text())["paging"]
    assert paging["disk_tier"] and paging["disk_reads"] > 0
    cfg = json.loads((pagedexperts.bundled_model_path() / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    packed = {  # by hand from the published layouts: gate, up and down of one expert
        "fp8-block": 3 * h * i + 4 * (2 * -(-i // 128) * -(-h // 128) + -(-h // 128) * -(-i // 128)),
        "w4a16": 3 * h * i // 2 + 4 * (2 * i * (h // 64) + h * (i // 64)) + 8 * 2 * 3,  # float32 scales
    }[fmt]
    assert paging["disk_bytes_read"] == paging["disk_reads"] * packed


@pytest.mark.parametrize("name", ["mxfp4", "w4a16-asym"])
def test_tier_with_read_ahead_equals_the_full_store(quantized, name):
    full, tiered = load_pair(quantized(name), prefetch=True)
    ids = torch.randint(2, VOCAB, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    assert torch.equal(greedy_logits(tiered, ids, mask), greedy_logits(full, ids, mask))
    d = tiered.pagedexperts.stats().as_dict()
    assert d["read_ahead_used"] > 0 and d["disk_bytes_read"] == d["disk_reads"] * tiered.pagedexperts.expert_bytes
