"""Every supported MoE family, paged vs unpaged, on tiny random checkpoints (issue 7).

Each family gets a seeded random model (hidden 32, E=8 routed experts, top_k=2, vocab 128,
expert intermediate 64) saved with ``save_pretrained`` in the layout that family's hub
checkpoints use (Mixtral: per-expert ``block_sparse_moe.experts.{j}.w1/w2/w3``; gpt-oss:
stacked ``gate_up_proj`` [E, H, 2I] with biases; the others per-expert gate/up/down), plus a
character-level tokenizer. The oracle is the same directory loaded by plain
``AutoModelForCausalLM.from_pretrained`` with the same experts implementation and dtype:
prefill and 16 greedy decode steps must give torch.equal logits at K = top_k and K = E/2.

The expert intermediate size is a multiple of 64 as in real models; one gpt-oss case uses 40
(CPU element-wise kernels run a vectorised body and a scalar tail whose results differ in the
last bit: the pager runs the activation on a buffer of the unpaged shape and row order, so the
tail falls on the same elements). Exactness tests run at the default thread count (and the
main one at 1 thread too, ``threads``), as users run.

Legend: E routed experts, k top_k, K resident slots, H hidden, I expert intermediate.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from support.tiny import assert_same, assert_same_attributes
from pagedexperts import load_model
from pagedexperts.integration import RUNNER_ATTR
from pagedexperts.models.sites import SUPPORTED_ARCHITECTURES, find_experts_sites, is_experts_module
from pagedexperts.models.config import moe_layer_indices
from pagedexperts.models.families import FAMILIES
from pagedexperts.paging.kernels import HAVE_TRITON
from support.families import CASES, DTYPES, E, EXPERT_I, HIDDEN, PROMPTS, TOP_K, assert_exact, build_model, save_char_tokenizer


def families_quick(quick: list[str]) -> list:
    """Every family, those outside ``quick`` marked slow (the quick run keeps the suite under
    10 minutes; CI runs the slow ones too)."""
    return [n if n in quick else pytest.param(n, marks=pytest.mark.slow) for n in CASES]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """name -> checkpoint directory, built on first use (save_pretrained + tokenizer)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"tiny_{name}")
            build_model(name).save_pretrained(path)
            save_char_tokenizer(path)
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="session")
def references(reference_model):
    """(path, dtype, implementation) -> the unpaged model, loaded once per session (conftest)."""
    return lambda path, dtype, impl="grouped_mm": reference_model(path, dtype, impl)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_paged_equals_unpaged_at_k_and_half_e(name, dtype, family_dirs, references, threads):
    path = family_dirs(name)
    reference = references(path, dtype)
    for k in (TOP_K, E // 2):
        paged, tokenizer = load_model(path, num_resident=k, dtype=dtype)
        assert sorted(paged.pagedexperts.runners) == CASES[name].moe_layers
        assert_exact(paged, reference, tokenizer, f"{name} {dtype} K={k}")


# The routing weights' dtype and the layout quirks meet the other implementations here: fp32
# router weights on a bf16 model (Mixtral, DeepSeek), eager's own row order and combine, and
# gpt-oss's biases, transposed layout and clamped SwiGLU under every implementation.
@pytest.mark.parametrize(
    "name,dtype",
    [("gpt_oss", "float32"), ("gpt_oss", "bfloat16"), ("mixtral", "bfloat16"), ("deepseek_v3", "bfloat16")],
)
@pytest.mark.parametrize("impl", ["batched_mm", "eager"])
@pytest.mark.default_threads
def test_other_experts_implementations(name, dtype, impl, family_dirs, references):
    path = family_dirs(name)
    paged, tokenizer = load_model(path, num_resident=TOP_K, dtype=dtype, experts_implementation=impl)
    assert_exact(paged, references(path, dtype, impl), tokenizer, f"{name} {dtype} {impl} K={TOP_K}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_attributes_match_from_pretrained(name, dtype, family_dirs, references):
    """requires_grad, dtype (fp32-kept modules too), contiguity and device of every parameter and
    buffer, one by one, as from_pretrained gives them (requires_grad changes a CPU matmul path)."""
    path = family_dirs(name)
    paged, _ = load_model(path, num_resident=TOP_K, dtype=dtype)
    assert_same_attributes(paged, references(path, dtype), f"{name} {dtype}")


@pytest.mark.parametrize("name", families_quick(["qwen3_moe", "gpt_oss"]))
@pytest.mark.default_threads
def test_prefetch_is_exact_in_every_family(name, family_dirs, references):
    """--prefetch finds each family's router (gpt-oss: mlp.router) and changes no bit."""
    path = family_dirs(name)
    paged, tokenizer = load_model(path, num_resident=TOP_K, dtype="float32", prefetch=True)
    assert_exact(paged, references(path, "float32"), tokenizer, f"{name} prefetch K={TOP_K}")
    issued = sum(p.prefetch_stats.issued for p in paged.pagedexperts.runners.values())
    assert issued > 0, f"{name}: prefetch issued nothing; the router was not used"


@pytest.mark.parametrize("name", families_quick(["qwen3_moe", "gpt_oss"]))
@pytest.mark.default_threads
def test_device_planned_step_is_exact_in_every_family(name, family_dirs, references):
    """--decide device (the torch reference kernels: the interpreter is slow for 16 steps x 8
    families) at K = top_k and E/2, bf16: logits torch.equal to the unpaged model."""
    from pagedexperts.paging.device_executor import DeviceExecutor

    path = family_dirs(name)
    for k in (TOP_K, E // 2):
        paged, tokenizer = load_model(path, num_resident=k, dtype="bfloat16", decide="device", device_kernels="torch")
        assert all(isinstance(r, DeviceExecutor) for r in paged.pagedexperts.runners.values())
        assert_exact(paged, references(path, "bfloat16"), tokenizer, f"{name} device-planned K={k}")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
@pytest.mark.slow  # the Triton device kernels in generate: tests/paging/test_device_runtime.py (quick)
@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
@pytest.mark.default_threads
def test_device_planned_step_with_triton_kernels(name, family_dirs, references):
    """The Triton kernels (interpreted on CPU) in a family with expert biases (gpt-oss) and one
    with shared experts and a correction bias (DeepSeek-V3), batch 1 and 2, K = top_k, 4 greedy
    steps (the interpreter is slow)."""
    path = family_dirs(name)
    paged, tokenizer = load_model(path, num_resident=TOP_K, dtype="float32", decide="device")
    assert next(iter(paged.pagedexperts.runners.values())).residency.backend == "triton"
    assert_exact(paged, references(path, "float32"), tokenizer, f"{name} device-planned (triton) K={TOP_K}", steps=4)


@pytest.fixture(scope="session")
def gpt_oss_odd_dir(tmp_path_factory):
    """gpt-oss with expert intermediate 40: rows x I is not a multiple of any vector width."""
    path = tmp_path_factory.mktemp("tiny_gpt_oss_odd")
    build_model("gpt_oss", intermediate_size=40).save_pretrained(path)
    save_char_tokenizer(path)
    return path


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.default_threads
def test_odd_intermediate_size_stays_exact(gpt_oss_odd_dir, references, impl):
    """gpt-oss's clamped SwiGLU runs its sigmoid over a contiguous buffer: the last (rows x I
    mod vector width) elements take the scalar tail. The activation runs on a buffer of the
    unpaged shape and row order, so the tail falls on the same elements as unpaged."""
    paged, tokenizer = load_model(gpt_oss_odd_dir, num_resident=TOP_K, dtype="float32", experts_implementation=impl)
    assert_exact(paged, references(gpt_oss_odd_dir, "float32", impl), tokenizer, f"gpt-oss I=40 {impl}")
    assert paged.pagedexperts.stats().total().multi_wave_steps > 0


@pytest.mark.parametrize("name", list(CASES))
def test_store_holds_the_routed_experts_and_nothing_else(name, family_dirs, references):
    """Per-expert tensors come from the layer (every tensor with leading dim E, biases too);
    host rows equal the reference's experts; everything else is resident and equal."""
    path = family_dirs(name)
    reference = references(path, "float32")
    paged, _ = load_model(path, num_resident=TOP_K, dtype="float32")
    for layer, pager in paged.pagedexperts.runners.items():
        ref_experts = reference.model.layers[layer].mlp.experts
        expected = dict(ref_experts.named_parameters(recurse=False))
        assert sorted(pager.store.tensors) == sorted(expected), f"layer {layer}: per-expert tensors"
        for tname, host in pager.store.tensors.items():
            assert_same(host, expected[tname].detach(), f"layer {layer} store {tname!r}")
            assert pager.slots[tname].shape == (TOP_K, *host.shape[1:])
    ref_state = reference.state_dict()
    paged_state = paged.state_dict()
    routed = {n for n in ref_state if ".mlp.experts." in n}
    assert set(paged_state) == set(ref_state) - routed
    for tname, value in paged_state.items():
        assert_same(value, ref_state[tname], f"resident tensor {tname!r}")


def test_mixtral_per_expert_w1_w2_w3_keys_are_read(family_dirs, references):
    path = family_dirs("mixtral")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for j in range(E):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.0.block_sparse_moe.experts.{j}.{w}.weight" in keys
    assert not any(".mlp." in k for k in keys)
    paged, _ = load_model(path, num_resident=TOP_K, dtype="float32")
    ref_experts = references(path, "float32").model.layers[0].mlp.experts
    store = paged.pagedexperts.runners[0].store
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.5.w1.weight")
        w3 = f.get_tensor("model.layers.0.block_sparse_moe.experts.5.w3.weight")
    assert_same(store.tensors["gate_up_proj"][5], torch.cat([w1, w3]), "expert 5 gate_up = [w1; w3]")
    assert_same(store.tensors["down_proj"], ref_experts.down_proj.detach(), "down_proj from w2")


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.shared])
def test_shared_experts_are_resident_never_paged(name, family_dirs, references):
    path = family_dirs(name)
    case = CASES[name]
    paged, tokenizer = load_model(path, num_resident=TOP_K, dtype="float32")
    runtime = paged.pagedexperts
    routed_bytes = 3 * HIDDEN * EXPERT_I * 4  # gate, up, down of one routed expert, fp32
    for layer, pager in runtime.runners.items():
        block = paged.model.layers[layer].mlp
        shared = getattr(block, case.shared)
        assert not any(is_experts_module(m) for m in shared.modules())
        assert not any(hasattr(m, RUNNER_ATTR) for m in shared.modules())
        for pname, p in shared.named_parameters():
            assert p.device.type == "cpu" and p.dtype == torch.float32, pname
        assert pager.store.num_experts == E and pager.store.expert_bytes == routed_bytes
        assert all(s.shape[0] == TOP_K for s in pager.slots.values())
        assert {tuple(t.shape[1:]) for t in pager.store.tensors.values()} == {
            (2 * EXPERT_I, HIDDEN), (HIDDEN, EXPERT_I)
        }, "a shared-expert shape (intermediate != EXPERT_I) leaked into the store"
    assert_exact(paged, references(path, "float32"), tokenizer, f"{name} K={TOP_K}")
    stats = runtime.stats()
    assert sorted(stats.layers) == case.moe_layers
    for layer, st in stats.layers.items():
        assert st.union_max <= E and st.bytes_paged == st.page_ins * routed_bytes, f"layer {layer}"


@pytest.mark.parametrize("name", list(CASES))
def test_dense_layers_get_no_pager(name, family_dirs):
    path = family_dirs(name)
    config = json.loads((path / "config.json").read_text())
    assert moe_layer_indices(config) == CASES[name].moe_layers
    paged, _ = load_model(path, num_resident=TOP_K, dtype="float32")
    assert sorted(paged.pagedexperts.runners) == CASES[name].moe_layers
    for i, layer in enumerate(paged.model.layers):
        paged_modules = [m for m in layer.modules() if hasattr(m, RUNNER_ATTR)]
        assert len(paged_modules) == (i in CASES[name].moe_layers), f"layer {i}"
        if i not in CASES[name].moe_layers:
            assert not any(is_experts_module(m) for m in layer.modules())
            assert all(p.device.type != "meta" for p in layer.parameters())


def test_gpt_oss_biases_are_paged_with_their_expert(family_dirs, references):
    """A corrupted bias in a slot, or in the host row of a routed expert, changes the output:
    the biases are read from the slots and paged in from the store with their expert."""
    path = family_dirs("gpt_oss")
    token = torch.tensor([[42]])
    with torch.no_grad():
        expected = references(path, "float32")(token).logits
        paged, _ = load_model(path, num_resident=TOP_K, dtype="float32")
        pager = paged.pagedexperts.runners[0]
        assert {"gate_up_proj_bias", "down_proj_bias"} <= set(pager.store.tensors)
        assert_same(paged(token).logits, expected, "gpt-oss one token")
        hits_before = pager.stats.hits
        for tname in ("gate_up_proj_bias", "down_proj_bias"):
            original = pager.slots[tname][0].clone()
            pager.slots[tname][0] += 1.0  # both routed experts of the token are resident now
            corrupted = paged(token).logits
            pager.slots[tname][0].copy_(original)
            assert not torch.equal(corrupted, expected), f"slot {tname} is not used"
        assert pager.stats.hits > hits_before, "the corrupted slot was paged over, not reused"
        assert_same(paged(token).logits, expected, "restored slots")

        routed = _routed_experts(references(path, "float32"), token, layer=0)
        fresh, _ = load_model(path, num_resident=TOP_K, dtype="float32")  # nothing resident yet
        fresh.pagedexperts.runners[0].store.tensors["down_proj_bias"][routed[0]] += 1.0
        assert not torch.equal(fresh(token).logits, expected), "host bias row is not paged in"


def _routed_experts(model, input_ids, *, layer: int) -> list[int]:
    """Expert ids the router of ``layer`` picks for the last token of ``input_ids``."""
    seen = []
    experts = model.model.layers[layer].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[1][-1].tolist()))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        handle.remove()
    return seen[0]


