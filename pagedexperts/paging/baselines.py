"""The baselines users would run instead of paging, as real execution modes of the same model.

Owns: three per-layer experts runners that stand where an executor stands (the
``runner_contract.ExpertsRunner`` contract), and the ``--mode`` names (``MODES``, ``mode_problem``);
offload and cpu-experts keep the executors' stats (bytes moved, union), resident keeps none,
since it does nothing a counter could measure (docs/design.md "Executors"):
- ``ResidentRunner``: all E experts on the device (the speed ceiling when it fits): the
  model's own experts step and nothing else (no read-back, no union, no per-step counters).
- ``OffloadRunner``: every expert of the layer copied to the device at every step, whatever
  the router picked (what ``--cpu-offload-gb`` does): E x expert bytes per layer per step,
  through one [E, ...] staging buffer shared by all layers.
- ``CpuExpertsRunner``: the layer's experts stay in host memory and are computed on the CPU
  (what llama.cpp ``--n-cpu-moe N`` does for the first N MoE layers).
All three call the model's own experts implementation over E experts with the original ids,
so on CPU they compute exactly what the unpaged model computes. The model with nothing of
this package attached (``bench``'s "plain" mode) is transformers' own, not a runner here.
Does not: page selectively (the executors) or choose which layers use which mode
(``loading.runners``).
"""

from __future__ import annotations

import time

import torch

from pagedexperts.paging.steps.table import resolve_inner
from pagedexperts.paging.runner_contract import ExpertsRunner
from pagedexperts.paging.transfer import read_step
from pagedexperts.paging.steps.contract import SlotView
from pagedexperts.storage.host_store import HostExpertStore

MODES = ("paged", "resident", "offload", "cpu-experts")


def mode_problem(mode: str) -> str | None:
    """Why ``mode`` is not an execution mode (names the choices and --mode), or None."""
    return None if mode in MODES else f"unknown mode {mode!r}; choose one of {list(MODES)} (--mode)"


class _BaselineRunner(ExpertsRunner):
    """Shared plumbing: the step's read-back, tracing and stats; subclasses implement ``_compute``."""

    def __init__(self, *, layer: int, store, device, inner: str, layout=None) -> None:
        super().__init__(layer=layer, store=store, device=device, inner=inner)
        self.layout = layout  # formats.ExpertLayout of a quantized layer (None: dense)

    def dense(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's dense expert tensors from the store-shaped ``tensors`` (dequantized
        when the layer is quantized; the same tensors otherwise)."""
        return tensors if self.layout is None or self.layout.is_dense else self.layout.dequantize(tensors)

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """[T, H], [T, k], [T, k] -> [T, H]; records union size and bytes moved."""
        t0 = time.perf_counter()
        read = read_step(top_k_index, None, padding_count)  # one transfer, as in the executors
        t1 = time.perf_counter()
        if self.trace_hook is not None:
            self.trace_hook(self.layer, read.ids, top_k_weights.detach().to("cpu"))
        union = len(read.union())
        out, hits, bytes_moved, copy_s = self._compute(module, hidden_states, top_k_index, top_k_weights, union)
        self.stats.record_step(
            hits=hits, misses=union - hits, waves=1, tokens=int(hidden_states.shape[0]) - read.padding,
            padding_tokens=read.padding, expert_bytes=self.store.expert_bytes, bytes_paged=bytes_moved,
            page_in_s=copy_s, sync_s=t1 - t0, host_syncs=1,  # read_step: the step's one read-back
        )
        return out


class ResidentRunner(_BaselineRunner):
    """All E experts of the layer on the device: the model's own experts function over them,
    with the original ids, and nothing else. Nothing is paged, so nothing is read back, no
    union is formed and no per-step counter is kept (its ``stats`` stay empty: hits, union,
    tokens and times are not measured, and ``bench`` reports them as not applicable). With a
    trace being recorded (``trace_hook``) the ids are read back for it, as the recorder asks.
    A quantized layer is dequantized once, at construction (the "dequantized resident model").
    Called inline (``inline``), not through the opaque custom op; a CUDA graph can hold it.
    """

    inline = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        # contiguous, as the paged model's kernel receives its slots (GPTQ's and AWQ's dequantize
        # returns transposed views, on which CPU GEMMs round differently)
        self.tensors = {n: t.contiguous() for n, t in self.dense({n: t.to(self.device)
                                                                  for n, t in self.store.tensors.items()}).items()}
        self._view: SlotView | None = None  # the module's view over ``tensors``, made on first call

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """[T, H], [T, k], [T, k] -> [T, H]: the model's experts step over the E device experts
        (``padding_count`` is not read: nothing is counted)."""
        if self.trace_hook is not None:
            self.trace_hook(self.layer, top_k_index.detach().to("cpu"), top_k_weights.detach().to("cpu"))
        if self._view is None:
            self._view = SlotView(module, self.tensors)
        return resolve_inner(module, self.inner)(self._view, hidden_states, top_k_index, top_k_weights)

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """None (the model's own device math, nothing read back), unless a trace is recorded."""
        if self.trace_hook is not None:
            return "a trace is being recorded: it reads every step's routing back (--record-trace)"
        return None


class OffloadRunner(_BaselineRunner):
    """Copies all E experts into ``staging`` ({name: [E, ...] on the device}, shared by all
    layers) every step; every routed expert counts as a miss, bytes = E x expert bytes."""

    def __init__(self, *, staging: dict[str, torch.Tensor], **kw) -> None:
        super().__init__(**kw)
        self.staging = staging

    def _compute(self, module, hidden, ids, weights, union):
        t0 = time.perf_counter()
        for name, host in self.store.tensors.items():
            self.staging[name].copy_(host, non_blocking=self.store.pinned)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        copy_s = time.perf_counter() - t0
        out = resolve_inner(module, self.inner)(SlotView(module, self.dense(self.staging)), hidden, ids, weights)
        return out, 0, self.store.host_bytes, copy_s


class CpuExpertsRunner(_BaselineRunner):
    """Computes the layer's experts on the CPU from the host store; activations move instead
    of weights (T x H in and out). Every routed expert is a hit (nothing is paged). A quantized
    layer is dequantized once, into host memory, at construction."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.tensors = {n: t.contiguous() for n, t in self.dense(self.store.tensors).items()}

    def _compute(self, module, hidden, ids, weights, union):
        cpu = torch.device("cpu")
        inner = resolve_inner(module, self.inner)
        out = inner(SlotView(module, self.tensors), hidden.to(cpu), ids.to(cpu), weights.to(cpu))
        return out.to(hidden.device), union, 0, 0.0


def make_staging(store: HostExpertStore, device) -> dict[str, torch.Tensor]:
    """One [E, ...] device buffer per per-expert tensor, shaped like ``store``'s tensors."""
    return {n: torch.empty_like(t, device=device) for n, t in store.tensors.items()}
