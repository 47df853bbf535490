"""``STEP_BODIES``: each inner experts implementation's host- and device-planned body, or why none;
``inner_problem``, the one check of an inner name; ``resolve_inner``, the unpaged function the
baselines run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from pagedexperts.paging.steps.contract import LayerStep
from pagedexperts.paging.steps.device_batched import DeviceBatchedStep
from pagedexperts.paging.steps.device_grouped import DeviceGroupedStep
from pagedexperts.paging.steps.fused import FusedStep
from pagedexperts.paging.steps.host_batched import HostBatchedStep
from pagedexperts.paging.steps.host_eager import HostEagerStep
from pagedexperts.paging.steps.host_grouped import HostGroupedStep
from pagedexperts.paging.steps.host_packed import HostPackedStep

DECIDES = ("host", "device")  # where a paged step is planned (``--decide``, resolved)
FUSED = "fused"  # the fused Triton MoE kernels over the packed slots (``steps.fused``)
PACKED = "packed"  # torch's packed int4 / int8 CPU matmuls over kernel-layout slots (``steps.host_packed``)


@dataclass(frozen=True)
class StepBodies:
    """One implementation's ``host`` and ``device`` bodies, or None with ``no_host`` / ``no_device``
    saying why."""

    host: type[LayerStep] | None
    device: type[LayerStep] | None
    no_device: str = ""
    no_host: str = ""


STEP_BODIES: dict[str, StepBodies] = {
    "grouped_mm": StepBodies(host=HostGroupedStep, device=DeviceGroupedStep),
    "batched_mm": StepBodies(host=HostBatchedStep, device=DeviceBatchedStep),
    "eager": StepBodies(host=HostEagerStep, device=None, no_device="its loop reads the routed experts back"),
    FUSED: StepBodies(host=None, device=FusedStep,
                      no_host="its Triton kernels read the packed slots by slot id on the device-planned step"),
    PACKED: StepBodies(host=HostPackedStep, device=None,
                       no_device="torch's packed CPU matmuls run per routed expert on the host-planned CPU step"),
}
INNER_IMPLEMENTATIONS = tuple(STEP_BODIES)


def inner_problem(inner: str, *, decide: str = "host") -> str | None:
    """Why ``inner`` cannot run planned on ``decide`` (names choices and flag), or None; ValueError:
    bad ``decide``."""
    if decide not in DECIDES:
        raise ValueError(f"decide {decide!r}: choose one of {list(DECIDES)}")
    bodies = STEP_BODIES.get(inner)
    if bodies is None:
        return (f"experts implementation {inner!r} is not supported under paging; choose one of "
                f"{list(INNER_IMPLEMENTATIONS)} (--experts-implementation)")
    if decide == "device" and bodies.device is None:
        on_device = [name for name, b in STEP_BODIES.items() if b.device is not None]
        return (f"--decide device runs --experts-implementation {' or '.join(on_device)}, not {inner!r} "
                f"({bodies.no_device}); use --decide host")
    if decide == "host" and bodies.host is None:
        return (f"--experts-implementation {inner} runs only on the device-planned paged step (mode paged, "
                f"--decide device or auto: {bodies.no_host}); for --decide host and the baselines use "
                f"--experts-implementation {' or '.join(n for n, b in STEP_BODIES.items() if b.host is not None)}")
    return None


def body_for(inner: str, decide: str) -> type[LayerStep]:
    """The body class running ``inner`` planned on ``decide`` (ValueError: ``inner_problem``'s)."""
    problem = inner_problem(inner, decide=decide)
    if problem is not None:
        raise ValueError(problem)
    bodies = STEP_BODIES[inner]
    return bodies.host if decide == "host" else bodies.device


def transformers_inner(name: str) -> str:
    """What transformers builds for paged inner ``name``: itself, or ``grouped_mm`` for fused, packed,
    auto."""
    return "grouped_mm" if name in (FUSED, PACKED, "auto") else name


def resolve_inner(module: torch.nn.Module, name: str) -> Callable:
    """The unpaged experts function ``name``: ``fn(module, hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]``, cached per (class, name). ValueError: ``inner_problem``'s."""
    problem = inner_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return _inner_for(type(module), transformers_inner(name))  # packed: grouped_mm, as a layer it cannot take


@functools.lru_cache(maxsize=None)
def _inner_for(cls: type, name: str) -> Callable:
    if name == "eager":
        return cls.forward.__wrapped__
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[name]
