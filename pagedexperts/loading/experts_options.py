"""The experts implementation's options that depend only on the configuration's fields.

Owns: whether the fused kernels run and where steps are planned, ``--beyond-k`` /
``--admit-per-step`` problems, and the experts' dtype an implementation can take; ``cfg`` is a
``loading.config.PagingConfig`` read by its fields (this module imports nothing of it).
"""

from __future__ import annotations

import torch

from pagedexperts.paging.device_residency import BEYOND_K
from pagedexperts.paging.steps.table import FUSED, PACKED

# The experts kernels that run routed experts held in another dtype than the model's:
# transformers' ``_grouped_mm`` casts its input to the weights' dtype; ``eager`` and
# ``batched_mm`` (``nn.functional.linear`` / ``_batched_linear``) fail on the mixed dtypes;
# ``fused`` casts its input the same way (``paging.steps.fused``), and ``packed`` too
# (``paging.steps.host_packed``: the kernels run in the experts' dtype, their scales').
MIXED_DTYPE_IMPLEMENTATIONS = ("grouped_mm", FUSED, PACKED)

def beyond_k_problems(cfg) -> list[str]:
    """The problems of ``--beyond-k`` and ``--admit-per-step``: an unknown choice; in-place
    reads without the fused kernels on the device-planned step (they read the host rows); an
    admission limit below 0 or without in-place reads. Each names its flags."""
    if cfg.beyond_k not in BEYOND_K:
        return [f"unknown --beyond-k {cfg.beyond_k!r}; choose one of {list(BEYOND_K)}"]
    problems = []
    if cfg.beyond_k == "in-place" and not (is_fused(cfg) and planned_on_device(cfg)):
        problems.append(f"--beyond-k in-place reads experts beyond K from host rows inside the fused kernels: it needs "
                        f"--experts-implementation fused on the device-planned step (--decide device or auto, mode "
                        f"paged); got --experts-implementation {cfg.experts_implementation}, --decide {cfg.decide}, "
                        f"mode {cfg.mode}. Use --beyond-k waves otherwise")
    if cfg.admit_per_step is not None:
        if cfg.beyond_k != "in-place":
            problems.append(f"--admit-per-step {cfg.admit_per_step} limits the page-ins of --beyond-k in-place; "
                            "with --beyond-k waves every routed expert is paged in (drop --admit-per-step)")
        elif not isinstance(cfg.admit_per_step, int) or cfg.admit_per_step < 0:
            problems.append(f"--admit-per-step {cfg.admit_per_step} must be an integer >= 0 (page-ins per layer-step; "
                            "leave it out: K)")
    return problems


def is_fused(cfg) -> bool:
    """Whether the experts run through the fused kernels (``--experts-implementation fused``)."""
    return cfg.experts_implementation == FUSED


def planned_on_device(cfg) -> bool:
    """Whether ``cfg``'s paged steps are planned on the device whatever the machine:
    ``--decide device``, or ``fused`` with ``--decide auto`` (the fused kernels run on the
    device-planned step only, so auto means device for them, on CPU too)."""
    return cfg.mode == "paged" and (cfg.decide == "device" or (cfg.decide == "auto" and is_fused(cfg)))


def experts_dtype_problem(fmt, model_dtype: torch.dtype, experts_implementation: str) -> str | None:
    """Why the kernel cannot run ``fmt``'s experts at ``model_dtype``, or None: transformers keeps a
    compressed-tensors int4 checkpoint's dequantized experts in its scales' dtype, which only
    ``grouped_mm`` takes mixed with another model dtype.
    """
    experts = fmt.experts_dtype(model_dtype)
    if experts == model_dtype or experts_implementation in MIXED_DTYPE_IMPLEMENTATIONS:
        return None
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return (
        f"--experts-implementation {experts_implementation} cannot run this {fmt.name} checkpoint at "
        f"--dtype {name(model_dtype)}: transformers keeps its dequantized routed experts in the scales' "
        f"dtype {name(experts)} and the {experts_implementation} kernel fails on {name(model_dtype)} inputs "
        f"with {name(experts)} weights (unpaged transformers too); use --experts-implementation grouped_mm "
        f"or --dtype {name(experts)}"
    )


def check_experts_dtype(fmt, model_dtype: torch.dtype, experts_implementation: str) -> None:
    """Raises ValueError with ``experts_dtype_problem``'s message when there is one."""
    problem = experts_dtype_problem(fmt, model_dtype, experts_implementation)
    if problem is not None:
        raise ValueError(problem)
