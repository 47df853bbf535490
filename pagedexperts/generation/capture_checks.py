"""Capture checks: why a model's decode step could not be captured in a CUDA graph, or None.

Owns the rule ``generation.graphs`` captures by (docs/cuda-graphs.md): every runner syncless
(``ExpertsRunner.capture_problem``), an experts kernel that reads nothing back, dense slots,
sdpa or eager attention without a sliding window; and ``decode_waves``, the most waves a decode
step of a batch runs (one W is one captured shape). Does not: capture, replay or fall back.

Legend: B batch (decode rows), k top_k, E experts, K slots, W waves of a step.
"""

from __future__ import annotations

import torch

from pagedexperts.loading.runtime import runtime_of
from pagedexperts.paging.kernels.decide import num_waves_for
from pagedexperts.paging.steps.table import FUSED

MASK_KINDS = ("sdpa", "eager")  # attention implementations the step's 4-D mask is built for
GROUPED_MM_CAPABILITIES = (9, 10)  # compute capability majors with torch's bf16 grouped GEMM (sm90, sm100)


def decode_waves(model, batch: int) -> int:
    """The most waves a decode step of ``batch`` rows runs in any MoE layer of ``model``: a
    device-planned layer's fixed W for its B k entries (``DeviceExecutor.waves_for``: 1 at
    every batch with ``--beyond-k in-place``), a host-planned layer's bound ceil(min(B k, E) / K),
    1 for a baseline (all E resident or copied). A step of one W is one shape: captured whatever
    W; W = 1 means no batch computes in waves."""
    rt = runtime_of(model)
    waves = [1]
    for runner in (rt.runners.values() if rt is not None else ()):
        if hasattr(runner, "waves_for"):
            waves.append(runner.waves_for(batch * rt.top_k))
        elif hasattr(runner, "residency"):
            waves.append(num_waves_for(batch * rt.top_k, runner.num_slots, runner.num_experts))
    return max(waves)


def capture_problem_of(model) -> str | None:
    """Why ``model``'s decode step would sync under capture (attention, mask, a runner), or None."""
    cfg = model.config
    if cfg._attn_implementation not in MASK_KINDS:
        return f"attention implementation {cfg._attn_implementation!r} (graphs build the mask for {MASK_KINDS})"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "a sliding-window model (graphs build a full causal mask)"
    rt = runtime_of(model)
    for layer, runner in (rt.runners.items() if rt is not None else ()):
        problem = runner_problem(runner, model.dtype)
        if problem is not None:
            return f"MoE layer {layer}: {problem}"
    return None


def runner_problem(runner, dtype: torch.dtype) -> str | None:
    """Why ``runner``'s step would sync under capture, or None (module docstring)."""
    problem = runner.capture_problem(dtype, runner.device)
    if problem is not None:
        return problem
    if runner.inner == "grouped_mm":
        return grouped_mm_problem(dtype, runner.device)
    if runner.inner not in ("batched_mm", FUSED):  # fused: fixed grids, device counts (paging.steps.fused)
        return f"experts implementation {runner.inner!r} finds its experts with nonzero (a host read)"
    return None


def grouped_mm_problem(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``grouped_mm`` would read its group offsets back under capture, or None: torch's
    grouped GEMM kernels are bf16 on compute capability 9.x and 10.x only
    (``GROUPED_MM_CAPABILITIES``; ATen's GroupedBlas); elsewhere its fallback (and
    transformers') copies the offsets to the host."""
    if dtype != torch.bfloat16:
        return (f"grouped_mm in {str(dtype).removeprefix('torch.')} reads its group offsets back (transformers' "
                "and torch's fallbacks); use --dtype bfloat16 or --experts-implementation batched_mm")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major not in GROUPED_MM_CAPABILITIES:
            return (f"grouped_mm on compute capability {major}.{minor} runs torch's fallback, which reads its group "
                    "offsets back (its kernels are for 9.x and 10.x); use --experts-implementation batched_mm")
    return None
