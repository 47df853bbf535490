"""The baselines users would run instead of paging, as ``runner_contract.ExpertsRunner``s: resident,
offload and cpu-experts (docs/design.md "Executors"), and the ``--mode`` names. Each runs the
model's own experts implementation over all E experts with the original ids.
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
        """The model's dense expert tensors from the store-shaped ``tensors``."""
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
    """All E experts on the device: the model's own experts step, no counters, called ``inline`` (a
    CUDA graph can hold it). A quantized layer is dequantized once, at construction."""

    inline = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        # contiguous, as the paged model's kernel receives its slots (GPTQ's and AWQ's dequantize
        # returns transposed views, on which CPU GEMMs round differently)
        self.tensors = {n: t.contiguous() for n, t in self.dense({n: t.to(self.device)
                                                                  for n, t in self.store.tensors.items()}).items()}
        self._view: SlotView | None = None  # the module's view over ``tensors``, made on first call

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """[T, H], [T, k], [T, k] -> [T, H]; ``padding_count`` is not read."""
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
    """Copies all E experts into ``staging`` ({name: [E, ...]}, shared by all layers) every step; every
    routed expert is a miss."""

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
    """The layer's experts computed on the CPU from the host store; every routed expert is a hit."""

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
