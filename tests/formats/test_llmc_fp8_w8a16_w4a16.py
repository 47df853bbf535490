"""compressed-tensors checkpoints written by llm-compressor 0.14 (tests/data/llmc, see its README):
FP8 (per-tensor weights, static input scale), FP8_DYNAMIC (per-channel), FP8_BLOCK, W8A16 and
W4A16 with a group size per projection, on tiny Qwen3-MoE and DeepSeek-V3 models (Mixtral: see
tests/data/llmc/make_fixtures.py).

Oracles: transformers' own ``from_pretrained`` of the checkpoint (CPU) where it loads it (every
fixture but the per-projection one: transformers applies one config group to all expert
projections); compressed-tensors' own per-module decompression (``BaseCompressor`` of the
group's format, the group matched by compressed-tensors' ``is_match``) for every fixture's
experts. Paged vs unpaged: torch.equal of every prefill and decode step's logits, batch 1 and a
left-padded batch of 3, K = top_k, 2 top_k, E/2, packed and dense slots, and the disk tier.

Legend: E routed experts (16), k top_k (2), K resident slots.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.cli import main as cli_main

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.utils.match import is_match  # noqa: E402
from support.tiny import E, TOP_K, VOCAB, greedy_logits  # noqa: E402
from support.quantized_dirs import load_with_two_host_rows  # noqa: E402
from support import paths  # noqa: E402

DATA = paths.DATA / "llmc"
FORMAT = {
    "qwen3_moe-fp8": "ct-fp8", "qwen3_moe-fp8_dynamic": "ct-fp8", "qwen3_moe-fp8_block": "ct-fp8",
    "qwen3_moe-w8a16": "w8a16", "qwen3_moe-w4a16_mixed": "ct-pack-mixed",
    "deepseek_v3-fp8_block": "ct-fp8", "deepseek_v3-w8a16": "w8a16",
}
TRANSFORMERS_WRONG_OR_FAILS = {"qwen3_moe-w4a16_mixed"}  # one config group for every projection
FIXTURES = sorted(FORMAT)
MERGED = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


@lru_cache(maxsize=None)
def reference(name: str):
    """transformers' own loading of the checkpoint (the unpaged model), float32, grouped_mm."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DATA / name, experts_implementation="grouped_mm").eval()


def library_experts(path: Path, layer: int) -> dict[str, torch.Tensor]:
    """{dense name: [E, ...]} of one layer, every projection decompressed by compressed-tensors
    with the config group compressed-tensors matches to it, gate/up concatenated along rows."""
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = {n: QuantizationScheme(**{k: v for k, v in g.items()}) for n, g in qc["config_groups"].items()}
    out = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for dense, families in MERGED.items():
            rows = []
            for j in range(E):
                prefix = f"model.layers.{layer}.mlp.experts.{j}."
                projs = next(p for p in families if f"{prefix}{p[0]}.weight_scale" in keys)
                parts = []
                for p in projs:
                    module = prefix + p
                    scheme = next(s for s in groups.values() if is_match(module, torch.nn.Linear(1, 1), s.targets))
                    sd = {k.rpartition(".")[2]: f.get_tensor(k) for k in keys if k.startswith(module + ".")}
                    sd.pop("input_scale", None)
                    parts.append(BaseCompressor.get_value_from_registry(scheme.format).decompress(sd, scheme)["weight"])
                rows.append(torch.cat(parts, dim=0))
            out[dense] = torch.stack(rows)
    return out


def moe_layers(model) -> list[int]:
    return sorted(int(re.search(r"layers\.(\d+)\.", s).group(1)) for s in model.pagedexperts.stores)


def paged_experts(model, layer: int) -> dict[str, torch.Tensor]:
    """{dense name: [E, ...]} dequantized by the format from the host store's packed rows."""
    rt = model.pagedexperts
    site = next(s for s in rt.stores if f"layers.{layer}." in s)
    store = rt.stores[site]
    return rt.layouts[site].dequantize({s.name: store.tensors[s.name] for s in store.specs})


