"""llm-compressor checkpoints run at a dtype other than their scales' (issue 33 items 13-14): the
float32 fixtures of tests/data/llmc (float32 scales, as llm-compressor writes for a float32
model) run at bfloat16 and float16, as real FP8 / W8A8 checkpoints are run. compressed-tensors
dequantizes in the scale's dtype (``x_q.to(scale.dtype) * scale``, float32 here), then the model
casts once; multiplying in the run dtype instead rounds twice and changes about a quarter of a
bfloat16 projection's weights, which every float32 run hides.

Oracles, independent of pagedexperts' formats: compressed-tensors' own per-module
``decompress`` (the config group chosen by compressed-tensors' ``is_match``) of every routed
expert, cast to the run dtype; ``check``'s unpaged reference built at the run dtype (transformers'
loading once checked, else compressed-tensors' decompression; never the resident model).
Paged == reference with torch.equal, a prompt alone and a left-padded batch of 2, default
thread count.

Legend: k top_k (2), K resident slots.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.tools.check import load_reference_with_choice
from support.quantized_dirs import prefill_decode_runs

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.utils.match import is_match  # noqa: E402
from support import paths  # noqa: E402

DATA = paths.DATA / "llmc"
TOP_K = paths.FIXTURE_TOP_K
FIXTURES = {  # float32 checkpoint, float32 weight_scale -> format
    "qwen3_moe-fp8": "ct-fp8", "qwen3_moe-fp8_dynamic": "ct-fp8", "qwen3_moe-fp8_block": "ct-fp8",
    "mixtral-FP8_DYNAMIC": "ct-fp8", "deepseek_v3-fp8_block": "ct-fp8",
    "qwen3_moe-W8A8": "w8a8-int8", "mixtral-W8A8": "w8a8-int8",
    "qwen3_moe-w8a16": "w8a16", "qwen3_moe-W4A16_ASYM-g32": "w4a16", "qwen3_moe-w4a16_mixed": "ct-pack-mixed",
}
SOURCES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def _fixture(name: str) -> Path:
    path = DATA / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: run tests/data/llmc/make_fixtures.py with llm-compressor's venv")
    return path


def library_experts(path: Path, layer: int, experts: int) -> dict[str, torch.Tensor]:
    """{dense name: [E, sources * O, I]} of one layer: each projection decompressed by
    compressed-tensors with the config group compressed-tensors matches to it (in the scales'
    dtype), gate/up (Mixtral w1/w3) concatenated along rows."""
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = [QuantizationScheme(**g) for g in qc["config_groups"].values()]
    out = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for dense, families in SOURCES.items():
            rows = []
            for j in range(experts):
                prefix = f"model.layers.{layer}.block_sparse_moe.experts.{j}." if any(
                    k.startswith(f"model.layers.{layer}.block_sparse_moe.") for k in keys) else \
                    f"model.layers.{layer}.mlp.experts.{j}."
                projs = next(p for p in families if f"{prefix}{p[0]}.weight_scale" in keys)
                parts = []
                for p in projs:
                    module = prefix + p
                    scheme = next(s for s in groups if is_match(module, torch.nn.Linear(1, 1), s.targets))
                    state = {k.rpartition(".")[2]: f.get_tensor(k) for k in keys if k.startswith(module + ".")}
                    state.pop("input_scale", None)
                    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc["format"])
                    parts.append(compressor.decompress(state, scheme)["weight"])
                rows.append(torch.cat(parts, dim=0))
            out[dense] = torch.stack(rows)
    return out


def paged_experts(model, site: str) -> dict[str, torch.Tensor]:
    """{dense name: [E, ...]}: the format's dequantization of the host store's packed rows."""
    rt = model.pagedexperts
    store = rt.stores[site]
    return rt.layouts[site].dequantize({s.name: store.tensors[s.name] for s in store.specs})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_experts_equal_the_library_decompression_cast_once(name, dtype):
    """Every routed expert of every MoE layer, dequantized at bfloat16 / float16 from the store,
    is compressed-tensors' float32 decompression cast to the experts' dtype, bit for bit; the
    scales stay float32 in the store (the checkpoint's dtype, not the run's)."""
    path = _fixture(name)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("experts.0.down_proj.weight_scale")
                or k.endswith("experts.0.w2.weight_scale")} == {"F32"}
    model, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm", dtype=str(dtype).removeprefix("torch."))
    rt = model.pagedexperts
    assert rt.expert_format == FIXTURES[name]
    scales = [s for layout in rt.layouts.values() for s in layout.packed_specs if s.name.endswith("_scale")]
    assert scales and {s.dtype for s in scales} == {torch.float32}
    differs = 0
    for site in rt.stores:
        layer = int(re.search(r"layers\.(\d+)\.", site).group(1))
        got = paged_experts(model, site)
        for dense, want in library_experts(path, layer, got["down_proj"].shape[0]).items():
            assert torch.equal(got[dense], want.to(got[dense].dtype)), (name, site, dense)
            differs += int((want.to(dtype).float() != want).sum())
    assert differs > 0  # the run dtype rounds these weights: a float32 run could not tell


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["qwen3_moe-fp8", "mixtral-FP8_DYNAMIC", "deepseek_v3-fp8_block", "qwen3_moe-W8A8",
                                  "qwen3_moe-w4a16_mixed"])
def test_paged_equals_reference_at_the_run_dtype(name, dtype):
    """K = top_k, packed slots, against ``check``'s reference built at the same dtype."""
    path = _fixture(name)
    reference, choice = load_reference_with_choice(path, device="cpu", dtype=dtype, experts_implementation="grouped_mm")
    assert choice.source in ("transformers", "compressed-tensors"), choice.line()
    assert reference.dtype == getattr(torch, dtype)
    paged, _ = load_model(path, num_resident=TOP_K, experts_implementation="grouped_mm", dtype=dtype)
    with torch.no_grad():
        for run in prefill_decode_runs(paged, reference):
            assert run.exact and run.tokens_equal, f"{name} {dtype} {run.prompt}: {run.max_abs_diff:.3g}"


