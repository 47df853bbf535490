"""Bad input to the loader: a clear error before any work, naming the value, the limit and the option.

"Before any work" is checked by replacing the loader's heavy steps (host-store allocation and
checkpoint streaming; for config errors, building the model at all) with functions that fail
the test if they are reached.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

import pagedexperts
import pagedexperts.loading.build as build
import pagedexperts.loading.loader as loader
import pagedexperts.storage.host_memory as host_memory
import pagedexperts.storage.host_store as store_module
from support.tiny import E, TOP_K, copy_dir
from pagedexperts.loading.config import PagingConfig
from pagedexperts.loading.resolved import resolve
from pagedexperts.loading.runtime import PagingRuntime
from pagedexperts.models.sites import SUPPORTED_ARCHITECTURES
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.residency.policies import POLICIES
from pagedexperts.formats.base import TensorSpec
from pagedexperts.storage.host_memory import HostMemoryPlan
from pagedexperts.storage.host_store import HostExpertStore


def _work_started(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} started before the bad input was reported")

    return fail


@pytest.fixture
def no_loading(monkeypatch):
    """Fail if a host store is allocated or a checkpoint byte is streamed."""
    monkeypatch.setattr(build, "HostExpertStore", _work_started("host store allocation"))
    monkeypatch.setattr(build, "TieredExpertStore", _work_started("disk tier allocation"))
    monkeypatch.setattr(loader, "fill_from_checkpoint", _work_started("checkpoint streaming"))


@pytest.fixture
def no_model(monkeypatch, no_loading):
    """Also fail if the model skeleton is built."""
    monkeypatch.setattr(build, "_parameters_on_meta", _work_started("model construction"))


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# --- K --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1])
def test_k_below_top_k(tiny_moe_dir, no_loading, k):
    with pytest.raises(ValueError, match=rf"--num-resident K={k} is below top_k={TOP_K}.*raise --num-resident"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=k)


def test_k_above_e_is_refused_and_suggests_e(tiny_moe_dir, no_loading):
    """K > E is refused (not clamped); the message suggests --num-resident E."""
    with pytest.raises(ValueError, match=rf"K={E + 1} exceeds the E={E} .*--num-resident {E}\b"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=E + 1)


# --- paths and configs ------------------------------------------------------------------------


def test_missing_path(tmp_path, no_model):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(missing))}.*does not exist.*--model-path"):
        pagedexperts.load_model(missing)


def test_directory_without_config(tmp_path, no_model):
    with pytest.raises(FileNotFoundError, match=r"has no config\.json.*--model-path"):
        pagedexperts.load_model(tmp_path)


def test_directory_without_safetensors(tmp_path, tiny_moe_dir, no_model):
    (tmp_path / "config.json").write_text((tiny_moe_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no safetensors checkpoint in"):
        pagedexperts.load_model(tmp_path)


def supported_pattern() -> str:
    """The 'supported: ...' list the message must show: every entry of SUPPORTED_ARCHITECTURES."""
    return re.escape(", ".join(f"{k} ({v})" for k, v in sorted(SUPPORTED_ARCHITECTURES.items())))


def test_dense_model_is_not_moe(tmp_path, no_model):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'llama' is not an MoE model; supported: " + supported_pattern()):
        pagedexperts.load_model(tmp_path)
    assert "qwen3_moe" in SUPPORTED_ARCHITECTURES


def test_a_llama_config_with_a_stray_expert_count_is_still_not_moe(tmp_path, tiny_moe_dir, no_model):
    """The architecture decides (its config class declares no expert count), not leftover keys:
    a qwen3_moe config.json relabelled llama was called 'an MoE architecture not yet supported'."""
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    edit_config(path, model_type="llama", architectures=["LlamaForCausalLM"])
    assert _expert_count_key(path) is not None
    with pytest.raises(ValueError, match=r"model_type 'llama' is not an MoE model; supported: " + supported_pattern()):
        pagedexperts.load_model(path)


def _expert_count_key(path) -> str | None:
    """The key config.json spells E with (``models.config.EXPERT_COUNT_KEYS``)."""
    config = json.loads((path / "config.json").read_text())
    return next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)


def test_invalid_config_json_names_the_file_and_the_position(tmp_path, tiny_moe_dir, no_model):
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    (path / "config.json").write_text('{"model_type": "qwen3_moe",\n')
    with pytest.raises(ValueError) as info:
        pagedexperts.load_model(path)
    assert str(info.value) == (f"{path / 'config.json'} is not valid JSON: Expecting property name enclosed in "
                               "double quotes at line 2 column 1 (--model-path)")


def test_top_k_above_e_is_a_config_json_problem_not_a_flag(tmp_path, tiny_moe_dir, no_model):
    """num_experts_per_tok > E in config.json: the message names config.json's keys and values,
    not --num-resident, which the user never gave."""
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    edit_config(path, num_experts_per_tok=E + 1)
    with pytest.raises(ValueError) as info:
        pagedexperts.load_model(path)
    assert str(info.value) == (f"config.json has num_experts_per_tok = {E + 1} but {_expert_count_key(path)} = {E}: a token "
                               "cannot route to more experts than a layer has; the checkpoint's config.json is "
                               "inconsistent (--model-path)")


def test_missing_tokenizer_json_is_named_before_the_weights_load(tmp_path, no_model):
    """tokenizer_config.json without tokenizer.json: the missing file is named (transformers'
    own message asks to install sentencepiece or tiktoken), before the model is built."""
    from pagedexperts.loading.bundled import bundled_model_path

    path = copy_dir(bundled_model_path(), tmp_path / "model")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as info:
        pagedexperts.load_model(path)
    message = str(info.value)
    assert message == (f"{path} has tokenizer_config.json but no tokenizer.json, and transformers cannot build the "
                       f"tokenizer without it (transformers raised {type(info.value.__cause__).__name__}); copy "
                       "tokenizer.json from the source model into the directory (--model-path)")
    assert "sentencepiece" not in message


# MoE families, in the order tried: the first not (yet) supported is the test's example.
UNSUPPORTED_CANDIDATES = ["PhimoeConfig", "GraniteMoeConfig", "JetMoeConfig", "HunYuanMoEV1Config", "MixtralConfig"]


def test_unsupported_moe_architecture_lists_supported(tmp_path, no_model):
    import transformers

    configs = [getattr(transformers, n)() for n in UNSUPPORTED_CANDIDATES if hasattr(transformers, n)]
    config = next((c for c in configs if c.model_type not in SUPPORTED_ARCHITECTURES), None)
    if config is None:
        pytest.skip("every candidate MoE family is supported")
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"'{config.model_type}' is an MoE architecture not yet supported; supported: " + supported_pattern(),
    ):
        pagedexperts.load_model(tmp_path)


# --- damaged checkpoints ----------------------------------------------------------------------


def test_missing_shard(tmp_path, tiny_moe_sharded_dir, no_model):
    path = copy_dir(tiny_moe_sharded_dir, tmp_path / "model")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shards named in .*index\.json are missing: .*{re.escape(shard.name)}"):
        pagedexperts.load_model(path)


def truncate(file, fraction=0.5):
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * fraction)])


def test_truncated_safetensors(tmp_path, tiny_moe_dir):
    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    truncate(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"cannot read checkpoint shard .*model\.safetensors.*truncated or corrupt") as err:
        pagedexperts.load_model(path, num_resident=TOP_K)
    assert str(err.value).count("truncated or corrupt") == 1, str(err.value)
    # the file named once, one hint (it read "shard X: checkpoint shard X: ... (truncated download?) (truncated or corrupt?)")
    assert str(err.value).count("model.safetensors") == 1 and "?) (" not in str(err.value), str(err.value)


def test_truncated_last_shard_is_found_before_any_work(tmp_path, tiny_moe_sharded_dir, no_loading):
    path = copy_dir(tiny_moe_sharded_dir, tmp_path / "model")
    truncate(sorted(path.glob("model-*.safetensors"))[-1])
    with pytest.raises(ValueError, match=r"truncated or corrupt"):
        pagedexperts.load_model(path, num_resident=TOP_K)


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_expert_shapes_that_do_not_match_the_config(tmp_path, tiny_moe_dir, tiny_moe_stacked_dir, layout):
    src = tiny_moe_dir if layout == "per-expert" else tiny_moe_stacked_dir
    path = copy_dir(src, tmp_path / "model")
    edit_config(path, moe_intermediate_size=8)
    with pytest.raises(ValueError, match=r"expert tensor '(down_proj|gate_up_proj)'.* does not match the config's"):
        pagedexperts.load_model(path, num_resident=TOP_K)


def test_half_width_gate_and_up_are_refused(tmp_path, tiny_moe_dir):
    """gate_proj / up_proj of I/2 rows while the config (and down_proj) say I: must be an error."""
    from safetensors.torch import load_file, save_file

    path = copy_dir(tiny_moe_dir, tmp_path / "model")
    state = load_file(path / "model.safetensors")
    for key in list(state):
        if ".experts." in key and (".gate_proj." in key or ".up_proj." in key):
            state[key] = state[key][: state[key].shape[0] // 2].contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"gate"):
        pagedexperts.load_model(path, num_resident=TOP_K)


# --- host memory ------------------------------------------------------------------------------

STORE_BYTES = 2 * E * (2 * 16 * 32 + 32 * 16) * 4  # layers x E x (gate_up + down) x float32


def test_too_little_host_memory_fails_before_loading(tiny_moe_dir, monkeypatch, no_loading):
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match=r"needs .* of host memory \(full expert store .*\) but only .* is available"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")


def test_enough_host_memory_passes(tiny_moe_dir, monkeypatch):
    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    plan = model.pagedexperts.host_memory
    assert sum(p.store.host_bytes for p in model.pagedexperts.runners.values()) == STORE_BYTES == plan.store_bytes
    # on the CPU the K slots are host memory too: 2 layers x K x expert bytes
    assert plan.slot_bytes_on_host == 2 * TOP_K * STORE_BYTES // (2 * E)
    assert plan.runtime_bytes == host_memory.RUNTIME_ALLOWANCE_BYTES["cpu"]
    # the runtime this process already holds is credited to the available memory; here: none
    monkeypatch.setattr(host_memory, "runtime_allowance", lambda device_type: (plan.runtime_bytes, 0))
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: plan.total_bytes)
    pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    # one byte less: the default budget falls to the disk tier, R = E - (staging 2 x top_k
    # experts over 2 layers = TOP_K rows) - 1 (the missing byte)
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: plan.total_bytes - 1)
    model, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")
    assert model.pagedexperts.host_memory.host_rows == E - TOP_K - 1


def test_memory_error_names_every_part(tiny_moe_dir, monkeypatch, no_loading):
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 4096)
    with pytest.raises(MemoryError, match=r"slots on host .* non-expert weights .* KV estimate .* runtime allowance"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")


def test_host_memory_below_the_disk_tier_minimum_names_it(tiny_moe_dir):
    fixed = pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32")[0].pagedexperts.host_memory.fixed_bytes
    expert = STORE_BYTES // (2 * E)
    minimum = 2 * expert + 2 * TOP_K * expert + fixed  # a row per layer + staging + slots, weights, KV, runtime
    with pytest.raises(ValueError, match=rf"--host-memory-gb 1e-06 is below the minimum .*{minimum:,} bytes"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, dtype="float32", host_memory_gb=1e-6)


def test_memory_error_names_both_amounts_readably():
    plan = host_memory.HostMemoryPlan(num_layers=2, num_experts=E, expert_bytes=STORE_BYTES // (2 * E), host_rows=E,
                                      slot_bytes_on_host=0, staging_bytes=0, non_expert_bytes_on_host=0, kv_bytes_on_host=0)
    with pytest.raises(MemoryError) as info:
        host_memory.check_available(plan, 1000)
    amounts = re.findall(r"(\d+(?:\.\d+)?) ?(?:bytes|B|kB|KB|KiB|MB|MiB|GB|GiB)\b", str(info.value))
    assert len(amounts) >= 2 and all(float(a) > 0 for a in amounts[:2]), str(info.value)


# --- pinned allocation fallback -----------------------------------------------------------------


def test_failed_pinned_allocation_falls_back_loudly(monkeypatch, caplog):
    monkeypatch.setattr(store_module, "host_register", lambda t: 2)  # cudaErrorMemoryAllocation
    specs = [TensorSpec("gate_up_proj", (32, 32), torch.float32), TensorSpec("down_proj", (32, 16), torch.float32)]
    with caplog.at_level(logging.WARNING, logger="pagedexperts.storage.host_store"):
        store = HostExpertStore(specs, E, pin=True)
    monkeypatch.undo()

    assert not store.pinned and store.fallback is not None
    assert f"page-locking {E * 32 * 32 * 4:,} bytes" in store.fallback and "CUDA error 2" in store.fallback
    assert "pageable" in store.fallback and "ulimit -l" in store.fallback
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "pagedexperts.storage.host_store"]
    assert warnings and warnings[0].getMessage() == store.fallback
    for spec in specs:
        t = store.tensors[spec.name]
        assert t.shape == (E, *spec.shape) and not t.is_pinned()

    pager = HostExecutor(layer=0, store=store, num_slots=TOP_K, device="cpu", inner="grouped_mm")
    runtime = _runtime(store, pager)
    assert runtime.stats().fallbacks == [store.fallback]
    assert runtime.stats().as_dict()["fallbacks"] == [store.fallback]


def _runtime(store, pager) -> PagingRuntime:
    """The runtime of one paged layer over ``store``, its choices resolved as a load resolves them."""
    memory = HostMemoryPlan(num_layers=1, num_experts=E, expert_bytes=store.expert_bytes, host_rows=E,
                            slot_bytes_on_host=0, staging_bytes=0, non_expert_bytes_on_host=0, kv_bytes_on_host=0)
    cfg = PagingConfig(num_resident=TOP_K)
    resolved = resolve(cfg, None, num_experts=E, top_k=TOP_K, device=torch.device("cpu"),
                       dtype=torch.float32, sites=[], layouts={}, memory=memory, stores={"layer0": store})
    return PagingRuntime(config=cfg, resolved=resolved, num_experts=E, top_k=TOP_K,
                         runners={0: pager})


def test_no_fallback_reported_without_pinning():
    store = HostExpertStore([TensorSpec("w", (4,), torch.float32)], E, pin=False)
    pager = HostExecutor(layer=0, store=store, num_slots=TOP_K, device="cpu", inner="grouped_mm")
    runtime = _runtime(store, pager)
    assert runtime.stats().fallbacks == []


# --- unknown names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dtype="float64"), r"unknown dtype 'float64'; choose one of \['bfloat16', 'float16', 'float32'\] \(--dtype\)"),
        (dict(experts_implementation="sonic"),
         r"'sonic' is not supported under paging; choose one of "
         r"\['grouped_mm', 'batched_mm', 'eager', 'fused', 'packed'\] \(--experts-implementation\)"),
        (dict(policy="mru"), rf"unknown eviction policy 'mru'; choose one of {re.escape(str(sorted(POLICIES)))} \(--policy\)"),
    ],
)
def test_unknown_names_list_the_choices(tiny_moe_dir, no_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda(tiny_moe_dir, no_loading):
    with pytest.raises(ValueError, match=r"'cuda'.*CUDA is not available; use --device cpu"):
        pagedexperts.load_model(tiny_moe_dir, num_resident=TOP_K, device="cuda")