@pytest.mark.parametrize("name", FIXTURES)
def test_format_and_experts_equal_the_library_and_transformers(name):
    model, _ = load_model(DATA / name, num_resident=TOP_K)
    assert model.pagedexperts.expert_format == FORMAT[name]
    assert model.pagedexperts.expert_bytes < model.pagedexperts.dense_expert_bytes  # packed bytes in the store
    for layer in moe_layers(model):
        got, lib = paged_experts(model, layer), library_experts(DATA / name, layer)
        for dense, want in lib.items():
            assert torch.equal(got[dense], want.to(got[dense].dtype)), (name, layer, dense)
            if name not in TRANSFORMERS_WRONG_OR_FAILS:
                ref = getattr(reference(name).get_submodule(f"model.layers.{layer}.mlp.experts"), dense)
                assert torch.equal(got[dense], ref), (name, layer, dense, (got[dense] - ref).abs().max())


def _prompts(batch: int):
    ids = torch.randint(2, VOCAB, (batch, 10), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :3], mask[0, :3] = 0, 0  # left padding on the first row
    return ids, mask


def _unpaged(name: str):
    """transformers' model where it loads the checkpoint right, else the resident model (its
    experts checked against compressed-tensors' decompression in the test above)."""
    if name in TRANSFORMERS_WRONG_OR_FAILS:
        return _resident(name)
    return reference(name)


@lru_cache(maxsize=None)
def _resident(name: str):
    return load_model(DATA / name, mode="resident")[0].eval()


def assert_logits_equal(paged, unpaged, what: str) -> None:
    for batch in (1, 3):
        ids, mask = _prompts(batch)
        got, want = greedy_logits(paged, ids, mask, steps=4), greedy_logits(unpaged, ids, mask, steps=4)
        assert torch.equal(got, want), f"{what} batch {batch}: max |diff| {(got - want).abs().max():.3e}"


@pytest.mark.parametrize("k", [TOP_K, 2 * TOP_K, E // 2])
@pytest.mark.parametrize("name", FIXTURES)
def test_paged_equals_unpaged(name, k):
    paged, _ = load_model(DATA / name, num_resident=k, slot_format="packed")
    assert_logits_equal(paged, _unpaged(name), f"{name} K={k} packed")
    assert paged.pagedexperts.stats().as_dict()["misses"] > 0


@pytest.mark.parametrize("name", ["qwen3_moe-fp8", "qwen3_moe-fp8_block", "qwen3_moe-w8a16", "qwen3_moe-w4a16_mixed"])
def test_dense_slots_and_thread_counts(name, threads):
    paged, _ = load_model(DATA / name, num_resident=TOP_K, slot_format="dense")
    assert_logits_equal(paged, _unpaged(name), f"{name} dense slots, {threads} threads")


@pytest.mark.parametrize("name", ["qwen3_moe-fp8", "qwen3_moe-w8a16", "qwen3_moe-w4a16_mixed", "deepseek_v3-fp8_block"])
def test_disk_tier(name):
    tiered, expert_bytes = load_with_two_host_rows(DATA / name, TOP_K)
    assert_logits_equal(tiered, _unpaged(name), f"{name} disk tier")
    totals = tiered.pagedexperts.stats().as_dict()
    assert totals["disk_reads"] > 0
    assert totals["disk_bytes_read"] == totals["disk_reads"] * expert_bytes


def _one_group_copy(tmp_path: Path) -> Path:
    """The per-projection W4A16 fixture with its down_proj group removed: group 32 then applies
    to down_proj, whose 16 input features it does not divide."""
    dst = shutil.copytree(DATA / "qwen3_moe-w4a16_mixed", tmp_path / "one-group")
    cfg = json.loads((dst / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups.pop("group_1")
    groups["group_0"]["targets"] = ["Linear"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_preflight_refuses_what_load_refuses_with_the_same_message(tmp_path, capsys):
    path = _one_group_copy(tmp_path)
    with pytest.raises(ValueError) as load_error:
        load_model(path, num_resident=TOP_K)
    assert cli_main(["preflight", "--model-path", str(path), "--num-resident", str(TOP_K)]) == 2
    assert str(load_error.value) in capsys.readouterr().err
    message = str(load_error.value)
    assert "in_features 16 is not a multiple" in message and "group_size 32" in message
    assert "quant_method 'compressed-tensors', format 'pack-quantized'" in message
    assert "nearest supported: ct-pack-mixed" in message


def test_preflight_sizes_the_per_projection_checkpoint_as_load(capsys):
    path = DATA / "qwen3_moe-w4a16_mixed"
    model, _ = load_model(path, num_resident=TOP_K)
    assert cli_main(["preflight", "--model-path", str(path), "--num-resident", str(TOP_K), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["expert_bytes"] == model.pagedexperts.expert_bytes