@pytest.fixture(scope="session")
def deepseek_biased_dir(tmp_path_factory):
    """DeepSeek-V3 with a non-zero e_score_correction_bias that changes the expert selection."""
    model = build_model("deepseek_v3")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in CASES["deepseek_v3"].moe_layers:
            gate = model.model.layers[layer].mlp.gate
            gate.e_score_correction_bias.copy_(torch.rand(E, generator=gen) * 0.5)
    path = tmp_path_factory.mktemp("tiny_deepseek_v3_biased")
    model.save_pretrained(path)
    save_char_tokenizer(path)
    return path


def test_deepseek_correction_bias_changes_selection_and_stays_exact(deepseek_biased_dir, family_dirs, references):
    ids = torch.tensor([[ord(c) for c in PROMPTS[0]]])
    layer = CASES["deepseek_v3"].moe_layers[-1]
    plain = references(family_dirs("deepseek_v3"), "float32")
    biased = references(deepseek_biased_dir, "float32")
    assert _routed_experts(plain, ids, layer=1) != _routed_experts(biased, ids, layer=1) or (
        _routed_experts(plain, ids, layer=layer) != _routed_experts(biased, ids, layer=layer)
    ), "the correction bias does not change the selection; the test proves nothing"
    for dtype in DTYPES:
        paged, tokenizer = load_model(deepseek_biased_dir, num_resident=TOP_K, dtype=dtype)
        gate = paged.model.layers[layer].mlp.gate
        assert torch.count_nonzero(gate.e_score_correction_bias) == E
        assert_exact(paged, references(deepseek_biased_dir, dtype), tokenizer, f"biased deepseek_v3 {dtype}")


