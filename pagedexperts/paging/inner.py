"""The experts implementations a paged layer-step runs: each one's step on each path.

Owns the inner-kernel table of the wave-compute contract (``paging.waves``): for every
transformers experts implementation a paged step can run over the slots (the "inner" one:
``grouped_mm``, ``batched_mm``, ``eager``), its host-planned step (``paging.waves``) and its
device-planned step (``paging.device_layout``; None, and why, where it has none);
``inner_problem``, the one check of an inner name for either path (naming the choices and the
flags; a runner checks its name once, when it is set: ``paging.runner.ExpertsRunner.inner``);
and ``resolve_inner``, an inner name's unpaged experts function (the baselines run it over all
E experts). Does not: compute (the steps do), or choose where a step is planned
(``loading.config.resolve_decide``).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from pagedexperts.paging.device_layout import DeviceBatchedStep, DeviceGroupedStep, DeviceStep
from pagedexperts.paging.fused_step import DeviceFusedStep
from pagedexperts.paging.waves import BatchedStep, EagerStep, GroupedStep, HostStep

DECIDES = ("host", "device")  # where a paged step is planned (``--decide``, resolved)
FUSED = "fused"  # the fused Triton MoE kernels over the packed slots (``paging.fused_step``)


@dataclass(frozen=True)
class InnerKernel:
    """How one experts implementation runs under paging: its ``host`` step or None, its
    ``device`` step or None, ``no_host`` / ``no_device``: why it has none (the host read the
    device path cannot make; the fused kernels run on the device path only), and ``packed``:
    the step reads the packed slot rows itself (``view.fused_rows``, ``paging.fused_step``), so
    the executor hands it the slots as they are, never a dequantized wave.
    A step is built per layer-step, ``host(module, hidden [T, H], top_k_index [T, k], ids_host
    [T, k] numpy, waves)`` or ``device(module, hidden, top_k_index, entry_slot [S], entry_wave
    [S])``, then run wave by wave and combined (``paging.waves.StepEntries``)."""

    host: type[HostStep] | None
    device: type[DeviceStep] | None
    no_device: str = ""
    no_host: str = ""
    packed: bool = False


INNER_KERNELS: dict[str, InnerKernel] = {
    "grouped_mm": InnerKernel(host=GroupedStep, device=DeviceGroupedStep),
    "batched_mm": InnerKernel(host=BatchedStep, device=DeviceBatchedStep),
    "eager": InnerKernel(host=EagerStep, device=None, no_device="its loop reads the routed experts back"),
    FUSED: InnerKernel(host=None, device=DeviceFusedStep, packed=True,
                       no_host="its Triton kernels read the packed slots by slot id on the device-planned step"),
}
INNER_IMPLEMENTATIONS = tuple(INNER_KERNELS)


def inner_problem(inner: str, *, decide: str = "host") -> str | None:
    """Why experts implementation ``inner`` cannot run a paged step planned on ``decide``
    ("host" or "device"), naming the choices and the flag to change; None when it can.

    Raises:
        ValueError: ``decide`` is neither (a caller's bug: the choices are ``DECIDES``).
    """
    if decide not in DECIDES:
        raise ValueError(f"decide {decide!r}: choose one of {list(DECIDES)}")
    kernel = INNER_KERNELS.get(inner)
    if kernel is None:
        return (f"experts implementation {inner!r} is not supported under paging; choose one of "
                f"{list(INNER_IMPLEMENTATIONS)} (--experts-implementation)")
    if decide == "device" and kernel.device is None:
        on_device = [name for name, k in INNER_KERNELS.items() if k.device is not None]
        return (f"--decide device runs --experts-implementation {' or '.join(on_device)}, not {inner!r} "
                f"({kernel.no_device}); use --decide host")
    if decide == "host" and kernel.host is None:
        return (f"--experts-implementation {inner} runs only on the device-planned paged step (mode paged, "
                f"--decide device or auto: {kernel.no_host}); for --decide host and the baselines use "
                f"--experts-implementation {' or '.join(n for n, k in INNER_KERNELS.items() if k.host is not None)}")
    return None


def transformers_inner(name: str) -> str:
    """The transformers experts implementation a model is built with for paged inner ``name``:
    ``name`` itself, or ``grouped_mm`` for ``fused`` (not in transformers' registry; the paged
    dispatcher replaces the implementation anyway)."""
    return "grouped_mm" if name == FUSED else name


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
    return _inner_for(type(module), name)


@functools.lru_cache(maxsize=None)
def _inner_for(cls: type, name: str) -> Callable:
    if name == "eager":
        return cls.forward.__wrapped__
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[name]