AUTOROUND_INT8 = paths.DATA / "autoround" / "qwen3_moe-llm_compressor-INT8_W8A8-experts"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_scales_stored_in_another_dtype_than_the_config(dtype):
    """AutoRound 0.16.1's llm_compressor export of INT8_W8A8 stores float16 ``weight_scale``
    under a bfloat16 config.json: the store keeps them float16 (the headers' dtype, not the
    config's) and every routed expert, dequantized from the store, is compressed-tensors' own
    decompression (in float16) bit for bit, whatever the run dtype."""
    cfg = json.loads((AUTOROUND_INT8 / "config.json").read_text())
    with safe_open(str(AUTOROUND_INT8 / "model.safetensors"), "pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys() if ".experts." in k and k.endswith("weight_scale")}
    assert cfg["dtype"] == "bfloat16" and stored == {"F16"}
    model, _ = load_model(AUTOROUND_INT8, num_resident=TOP_K, dtype=dtype)
    rt = model.pagedexperts
    assert rt.expert_format == "w8a8-int8"
    for site in rt.stores:
        layer = int(re.search(r"layers\.(\d+)\.", site).group(1))
        got = paged_experts(model, site)
        for dense, want in library_experts(AUTOROUND_INT8, layer, got["down_proj"].shape[0]).items():
            assert want.dtype == torch.float16 and got[dense].dtype == want.dtype, (site, dense, got[dense].dtype)
            assert torch.equal(got[dense], want), (site, dense)


@pytest.mark.parametrize("path", [DATA / "qwen3_moe-W8A8", AUTOROUND_INT8], ids=["llmc-float32", "autoround-bf16-config"])
def test_int8_config_alone_sizes_the_experts_as_the_checkpoint_stores_them(path):
    """``format_for_config`` from config.json alone (what a random-fill benchmark builds its
    stores with, no headers read) binds the scales to the saved dtype, so an expert's packed
    bytes at another run dtype are the checkpoint's own (llm-compressor saves the scales in the
    model's dtype); the headers' binding gives the checkpoint's bytes in every case."""
    from pagedexperts.formats import format_for_config
    from pagedexperts.formats.base import TensorSpec
    from pagedexperts.loading.checkpoint import format_for_checkpoint

    cfg = json.loads((path / "config.json").read_text())
    inter, hidden = cfg.get("moe_intermediate_size") or cfg["intermediate_size"], cfg["hidden_size"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1]
                      * {"I8": 1, "F16": 2, "BF16": 2, "F32": 4}[f.get_slice(k).get_dtype()]
                      for k in f.keys() if ".layers.0.mlp.experts.0." in k)
    specs = (TensorSpec("gate_up_proj", (2 * inter, hidden), torch.bfloat16), TensorSpec("down_proj", (hidden, inter), torch.bfloat16))
    by_headers = format_for_checkpoint(cfg, [path / "model.safetensors"]).layout(specs, sources={"gate_up_proj": 2})
    assert by_headers.expert_bytes == on_disk
    if path != AUTOROUND_INT8:  # its float16 scales under a bfloat16 config: only the headers say so
        by_config = format_for_config(cfg).layout(specs, sources={"gate_up_proj": 2})
        assert by_config.expert_bytes == on_disk
