"""Whole-model int4 on a CPU: quantized non-expert linears computed packed (``loading.linears``).

Checkpoints: ours (the bundled trained model with lm_head untied, ``quantize --format w4a16
--group-size 64 --scope model``: attention int4, lm_head int8 per channel) and the tool-written
whole-model exports that load today (GPTQModel GPTQ, AutoRound's own int4, llm-compressor W4A16 /
W8A16: tests/data). Under ``--experts-implementation packed`` every linear torch's CPU kernels
take runs as a ``PackedLinear``: paged (K < E) == every expert resident (K = E) with the same
packed linears, torch.equal, bfloat16 and float32, batch 1 and 3, prefill and decode, default
threads. A module the kernels cannot take is dequantized, its reason named once per reason (a
WARNING and the stats' fallbacks); the memory plans count kernel bytes for the packed ones, and
the default (grouped_mm) keeps transformers' dequantized modules.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pagedexperts import load_model
from pagedexperts.loading.packed_linears import PackedLinear
from support import bundled
from support.paths import DATA
from support.tiny import greedy_logits

pytest.importorskip("compressed_tensors")

WHOLE = {  # name -> (directory under tests/data, or None: ours; its quantized non-expert modules)
    "ours": (None, 4 * bundled.LAYERS + 1),  # q, k, v, o of each layer, lm_head
    "gptqmodel-gptq": ("gptqmodel/qwen3_moe-gptq", 8),
    "autoround-int4": ("autoround/qwen3_moe-auto_round", 8),
    "llmc-w4a16": ("llmc_whole/qwen3_moe-W4A16-g32", 8),
}


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint

    root = tmp_path_factory.mktemp("ours")
    out = root / "q"
    quantize_checkpoint(model_path=bundled.untied_copy(root / "src"), output=out,
                        options=QuantizeOptions("w4a16", group_size=bundled.MOE_INTERMEDIATE, scope="model"))
    return out


def _path(name: str, ours: Path) -> Path:
    return ours if WHOLE[name][0] is None else DATA / WHOLE[name][0]


def _load(path, k, dtype: str, implementation: str = "packed"):
    model, _ = load_model(path, num_resident=k, dtype=dtype, experts_implementation=implementation)
    return model.eval()


def _packed_linears(model) -> dict[str, PackedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}


def _ids(batch: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, min(vocab, 200), (batch, 7), generator=torch.Generator().manual_seed(batch))


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_paged_equals_all_resident_with_packed_linears(name, dtype, ours):
    path, modules = _path(name, ours), WHOLE[name][1]
    probe = _load(path, None, dtype)
    num_experts, top_k = probe.pagedexperts.num_experts, probe.pagedexperts.top_k
    oracle, paged = _load(path, num_experts, dtype), _load(path, top_k + 1, dtype)
    for model in (oracle, paged):
        linears = model.pagedexperts.quantized_linears
        assert len(_packed_linears(model)) == len(linears.packed) == modules and linears.modules == ()
        assert model.pagedexperts.stats().fallbacks == []
    if name == "ours":
        assert paged.lm_head.kind == "int8" and paged.model.layers[0].self_attn.q_proj.kind == "int4"
    vocab = paged.config.vocab_size
    for batch in (1, 3):  # prefill, then 4 decode steps
        want, got = greedy_logits(oracle, _ids(batch, vocab), steps=4), greedy_logits(paged, _ids(batch, vocab), steps=4)
        diff = (want.float() - got.float()).abs()
        assert torch.equal(want, got), f"{name} {dtype} batch {batch}: max diff {diff.max():.3g}, mean {diff.mean():.3g}"
    assert sum(s.misses for s in paged.pagedexperts.stats().layers.values()) > num_experts  # evictions happened


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_is_its_kernel_and_close_to_the_dequantized_weight(dtype, ours):
    """Each loaded PackedLinear (int4 attention, int8 lm_head) is torch's kernel on its own buffers
    (torch.equal, any leading shape), within the kernel's rounding of x @ W^T with W
    compressed-tensors' decompression (the grouped_mm load's dense weight)."""
    run = str(dtype).removeprefix("torch.")
    packed, dense = _load(ours, bundled.TOP_K, run), _load(ours, bundled.TOP_K, run, "grouped_mm")
    x = torch.randn(3, 5, bundled.HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    for name in ("model.layers.2.self_attn.v_proj", "lm_head"):
        module = packed.get_submodule(name)
        flat = x.reshape(-1, bundled.HIDDEN)
        if module.kind == "int4":
            kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, module.weight_packed, module.group_size,
                                                                module.scales)
        else:
            kernel = torch.ops.aten._weight_int8pack_mm(flat, module.weight_packed, module.scales)
        got = module(x)
        assert torch.equal(got, kernel.reshape(3, 5, -1)), name
        want = x.double() @ dense.get_submodule(name).weight.double().t()
        bound = (1e-5 if dtype == torch.float32 else 2e-2) * want.abs().max()
        assert (got.double() - want).abs().max() <= bound, name


def test_grouped_mm_keeps_the_dequantized_modules(ours):
    """A user who asks for transformers-exact output (grouped_mm, the default) gets nn.Linear
    modules holding the dequantized weights, as before."""
    model = _load(ours, bundled.TOP_K, "bfloat16", "grouped_mm")
    assert _packed_linears(model) == {} and len(model.pagedexperts.quantized_linears.modules) == WHOLE["ours"][1]
    assert type(model.lm_head) is torch.nn.Linear


def test_a_module_the_kernels_cannot_take_is_dequantized_and_named_once_per_reason(caplog):
    """llm-compressor W8A16 group 16: torch's int8 kernel takes one scale per row, so every
    attention projection is dequantized (equal to the grouped_mm load's weight): one WARNING
    names the reason and the 8 modules, the stats' fallbacks say it too."""
    path = DATA / "llmc_whole/qwen3_moe-W8A16-g16"
    with caplog.at_level(logging.WARNING, logger="pagedexperts.loading.fill"):
        model = _load(path, 4, "bfloat16")
    lines = [r.getMessage() for r in caplog.records if "non-expert linears" in r.getMessage()]
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert len(lines) == 1 and "group-wise int8" in lines[0] and all(n in lines[0] for n in names), lines
    linears = model.pagedexperts.quantized_linears
    assert linears.packed == () and sorted(linears.modules) == sorted(n + ".weight" for n in names)
    assert any("group-wise int8" in f and "8 modules" in f for f in model.pagedexperts.stats().fallbacks)
    dense = _load(path, 4, "bfloat16", "grouped_mm")
    for n in names:
        assert type(model.get_submodule(n)) is torch.nn.Linear
        assert torch.equal(model.get_submodule(n).weight, dense.get_submodule(n).weight), n


def test_memory_plans_count_kernel_bytes_for_packed_linears(ours, capsys):
    """The host-memory plan's non-expert bytes are what the loaded model holds outside the
    experts (parameters, and each PackedLinear's packed weight and scales), and preflight
    --experts-implementation packed counts the same modules at the same bytes."""
    from pagedexperts.cli import main

    for implementation in ("packed", "grouped_mm"):
        model = _load(ours, bundled.TOP_K, "bfloat16", implementation)
        rt = model.pagedexperts
        held = sum(p.nbytes for p in model.parameters()) + sum(
            m.weight_packed.nbytes + m.scales.nbytes for m in _packed_linears(model).values())
        assert rt.host_memory.non_expert_bytes_on_host == held, implementation
        assert main(["preflight", "--model-path", str(ours), "--num-resident", str(bundled.TOP_K), "--dtype", "bfloat16",
                     "--experts-implementation", implementation, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        linears = rt.quantized_linears
        assert (report["packed_linear_modules"], report["packed_linear_bytes"]) == (len(linears.packed), linears.kernel_bytes)
        assert (report["dequantized_modules"], report["dequantized_bytes"]) == (len(linears.modules), linears.dense_bytes)
    assert linears.kernel_bytes == 0 and report["packed_linear_modules"] == 0  # grouped_mm: all dequantized


def _qwen2_gptq(tmp_path: Path, *, desc_act: bool) -> Path:
    """Qwen2-MoE (q/k/v biases, a dense MLP layer, a shared expert) stored GPTQ int4 group 32
    symmetric where the shapes allow (a shared down_proj of 48 columns and the shared-expert gate
    [1, H] stay plain); ``desc_act``: act-order g_idx."""
    from safetensors.torch import load_file

    from support.families import build_model, save_char_tokenizer
    from support.int4_oracle import pack_gptq, rtn_int4
    from support.quantized_dirs import write_checkpoint_dir

    src = tmp_path / "src"
    build_model("qwen2_moe").save_pretrained(src)
    save_char_tokenizer(src)
    gen, packed = torch.Generator().manual_seed(1), {}
    for key, value in load_file(src / "model.safetensors").items():
        if not key.endswith("_proj.weight") or value.shape[1] % 32:
            packed[key] = value
            continue
        parts = pack_gptq(rtn_int4(value, 32, desc_act=desc_act, generator=gen, symmetric=not desc_act))
        packed.update({f"{key.removesuffix('.weight')}.{n}": t for n, t in parts.items()})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": not desc_act,
          "checkpoint_format": "gptq"}
    return write_checkpoint_dir(src, tmp_path / "q", packed, qc)


@pytest.mark.default_threads
def test_biases_and_dense_layers_ride_along(tmp_path):
    """A packed q_proj carries its bias: it computes x @ W^T + b (W the dequantized weight, within
    the kernel's float32 rounding of the float16 products); the dense MLP layer and the shared
    expert run packed; paged == every expert resident."""
    from support.families import E, TOP_K

    path = _qwen2_gptq(tmp_path, desc_act=False)
    oracle, paged = _load(path, E, "float32"), _load(path, TOP_K + 1, "float32")
    dense = _load(path, E, "float32", "grouped_mm")
    q_proj = paged.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, PackedLinear) and q_proj.bias is not None
    assert isinstance(paged.model.layers[1].mlp.down_proj, PackedLinear)  # the dense MLP layer
    assert isinstance(paged.model.layers[0].mlp.shared_expert.up_proj, PackedLinear)
    assert type(paged.model.layers[0].mlp.shared_expert.down_proj) is torch.nn.Linear  # stored plain
    x = torch.randn(5, q_proj.in_features, generator=torch.Generator().manual_seed(2))
    reference = dense.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        want = torch.nn.functional.linear(x.double(), reference.weight.double(), reference.bias.double())
        assert (q_proj(x).double() - want).abs().max() <= 1e-3 * want.abs().max()
    ids = _ids(3, paged.config.vocab_size)
    want, got = greedy_logits(oracle, ids, steps=4), greedy_logits(paged, ids, steps=4)
    assert torch.equal(want, got), (want - got).abs().max()


def test_act_order_falls_back_with_its_biases(tmp_path):
    """Act-order GPTQ: no linear runs packed (g_idx: the int4 kernel's groups are consecutive
    columns); every one is dequantized with its bias, and the model equals the grouped_mm load."""
    from support.families import E

    path = _qwen2_gptq(tmp_path, desc_act=True)
    packed, dense = _load(path, E, "float32"), _load(path, E, "float32", "grouped_mm")
    linears = packed.pagedexperts.quantized_linears
    assert linears.packed == () and len(linears.modules) == len(dense.pagedexperts.quantized_linears.modules)
    assert {why for _, why in linears.fallbacks} == {"gptq weight: activation order (g_idx): the int4 kernel takes "
                                                     "groups of consecutive input columns"}
    ids = _ids(3, packed.config.vocab_size)
    assert torch.equal(greedy_logits(packed, ids, steps=3), greedy_logits(dense, ids, steps=3))
