"""The experts implementations a paged layer-step runs, and the body that runs each on each path.

Owns ``STEP_BODIES``: for every experts implementation a paged step can run over the slots (the
"inner" one: transformers' ``grouped_mm``, ``batched_mm``, ``eager``, and the package's own
``fused``), its host-planned body and its device-planned body (``steps.contract.LayerStep``
classes; None, and why, where it has none); ``inner_problem``, the one check of an inner name
for either path (naming the choices and the flags; a runner checks its name once, when it is
set: ``paging.runner_contract.ExpertsRunner.inner``); ``body_for``; ``transformers_inner`` and
``resolve_inner``, an inner name's unpaged experts function (the baselines run it over all E
experts). Does not: compute (the bodies do), or choose where a step is planned
(``loading.config.resolve_decide``).
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
    """The bodies of one experts implementation: ``host`` (host-planned) or None, ``device``
    (device-planned) or None, and ``no_host`` / ``no_device``: why it has none."""

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
    """Why experts implementation ``inner`` cannot run a paged step planned on ``decide``
    ("host" or "device"), naming the choices and the flag to change; None when it can.

    Raises:
        ValueError: ``decide`` is neither (a caller's bug: the choices are ``DECIDES``).
    """
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
    """The body class running ``inner`` on a step planned on ``decide``.

    Raises:
        ValueError: ``inner_problem``'s message."""
    problem = inner_problem(inner, decide=decide)
    if problem is not None:
        raise ValueError(problem)
    bodies = STEP_BODIES[inner]
    return bodies.host if decide == "host" else bodies.device


def transformers_inner(name: str) -> str:
    """The transformers experts implementation a model is built with for paged inner ``name``:
    ``name`` itself, or ``grouped_mm`` for ``fused``, ``packed`` and ``auto`` (not in transformers'
    registry; the paged dispatcher replaces the implementation anyway, and ``packed`` runs
    ``grouped_mm`` on a layer its kernels cannot take)."""
    return "grouped_mm" if name in (FUSED, PACKED, "auto") else name


def resolve_inner(module: torch.nn.Module, name: str) -> Callable:
    """The unpaged experts function ``name`` of transformers' registry (``eager``: the class's
    own loop): ``fn(module, hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    Looked up once per (experts class, name): the baselines call this every layer step.

    Raises:
        ValueError: ``name`` not supported under paging (``inner_problem``'s message).
    """
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
