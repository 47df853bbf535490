"""compressed-tensors layouts the quantization tools write beyond llm-compressor's presets, on
the tiny checkpoints compressed-tensors' own compressors write (tests/data/ct,
``make_fixtures.py`` beside them): config groups whose targets are module names, a first group
naming attention before the experts' ``Linear`` group, ``naive-quantized`` FP8, FP8 per channel
with static input activations, ``mxfp8-quantized``, a target listed by two groups (the later
group's scheme applies).

Oracle, independent of pagedexperts' formats: compressed-tensors' own per-module
``decompress`` of every quantized module, in the scheme compressed-tensors' own
``apply_quantization_config`` gives it. Paged vs resident: torch.equal of prefill and decode logits, batch 1 and a
padded batch of 2, at K = top_k, in float32 and bfloat16 (the checkpoints' dtype).

Legend: E routed experts (8), k top_k (2), K resident slots.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pagedexperts import load_model
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.compressed_tensors.schemes import dense_schemes
from support.quantized_dirs import prefill_decode_runs

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from support import paths  # noqa: E402

DATA = paths.DATA / "ct"
E, TOP_K = paths.FIXTURE_E, paths.FIXTURE_TOP_K
# fixture -> (format name, how it binds the experts: dense tensor -> (bits or strategy, group size))
FIXTURES = {
    "qwen3_moe-named_targets": ("ct-pack-mixed", {"gate_up_proj": (4, 32), "down_proj": (4, 16)}),
    "qwen3_moe-named_attention_first": ("w4a16", {"gate_up_proj": (4, 32), "down_proj": (4, 32)}),
    "qwen3_moe-naive_fp8": ("ct-fp8", {"gate_up_proj": ("channel", None), "down_proj": ("channel", None)}),
    "qwen3_moe-fp8_static_channel": ("ct-fp8", {"gate_up_proj": ("channel", None), "down_proj": ("channel", None)}),
    "qwen3_moe-mxfp8": ("ct-fp8", {"gate_up_proj": ("group", 32), "down_proj": ("group", 32)}),
    # down_proj's target in two groups: the later group (16) wins, as compressed-tensors applies them
    "qwen3_moe-target_in_two_groups": ("ct-pack-mixed", {"gate_up_proj": (4, 32), "down_proj": (4, 16)}),
}
SOURCES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _config(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


def _modules(name: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every quantized module: prefix -> {local name: tensor}."""
    out: dict[str, dict] = {}
    with safe_open(str(DATA / name / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            prefix, _, local = key.rpartition(".")
            out.setdefault(prefix, {})[local] = f.get_tensor(key)
    return {p: m for p, m in out.items() if "weight_scale" in m}


def _library_schemes(qconf, modules: dict[str, dict]) -> dict[str, object]:
    """{module prefix: scheme} as compressed-tensors' own ``apply_quantization_config`` assigns
    them, on a tree of meta nn.Linear named and shaped as the checkpoint's quantized modules."""
    root = torch.nn.Module()
    for prefix, state in modules.items():
        parent = root
        *path, leaf = prefix.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        out_features, in_features = _shape(state)
        parent.add_module(leaf, torch.nn.Linear(in_features, out_features, bias=False, device="meta"))
    apply_quantization_config(root, qconf, show_progress=False)
    return {prefix: root.get_submodule(prefix).quantization_scheme for prefix in modules}


def _library(state: dict, scheme, qconf) -> torch.Tensor:
    """compressed-tensors' own decompression of one module in its ``scheme``."""
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qconf.format)
    return compressor.decompress(dict(state), scheme)["weight"]


def _shape(state: dict) -> tuple[int, int]:
    """(O, I) of one module: its ``weight_shape`` (pack-quantized) or its FP8 weight's shape."""
    return tuple(int(v) for v in state["weight_shape"]) if "weight_shape" in state else tuple(state["weight"].shape)


def _bound(name: str):
    cfg = _config(name)
    with safe_open(str(DATA / name / "model.safetensors"), framework="pt") as f:
        key = next(k for k in f.keys() if ".experts.0." in k and k.endswith("weight_scale"))
        stored = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "U8": "uint8"}[f.get_slice(key).get_dtype()])
    return cfg, format_for_config(cfg).with_stored_dtypes({"weight_scale": stored})