def test_unsupported_architecture_fails_at_start_up_with_the_list(tmp_path):
    from transformers import LlamaConfig, PhimoeConfig

    for config, what in ((PhimoeConfig(num_hidden_layers=1), "MoE architecture not yet supported"),
                         (LlamaConfig(num_hidden_layers=1), "not an MoE model")):
        path = tmp_path / config.model_type
        config.save_pretrained(path)
        with pytest.raises(ValueError, match=what) as info:
            load_model(path)
        for model_type, family in SUPPORTED_ARCHITECTURES.items():
            assert f"{model_type} ({family})" in str(info.value)


def test_unsupported_quantized_checkpoint_fails_at_start_up(family_dirs, tmp_path):
    """A quant_method no expert format reads is refused before any work, naming it (the
    supported formats are tested in tests/formats/)."""
    config = json.loads((family_dirs("gpt_oss") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized.*'bitsandbytes'.*supported: dense \\(unquantized\\);.* fp8-block \\(quant_method 'fp8'"):
        load_model(tmp_path)


def test_supported_list_is_the_families_table():
    assert set(SUPPORTED_ARCHITECTURES) == set(FAMILIES) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_transposed_experts_is_what_transformers_builds(name):
    """``Family.transposed_experts`` (which layout a quantized format must publish) is the
    experts module's own ``is_transposed`` in transformers' model of the family."""
    from pagedexperts.models.families import experts_transposed

    model = build_model(name)
    experts = [m for m in model.modules() if is_experts_module(m)]
    assert experts and {bool(getattr(m, "is_transposed", False)) for m in experts} == {FAMILIES[name].transposed_experts}
    assert experts_transposed(model.config) is FAMILIES[name].transposed_experts
    assert experts_transposed(model.config.to_dict()) is FAMILIES[name].transposed_experts
    assert experts_transposed({}) is None and experts_transposed({"model_type": "llama"}) is False


def test_layer_mismatch_with_the_family_rule_is_refused():
    model = build_model("qwen2_moe")
    model.config.mlp_only_layers = []  # the config now claims layer 1 is MoE; the model disagrees
    with pytest.raises(ValueError, match=r"MoE layers are \[0, 1, 2\]"):
        find_experts_sites(model)
