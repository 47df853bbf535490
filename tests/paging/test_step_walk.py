"""The layer-step walk stays short: one decode step of one MoE layer crosses few package modules
and functions on every path (issue 37: at most 8 modules and 24 functions).

The counter is ``bench/step_walk.py`` (``sys.setprofile`` from ``integration.paged_experts_forward``
down; its docstring says what counts): batch 2, K = 16, the second decode step of the first MoE
layer of the bundled model cut to its first layer (every shape kept: the first layer's inputs, and
so its routing and its walk, are the full model's). The device-planned paths under the Triton
interpreter take minutes on a CPU (slow); the quick run walks the device-planned step with the
decide, page-in and remap as their torch backends, within the same bound. The count is
deterministic, so the bounds are exact ceilings, not tolerances: every path within 8 modules and
24 functions (the host-planned path crossed 11 and 31 before its step was read top-down, its
page-in made one call that the plain slot table serves itself, the time distributions kept with
the stats record and small experts gathered in the unpaged layout: docs/design-layer-step.md,
"The walk").

Legend: K slots.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from pagedexperts.loading.loader import bundled_model_path
from support.paths import DATA, ROOT

BOUNDS = {"host": (8, 24), "device": (8, 24), "fused": (8, 24), "packed": (8, 24)}  # path -> (modules, functions) at most


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> Path:
    """The bundled model cut to its first decoder layer, with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = bundled_model_path()
    config = AutoConfig.from_pretrained(src, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("bundled-1-layer")
    model.save_pretrained(path)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


def step_walk():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_walk
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return step_walk


@pytest.mark.parametrize("path,kernels", [
    ("host", "triton"),  # no device kernel on this path
    ("device", "torch"),  # the decide / page-in / remap as their torch backends
    pytest.param("device", "triton", marks=pytest.mark.slow),  # the kernels interpreted: issue 37's count
    pytest.param("fused", "triton", marks=pytest.mark.slow),  # the fused GEMMs interpreted (minutes)
])
def test_one_layer_step_crosses_few_modules_and_functions(path, kernels, one_layer):
    if path != "host":
        pytest.importorskip("triton")
    walk = step_walk().walk(path, device_kernels=kernels, model_path=one_layer)
    listing = "\n".join(f"{m}: {f}" for m, f in walk.functions)
    max_modules, max_functions = BOUNDS[path]
    assert len(walk.modules) <= max_modules, f"{path}: {len(walk.modules)} modules\n{listing}"
    assert len(walk.functions) <= max_functions, f"{path}: {len(walk.functions)} functions\n{listing}"
    assert walk.functions[0] == ("pagedexperts.integration", "paged_experts_forward")
    if path == "fused":  # the launches are built once per layer and step shape, not per wave
        rebuilt = [f for m, f in walk.functions if m in ("pagedexperts.paging.kernels.fused_moe",
                                                          "pagedexperts.formats.packing")]
        assert rebuilt == [], f"the fused launch is rebuilt in a step: {rebuilt}"



def test_the_fused_body_builds_its_launches_once_per_step_shape(monkeypatch):
    """What is fixed for a layer is built once: over four steps of two shapes (T = 1 and 3) the
    fused body builds each projection's launch arguments once per shape (2 x 2) and its address
    tables once (a synthetic Qwen3-MoE layer, E = 8, K = 4; the kernels interpreted)."""
    pytest.importorskip("triton")
    from pagedexperts.paging.device_executor import DeviceExecutor
    from pagedexperts.paging.steps import fused
    from support.synthetic_layer import paged, step_inputs, synthetic_experts

    calls = {"gemm_arguments": 0, "slot_rows": 0}

    def counted(name):
        original = getattr(fused, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    for name in calls:
        monkeypatch.setattr(fused, name, counted(name))
    module = synthetic_experts(torch.float32)
    dev = DeviceExecutor(layer=0, store=paged(module, 4).store, num_slots=4, device="cpu", inner="fused", policy="lru")
    for n, routing in enumerate([[[0, 1]], [[2, 3], [4, 5], [1, 6]], [[7, 0]], [[1, 2], [3, 0], [5, 6]]]):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        dev.step(module, hidden, ids, weights)
    assert calls == {"gemm_arguments": 4, "slot_rows": 1}


def test_packed_cpu_step_crosses_few_modules_and_functions():
    """The packed CPU body (torch's int4 kernel over slots in its layout) on GPTQModel's own
    experts-only GPTQ checkpoint (E = 8, top_k = 2) at K = 4: within the same bound, and of the
    CPU layout's module a step crosses only the table's kernel tensors and the kernel call: no
    name of the kernels' layout is looked up, nothing converted (the projections are resolved
    once per layer)."""
    walk = step_walk().walk("packed", model_path=DATA / "gptqmodel" / "qwen3_moe-gptq-experts", num_resident=4)
    listing = "\n".join(f"{m}: {f}" for m, f in walk.functions)
    max_modules, max_functions = BOUNDS["packed"]
    assert ("pagedexperts.paging.steps.host_packed", "HostPackedStep.run_wave") in walk.functions, listing
    assert len(walk.modules) <= max_modules, f"packed: {len(walk.modules)} modules\n{listing}"
    assert len(walk.functions) <= max_functions, f"packed: {len(walk.functions)} functions\n{listing}"
    crossed = {f for m, f in walk.functions if m == "pagedexperts.formats.cpu_pack"}
    assert crossed == {"CpuPackedSlots.kernel_tensors", "packed_matmul"}, listing