def _expert_weights(fmt, modules, layer: int, expert: int, dense: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The projections merged into ``dense`` of one expert, as the paged store dequantizes them."""
    parts = [modules[f"model.layers.{layer}.mlp.experts.{expert}.{p}"] for p in SOURCES[dense]]
    out_features, in_features = _shape(parts[0])
    layout = fmt.layout((TensorSpec(dense, (len(parts) * out_features, in_features), dtype),),
                        sources={dense: len(parts)})
    rows = {p.name: torch.cat([t["weight" + p.name.removeprefix(dense)] for t in parts], dim=p.concat_dim)[None]
            for p in layout.packed_specs}
    return list(layout.dequantize(rows)[dense][0].split(out_features))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_format_binds_each_projection_to_its_own_group(name):
    """Module-name targets match only the modules they name (before: the first group applied
    to every projection); each dense experts tensor bound to its group's bits and group size."""
    want_format, want = FIXTURES[name]
    cfg = _config(name)
    fmt = format_for_config(cfg)
    assert fmt.name == want_format
    schemes = dense_schemes(cfg["quantization_config"])
    for dense, (kind, group_size) in want.items():
        w = schemes[dense].weights
        assert (w["num_bits"] if isinstance(kind, int) else w["strategy"]) == kind and w.get("group_size") == group_size


def test_a_module_name_group_for_some_layers_only_is_refused_naming_both_modules():
    qc = _config("qwen3_moe-named_targets")["quantization_config"]
    targets = qc["config_groups"]["group_0"]["targets"]
    qc["config_groups"]["group_0"]["targets"] = [t for t in targets if ".layers.0." in t]
    qc["config_groups"]["group_3"] = {"targets": [t for t in targets if ".layers.1." in t], "format": "pack-quantized",
                                      "weights": {**qc["config_groups"]["group_0"]["weights"], "group_size": 32}}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.0\.down_proj has scheme .* but .*layers\.0"):
        dense_schemes(qc)


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_compressed_tensors_on_every_module(name, dtype):
    """Every routed-expert projection (through the paged layout) and every quantized attention
    projection (``linear_format``), bit-identical to compressed-tensors' decompression cast to
    ``dtype``."""
    cfg, fmt = _bound(name)
    qc = cfg["quantization_config"]
    qconf = QuantizationConfig.model_validate(qc)
    modules = _modules(name)
    schemes = _library_schemes(qconf, modules)
    checked = 0
    for prefix, state in modules.items():
        want = _library(state, schemes[prefix], qconf)
        if ".experts." in prefix:
            layer, expert, proj = int(prefix.split(".")[2]), int(prefix.split(".")[5]), prefix.rpartition(".")[2]
            dense = next(d for d, ps in SOURCES.items() if proj in ps)
            layout_dtype = fmt.experts_dtype(dtype) if hasattr(fmt, "experts_dtype") else dtype
            got = _expert_weights(fmt, modules, layer, expert, dense, dtype)[SOURCES[dense].index(proj)]
            want = want.to(layout_dtype)
        else:
            linear = fmt.linear_format(prefix, qc)
            spec = linear.linear_tensor(_shape(state), dtype)
            got = linear.dequantize_linear(spec, state)
            want = want.to(got.dtype)
        assert torch.equal(got, want), f"{prefix}: max |diff| {(got.double() - want.double()).abs().max():.3g}"
        checked += 1
    assert checked == len(modules) >= 2 * E * 3


@pytest.mark.default_threads
@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["default", "grouped_mm"])
def test_paged_equals_resident(name, dtype, impl):
    """Paged at K = top_k == all E resident with the same experts implementation: as users load it
    (auto: packed on a CPU for these int formats, against the same kernels at K = E) and with
    grouped_mm (against the resident model)."""
    options = {} if impl == "default" else {"experts_implementation": impl}
    if impl == "default":
        resident, _ = load_model(DATA / name, num_resident=E, dtype=dtype, check_independence=False)
    else:
        resident, _ = load_model(DATA / name, mode="resident", dtype=dtype, check_independence=False, **options)
    paged, _ = load_model(DATA / name, num_resident=TOP_K, dtype=dtype, **options)
    with torch.no_grad():
        for run in prefill_decode_runs(paged, resident):
            assert run.exact and run.tokens_equal, f"{name} {dtype} {run.prompt}: {run.max_abs_diff:.3g}"
    assert paged.pagedexperts.stats().total().misses > 0


@pytest.mark.default_threads
@pytest.mark.parametrize("name, why", [
    ("qwen3_moe-named_attention_first", "non-expert modules quantized"),
    ("qwen3_moe-fp8_static_channel", "non-expert modules quantized"),
    ("qwen3_moe-mxfp8", "non-expert modules quantized"),
    ("qwen3_moe-target_in_two_groups", "expert projections are in different config groups (gate_up_proj 4-bit "
                                       "group_size 32, down_proj 4-bit group_size 16)"),
])
def test_check_passes_against_compressed_tensors_and_says_why_not_transformers(name, why, capsys):
    """Attention quantized (transformers runs it through compressed-tensors' forward: static FP8
    input activations, MXFP8 scales it cannot load, and it would apply the attention group to
    the experts), or down_proj in the later of two groups listing it (transformers applies one
    group to every expert projection): ``check`` says why transformers is not the reference, with
    no traceback, and PASSes in the checkpoint's bfloat16 against compressed-tensors'
    decompression, each module in the group compressed-tensors itself gives it."""
    from pagedexperts.cli import main

    rc = main(["check", "--model-path", str(DATA / name), "--check-resident", str(TOP_K), "--max-new-tokens", "3",
               "--experts-implementation", "grouped_mm"])  # the reference's choice; packed's verdicts: test_packed_bound
    out = capsys.readouterr()
    assert rc == 0 and "verdict: PASS: paging is exact on this checkpoint (against compressed-tensors)" in out.out, out.out
    assert why in out.out and "Traceback" not in out.out + out.err
