"""Checkpoints written by AutoRound 0.16.1 and GPTQModel 7.7.0 themselves, on CPU, with their
default recipes (attention quantized) and experts-only variants (tests/data/autoround,
tests/data/gptqmodel; ``scripts/tool_fixtures.py`` writes them in the tools' own venvs): int
2/4/8 bits (GPTQ 2-bit asymmetric v1, whose zero points borrow across a word; AutoRound's
``auto_round`` packing with asymmetric zero points), overlapping GPTQModel ``dynamic`` rules,
bfloat16 scales, AutoRound's FP8 / NVFP4 / MXFP4 exports and GPTQModel's FP8.

Oracle, independent of pagedexperts: ``tool_dequant.safetensors`` beside each checkpoint, the
tool's OWN dequantization (GPTQModel's ``TorchLinear.dequantize_weight`` / ``dequantize_gemm`` /
``TorchFP8Linear.dequantize_weight``, AutoRound's ``QuantLinear.forward`` and its NVFP4 / MXFP4 /
FP8 layers) of layer 1's experts 0 and 5, its q_proj / o_proj and every module whose v1 zero
points borrowed, for a model in float32 and in the checkpoint's dtype (``scripts/tool_dequant.py``),
compared with the format given the checkpoint's tensors and with the loaded store's rows. Paged vs
resident: torch.equal of every prefill and decode logit, batch 1 and a padded batch of 2, at
K = top_k and E/2, in float32 and in the checkpoint's dtype.

Legend: E routed experts (8), k top_k (2), K resident slots.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pagedexperts import load_model
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.base import store_name
from pagedexperts.loading.checkpoint import format_for_checkpoint
from support.quantized_dirs import prefill_decode_runs
from support import paths

DATA = paths.DATA
E, TOP_K = paths.FIXTURE_E, paths.FIXTURE_TOP_K
FIXTURES = sorted(str(p.parent.relative_to(DATA)) for tool in ("autoround", "gptqmodel")
                  for p in (DATA / tool).glob("*/config.json"))
WITH_ORACLE = [n for n in FIXTURES if (DATA / n / "tool_dequant.safetensors").exists()]
# What the tools write that is still refused, and the field and value each refusal names.
REFUSED = {
    "autoround/qwen3_moe-auto_round-asym_g16-experts": "packing_format='auto_round:auto_awq'",
}
# GPTQModel 7.7 saves Mixtral's experts as mlp.experts.{j}.gate_proj/up_proj/down_proj (transformers
# 5.24's Mixtral conversion reads only w1/w3/w2): the key map reads both (loading.checkpoint).
LOADED = [n for n in FIXTURES if n not in REFUSED]
DENSE_OF = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "w1": ("gate_up_proj", 0),
            "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}


def _tensors(path: Path, module: str) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k.rpartition(".")[2]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == module}


def _bound(path: Path):
    """config.json and the format as the loader binds it (the scales' dtypes from the headers)."""
    cfg = json.loads((path / "config.json").read_text())
    return cfg, format_for_checkpoint(cfg, [path / "model.safetensors"])


def _expert_weight(path: Path, fmt, module: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    """One expert projection [O, I] as the paged store dequantizes it: its dense tensor's layout
    (gate and up merged as the loader merges them), then its own rows."""
    prefix, _, proj = module.rpartition(".")
    dense, index = DENSE_OF[proj]
    names = [n for n, (d, _) in DENSE_OF.items() if d == dense and (n.startswith("w") == proj.startswith("w"))]
    parts = [_tensors(path, f"{prefix}.{n}") for n in sorted(names, key=lambda n: DENSE_OF[n][1])]
    out_features, in_features = shape
    spec = TensorSpec(dense, (len(parts) * out_features, in_features), dtype)
    layout = fmt.layout((spec,), sources={dense: len(parts)})
    local = {store_name(dense, "weight", n): n for n in fmt.serialized_names["weight"]}
    rows = {p.name: torch.cat([t[local[p.name]] for t in parts], dim=p.concat_dim).unsqueeze(0)
            for p in layout.packed_specs}
    weight = layout.dequantize(rows)[dense][0]
    return weight[index * out_features:(index + 1) * out_features]


@pytest.mark.parametrize("name", WITH_ORACLE)
def test_dequantize_equals_the_tools_own(name):
    """Every sampled module, in float32 and in the checkpoint's dtype, bit-identical to the
    tool's own dequantization (experts through the paged layout, attention through
    ``linear_format``)."""
    path = DATA / name
    cfg, fmt = _bound(path)
    oracle = load_file(str(path / "tool_dequant.safetensors"))
    assert oracle
    for key, want in oracle.items():
        module, _, dtype_name = key.partition("@")
        dtype = getattr(torch, dtype_name)
        if ".experts." in module:
            got = _expert_weight(path, fmt, module, dtype, tuple(want.shape))
        else:
            linear = fmt.linear_format(module, cfg["quantization_config"])
            tensors = _tensors(path, module)
            got = linear.dequantize_linear(linear.linear_tensor(tuple(want.shape), dtype), tensors)
        assert got.dtype == want.dtype and torch.equal(got, want), (
            f"{key}: max |diff| {(got.double() - want.double()).abs().max():.3g}")


@pytest.mark.parametrize("name", WITH_ORACLE)
def test_loaded_experts_equal_the_tools_own(name):
    """The loader's whole path (the format bound to the scale dtypes the headers say, the store
    filled from the shards, the store's rows dequantized) gives every sampled expert projection
    of the tool's oracle bit for bit, in float32 and in the checkpoint's dtype: a binding that
    ignored the stored dtypes (bfloat16 scales read as float16) passes a test that hands the
    format the checkpoint's own tensors, not this one."""
    oracle = load_file(str(DATA / name / "tool_dequant.safetensors"))
    for dtype in sorted({k.partition("@")[2] for k in oracle}):
        model, _ = load_model(DATA / name, num_resident=TOP_K, dtype=dtype, check_independence=False,
                              experts_implementation="grouped_mm")  # dequantizes the store's rows
        rt = model.pagedexperts
        checked = 0
        for key, want in oracle.items():
            module, _, key_dtype = key.partition("@")
            if key_dtype != dtype or ".experts." not in module:
                continue
            prefix, _, proj = module.rpartition(".")
            site = next(s for s in rt.stores if f".layers.{module.split('.')[2]}." in s)
            store = rt.stores[site]
            dense, index = DENSE_OF[proj]
            got = rt.layouts[site].dequantize({s.name: store.tensors[s.name] for s in store.specs})[dense]
            got = got[int(prefix.rpartition(".")[2])].split(want.shape[0])[index]
            assert got.dtype == want.dtype and torch.equal(got, want), (
                f"{key}: max |diff| {(got.double() - want.double()).abs().max():.3g}")
            checked += 1
        assert checked >= 6, (name, dtype, checked)


def _saved_dtype(name: str) -> torch.dtype:
    cfg = json.loads((DATA / name / "config.json").read_text())
    return getattr(torch, cfg.get("dtype") or "float32")


@pytest.mark.default_threads
@pytest.mark.parametrize("name", LOADED)
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "saved"])  # users run the saved dtype
@pytest.mark.parametrize("impl", ["default", "grouped_mm"])
def test_paged_equals_resident(name, dtype, impl):
    """Paged at K = top_k and E/2 == all E experts resident with the same experts implementation,
    in float32 and in the checkpoint's own dtype: as users load it (the default, auto: packed on
    a CPU for the int formats, against the same kernels at K = E), and with grouped_mm (against
    the resident model, every expert dequantized once by the same format)."""
    run_dtype = str(_saved_dtype(name)).removeprefix("torch.") if dtype == "saved" else dtype
    options = {} if impl == "default" else {"experts_implementation": impl}
    if impl == "default":
        resident, _ = load_model(DATA / name, num_resident=E, dtype=run_dtype, check_independence=False)
    else:
        resident, _ = load_model(DATA / name, mode="resident", dtype=run_dtype, check_independence=False, **options)
    for k in (TOP_K, E // 2):
        paged, _ = load_model(DATA / name, num_resident=k, dtype=run_dtype, **options)
        with torch.no_grad():
            for run in prefill_decode_runs(paged, resident):
                assert run.exact and run.tokens_equal, f"{name} {run_dtype} K={k} {run.prompt}: {run.max_abs_diff:.3g}"
        assert paged.pagedexperts.stats().total().misses > 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_tool_outputs_still_refused_name_the_field_and_value(name):
    path = DATA / name
    if not (path / "config.json").exists():
        pytest.skip(f"{path} not written: run scripts/tool_fixtures.py")
    with pytest.raises(ValueError, match=re.escape(REFUSED[name])):
        format_for_config(json.loads((path / "config.json").read_text()))


def test_fixtures_are_the_tools_default_recipes():
    """The whole-model fixtures quantize attention (every tool's default), the experts-only ones
    do not, and each records the tool and version that wrote it."""
    for name in FIXTURES:
        path = DATA / name
        record = json.loads((path / "tool_quantize.json").read_text())
        tool = "auto-round" if name.startswith("autoround") else "gptqmodel"
        assert tool in record["versions"], record
        attention = _tensors(path, "model.layers.0.self_attn.q_proj")
        quantized = bool(set(attention) - {"weight", "bias"})  # FP8 keeps a float8 ``weight`` beside its scale
        assert quantized != ("-experts" in name), (name, sorted(attention))


@pytest.mark.parametrize("group_size, in_features", [(128, 32), (128, 64), (48, 64)])
def test_a_group_larger_than_the_row_is_one_group_in_preflight_and_load(group_size, in_features):
    """GPTQ g128 on a 32-wide row: the tools write ONE group (g_idx all 0); a partial last group
    (64 wide, g48: two groups). The binding that preflight uses packs it as load does."""
    cfg = {"model_type": "qwen3_moe", "hidden_size": in_features, "moe_intermediate_size": in_features,
           "num_hidden_layers": 1, "num_experts": E,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group_size}}
    fmt = format_for_config(cfg)
    specs = {s.name: s for s in fmt.pack(TensorSpec("down_proj", (64, in_features), torch.float16), sources=1,
                                         transposed=False)}
    assert specs["down_proj_scales"].shape == (-(-in_features // group_size), 64)


def test_dynamic_override_binds_down_proj_and_refuses_per_layer_differences():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32,
          "dynamic": {r"+:.*\.down_proj": {"group_size": 16, "bits": 8}, r"-:.*self_attn\.k_proj": {}}}
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_experts": E, "quantization_config": qc}
    fmt = format_for_config(cfg)
    assert fmt.tensor_args("down_proj").group_size == 16 and fmt.tensor_args("down_proj").bits == 8
    assert fmt.tensor_args("gate_up_proj").group_size == 32
    assert fmt.linear_format("model.layers.0.self_attn.k_proj", qc) is None
    assert fmt.linear_format("model.layers.0.self_attn.q_proj", qc).tensor_args("weight").group_size == 32
    qc["dynamic"] = {r"+:model\.layers\.1\..*": {"bits": 8}}
    with pytest.raises(ValueError, match=r"gptq dynamic: per-module rules give .*layers\.0.* but .*layers\.1"):
        format_for_config(cfg)
    qc["dynamic"] = {r"-:.*experts\.7\..*": {}}
    with pytest.raises(ValueError, match=r"experts\.7\.gate_proj is left unquantized"):
        format_for_config(cfg)


def _module_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, _, local = key.rpartition(".")
            out.setdefault(module, {})[local] = f.get_tensor(key)
    return out


def test_two_bit_v1_oracle_covers_zero_points_that_borrowed():
    """GPTQModel's 2-bit asymmetric v1 save stores z - 1 per WORD: a zero point 0 takes 1 from the
    next value of its word. The oracle (GPTQModel's own v1 -> v2 conversion) samples such modules,
    so a per-value + 1 fails test_dequantize_equals_the_tools_own; checked here on the stored
    words themselves: adding 1 to each 2-bit field alone differs from the word's + 0x55555555."""
    path = DATA / "gptqmodel/qwen3_moe-gptq_2bit_asym_g16-experts"
    assert json.loads((path / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq"
    sampled = {key.partition("@")[0] for key in load_file(str(path / "tool_dequant.safetensors"))}
    shifts = torch.arange(0, 32, 2)
    borrowed = []
    for module, t in _module_tensors(path).items():
        words = t["qzeros"].long() & 0xFFFFFFFF if "qzeros" in t else None
        if words is not None:
            per_word = (((words + 0x55555555) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 3
            per_value = (((words.unsqueeze(-1) >> shifts) & 3) + 1) & 3
            if not torch.equal(per_word, per_value):
                borrowed.append(module)
    assert borrowed and set(borrowed) <= sampled, (borrowed, sorted(sampled))


def test_overlapping_dynamic_rules_bind_every_module_as_its_tensors_say():
    """GPTQModel applies the FIRST ``dynamic`` rule that matches (a negative ``-:`` k_proj rule
    before a q/k rule; the experts' down_proj g16 before a catch-all 8-bit rule): every module's
    binding, experts and attention, equals what the checkpoint's own tensors say (bits from
    qweight rows per input column, groups from scale rows; a plain weight: unquantized)."""
    path = DATA / "gptqmodel/qwen3_moe-gptq_dynamic_overlap"
    cfg, fmt = _bound(path)
    qc = cfg["quantization_config"]
    seen = set()
    for module, t in _module_tensors(path).items():
        if not module.startswith("model.layers.") or "norm" in module or module.endswith("mlp.gate"):
            continue
        if ".experts." in module:
            args = fmt.tensor_args(DENSE_OF[module.rpartition(".")[2]][0])
        else:
            linear = fmt.linear_format(module, qc)
            args = None if linear is None else linear.tensor_args("weight")
        if "qweight" not in t:
            assert args is None, (module, args)
            seen.add((module.rpartition(".")[2], None))
            continue
        in_features = t["g_idx"].numel()
        want = (t["qweight"].shape[0] * 32 // in_features, t["scales"].shape[0])
        assert args is not None and (args.bits, args.groups(in_features)) == want, (module, args, want)
        seen.add((module.rpartition(".")[2], want))
    # the overlaps the fixture exists for: k_proj left out, q_proj g16, down_proj 4-bit g16 before the 8-bit rule
    assert {("k_proj", None), ("q_proj", (4, 2)), ("down_proj", (4, 2)), ("gate_proj", (8, 1))} <= seen, seen


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"}, "packing_format=None"),
    ({"quant_method": "auto-round", "bits": 8, "data_type": "fp", "group_size": 0, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "auto-round", "bits": 8, "data_type": "fp", "group_size": 64}, "group_size=64"),
    ({"quant_method": "auto-round", "bits": 4, "data_type": "mx_int"}, "data_type='mx_int'"),
    # GPTQModel's block / tensor FP8 divide by weight_scale_inv too: not read as DeepSeek's block FP8
    ({"quant_method": "fp8", "weight_scale_method": "block", "weight_block_size": [128, 128],
      "weight_scale_semantics": "inverse"}, "weight_scale_method='block'"),
    ({"quant_method": "fp8", "weight_scale_method": "tensor", "weight_scale_semantics": "inverse"},
     "weight_scale_method='tensor'"),
    ({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:awq"}, "packing_format='auto_round:awq'"),
    ({"quant_method": "auto-round", "bits": 8, "act_bits": 8}, "act_bits=8"),
    ({"quant_method": "gptq", "bits": 3}, "bits=3"),
])
def test_remaining_refusals_name_the_field_and_value(qc, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        format_for_config({"quantization_config": qc})


PACKED_VERDICT = "verdict: PASS (paged packed == packed all resident; packed matmuls within their bound of float32)"


@pytest.mark.default_threads
@pytest.mark.parametrize("name", [
    "autoround/qwen3_moe-auto_round", "autoround/qwen3_moe-auto_gptq",
    "autoround/qwen3_moe-auto_round-NVFP4-experts", "gptqmodel/qwen3_moe-fp8-experts",
    *(pytest.param(f"autoround/qwen3_moe-auto_round-{n}-experts", marks=pytest.mark.slow)
      for n in ("MXFP4", "FP8_STATIC", "FP8_BLOCK", "FPW8A16")),
])
def test_check_passes_in_the_checkpoints_own_dtype(name, capsys):
    """``check`` at the dtype the tool wrote (AutoRound: bfloat16 for auto_round and its FP
    exports, float16 for auto_gptq; GPTQModel FP8 bfloat16): transformers cannot load these here
    (auto-round / gptqmodel absent), so the reference is the resident model (its experts
    dequantized as test_dequantize_equals_the_tools_own checks against the tool's own). With the
    default options the int exports run packed (both of check's packed verdicts pass), the FP ones
    grouped_mm (paging exact against the reference)."""
    from pagedexperts.cli import main

    rc = main(["check", "--model-path", str(DATA / name), "--check-resident", str(TOP_K), "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    int_export = name == "autoround/qwen3_moe-auto_round"  # bfloat16; auto_gptq is float16: auto runs grouped_mm
    want = PACKED_VERDICT if int_export else "verdict: PASS: paging is exact on this checkpoint (against pagedexperts resident)"
    assert rc == 0 and want in out, out


@pytest.mark.default_threads
def test_check_llm_compressor_export_float16_scales_under_bfloat16(capsys):
    """AutoRound's llm_compressor export stores the experts' scales in float16 under a bfloat16
    config: the library reference keeps those experts in float16 (not rounded through bfloat16:
    that FAILed by 0.0078), and paging is exact against it."""
    from pagedexperts.cli import main

    name = "autoround/qwen3_moe-llm_compressor"
    rc = main(["check", "--model-path", str(DATA / name), "--check-resident", str(TOP_K), "--max-new-tokens", "3",
               "--experts-implementation", "grouped_mm"])  # the library reference's dtypes: grouped_mm's exactness
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: PASS: paging is exact on this checkpoint (against compressed-tensors)" in out, out
