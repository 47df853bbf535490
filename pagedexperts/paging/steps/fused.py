"""``fused`` planned on the device: the fused Triton MoE kernels over the packed slot rows.

Owns ``slot_rows`` (the address tables of one layer's [K, ...] packed slot tensors, the
``kernels.fused_moe.ProjectionRows`` of gate_up and down), ``PreparedGemm`` and ``FusedStep``, the
``steps.contract.LayerStep`` body of ``--experts-implementation fused``: per wave, the entries
of the wave keep their slot as row id and the others get -1; the entries are aligned by row
(``kernels.fused_align``), the gate-up GEMM reads the packed slots and dequantizes in
registers (``kernels.fused_moe_kernel``), the module's own gate turns [S, 2I] into [S, I], the
down GEMM writes the wave's entry outputs: no dense scratch, no host constant, no read-back.
What is fixed for the layer is built once: the address tables at its first step, and per step
shape S the launches (``PreparedGemm``: packing arguments, tables, tiles, target and grid
bound; ``kernels.fused_align.AlignLaunch``), so a wave runs the kernels and nothing else. Does not: decide or page in (``paging.device_executor``).

Activation. The gate-up GEMM writes the [S, 2I] intermediate in entry order; the experts
module's own ``_apply_gate`` / ``act_fn`` turns it into [S, I]: every family's quirk (Qwen's
SiLU-and-mul, gpt-oss's clamped SwiGLU over interleaved gate/up) is then the model's own code,
in torch ops that a CUDA graph captures. Fusing it into the GEMM would save one [S, 2I] write
and read (at decode 2 x S x 2I x 2 bytes, about 49 KB at Qwen3-30B-A3B's S = 8: noise next to
the weights' 9 MB) at the cost of a second copy of every family's gate.

Exactness: an entry's output bits depend only on its token, its expert's packed bytes and the
step's entry count (tile sizes are a function of S and the packing, never of K, E, the slot or
the wave: ``kernels.fused_moe.choose_blocks``), and the weights are applied in ``combine`` as
``grouped_mm`` ends. So a paged step equals the same kernels with all E experts resident
(K = E), bit for bit (tests/paging/kernels/test_fused_paged.py). Against transformers' dequantized experts it
is within a tolerance (docs/exactness.md).

Legend: T tokens, H hidden, I expert intermediate, k top_k, K slots, S = T k entries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pagedexperts.formats.base import ExpertLayout, TensorSpec
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.paging.kernels import fused_moe_kernel as kernels  # its @triton.jit names exist only with triton
from pagedexperts.paging.kernels._triton import triton
from pagedexperts.paging.kernels.fused_align import AlignLaunch
from pagedexperts.paging.kernels.fused_moe import (FusedBlocks, KernelTarget, ProjectionRows, block_m_for,
                                                   choose_blocks, gemm_arguments)
from pagedexperts.paging.steps.contract import DeviceRouting, LayerStep, SlotView

PROJECTIONS = ("gate_up_proj", "down_proj")  # what the fused kernels compute, in order
MAX_SHAPES = 64  # step shapes (entry counts) whose launches a layer keeps; the oldest go first


def slot_rows(layout: ExpertLayout | None, slots: Mapping[str, torch.Tensor], *,
              transposed: bool) -> dict[str, ProjectionRows]:
    """{"gate_up_proj": ProjectionRows, "down_proj": ...} over the [K, ...] ``slots`` (row id
    = slot). ``layout``: the layer's quantized ``ExpertLayout``, or None for dense experts
    (their slot tensors are the weights); ``transposed``: the experts module's
    ``is_transposed`` (gpt-oss: [in, out] weights, with biases).

    Raises:
        ValueError: an experts module without a fused gate_up (e.g. a separate up_proj), or
            slots that do not match the layout (names the tensor and the flag).
        NotImplementedError: a format without a ``WeightPacking`` (names the format).
    """
    if layout is None:
        specs = tuple(TensorSpec(name, tuple(t.shape[1:]), t.dtype) for name, t in slots.items()
                      if not name.endswith("_bias"))
        layout = DenseFormat().layout(specs, transposed=transposed)
    weights = {t.dense.name: t for t in layout.tensors}
    missing = [name for name in PROJECTIONS if name not in weights]
    if missing:
        raise ValueError(f"--experts-implementation fused computes experts with gate_up_proj and down_proj; this "
                         f"layer has {sorted(weights)} (missing {missing}): use --experts-implementation grouped_mm")
    return {name: ProjectionRows.from_tables(layout.format.packing(weights[name], transposed=transposed), slots,
                                             bias=slots.get(f"{name}_bias"))
            for name in PROJECTIONS}


def layer_rows(setup, *, transposed: bool, device: torch.device) -> dict[str, ProjectionRows]:
    """The rows a layer's steps address: the K slot rows (``slot_rows``), and with
    ``setup.in_place`` the store's E host rows after them (``ProjectionRows.join``: row K + e is
    expert e in place; the store's tensors as a device-side gather reads them, page-locked and
    mapped on CUDA: ``storage.host_store.ExpertStore.gather_source``)."""
    rows = slot_rows(setup.layout, setup.slots.kernel_tensors(()), transposed=transposed)
    if not setup.in_place:
        return rows
    host = slot_rows(setup.layout, setup.store.gather_source(device), transposed=transposed)
    return {name: rows[name].join(host[name]) for name in PROJECTIONS}


@dataclass(frozen=True)
class PreparedGemm:
    """One projection's GEMM for steps of S entries over fixed rows, built once per layer and
    step shape (``prepare_gemm``: ``kernels.fused_moe.gemm_arguments``, the target and the grid
    bound; never per step). ``launch(a_ptr=a, c_ptr=c, alignment=(sorted entries, block rows,
    padded count), stride_am=, stride_cm=)`` runs it (the kernel's launcher with every other
    argument bound: a ``functools.partial``, no Python frame of its own); ``out_features`` N
    and ``dense_dtype``: the output's [S, N] and dtype."""

    launch: Callable
    out_features: int
    dense_dtype: torch.dtype


def prepare_gemm(rows: ProjectionRows, *, align: AlignLaunch, a_row_div: int) -> PreparedGemm:
    """The ``PreparedGemm`` of ``rows`` for the steps ``align`` aligns (its S, R, BLOCK_M; its
    capacity gives the grid), tiles as ``kernels.fused_moe.choose_blocks`` chooses them for S.

    Raises:
        ValueError: triton missing, or a CPU device without ``TRITON_INTERPRET=1``."""
    packing = rows.packing
    blocks = FusedBlocks(block_m=align.block_m, block_in=choose_blocks(align.num_entries, packing).block_in)
    args, constexprs, options = gemm_arguments(rows, align.num_entries, align.block_m, a_row_div=a_row_div,
                                               blocks=blocks, target=KernelTarget.of(rows.device))
    grid = (align.capacity // align.block_m, triton.cdiv(packing.out_features, blocks.block_out))
    launch = functools.partial(kernels.fused_moe_gemm_kernel[grid], **args, **constexprs, **options)
    return PreparedGemm(launch, packing.out_features, packing.dense_dtype)


@dataclass(frozen=True)
class FusedLaunches:
    """The launches of a step of S entries: the align over the rows, the gate-up GEMM (entry s
    reads hidden row s // k) and the down GEMM (entry s reads row s). ``entries`` runs them: what
    a wave of the paged step computes, and what the kernel tests drive."""

    align: AlignLaunch
    gate_up: PreparedGemm
    down: PreparedGemm

    @classmethod
    def of(cls, gate_up: ProjectionRows, down: ProjectionRows, *, num_entries: int, top_k: int) -> "FusedLaunches":
        """The launches of steps of S = ``num_entries`` entries, ``top_k`` per token, over the
        rows ``gate_up`` and ``down`` (one row id addresses both).

        Raises:
            ValueError: the two projections have different row counts; triton missing, or a CPU
                device without ``TRITON_INTERPRET=1``."""
        if gate_up.num_rows != down.num_rows:
            raise ValueError(f"gate_up has {gate_up.num_rows} rows, down {down.num_rows}: one row id must address both")
        align = AlignLaunch.of(num_entries, gate_up.num_rows, block_m_for(num_entries))
        return cls(align, prepare_gemm(gate_up, align=align, a_row_div=top_k), prepare_gemm(down, align=align, a_row_div=1))

    def entries(self, hidden: torch.Tensor, row_ids: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor]):
        """[S, H] in the down GEMM's dense dtype: the unweighted output of every entry (flat s =
        t k + j) whose row id (``row_ids`` [T, k] or [S] int64) is not negative; the rows of the
        others are not written (whatever the buffer held). ``hidden`` [T, H] in the gate-up GEMM's
        dense dtype; ``gate`` the experts module's ([S, 2I] -> [S, I]). No host sync."""
        alignment = self.align(row_ids)
        up = _gemm(self.gate_up, hidden, alignment)
        return _gemm(self.down, gate(up), alignment)


@dataclass
class FusedWork:
    """One step: hidden [T, H] in the experts' dense dtype, the step's output dtype (the
    input's), its routing and launches, the module's gate and optional post-expert norm, and
    the entry outputs [S, H] (zeros until a wave writes them)."""

    hidden: torch.Tensor
    dtype: torch.dtype
    routing: DeviceRouting
    launches: FusedLaunches
    gate: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None
    entry_out: torch.Tensor | None = None


class FusedStep(LayerStep):
    """``fused``: the wave's entries computed from the packed slot rows (module docstring);
    with ``SlotSetup.in_place``, the slot rows joined with the host store's (row K + e). Its
    kernels read the slot table's kernel tensors (the plain table's: the store's rows as they
    are) through address tables built at the first step, so a wave asks the table nothing."""

    planned = "device"
    reads_in_place = True  # reads host rows K + e when the setup says so (--beyond-k in-place)

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.rows: dict[str, ProjectionRows] | None = None  # the slots' address tables, at the first step
        self.launches: dict[int, FusedLaunches] = {}  # S -> its launches

    def begin(self, module, hidden, top_k_index, routing: DeviceRouting) -> FusedWork:
        num_entries = top_k_index.numel()
        launches = self.launches.get(num_entries) or self._prepare(module, hidden, top_k_index)
        dense_dtype = launches.gate_up.dense_dtype
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        return FusedWork(hidden.to(dense_dtype), hidden.dtype, routing, launches,  # as grouped_mm casts
                         module._apply_gate if module.has_gate else module.act_fn, norm)

    def run_wave(self, work: FusedWork, wave: int, slot_map=None) -> None:
        routing = work.routing
        in_wave = (routing.entry_wave == wave).unsqueeze(1)
        out = work.launches.entries(work.hidden, torch.where(in_wave[:, 0], routing.entry_slot, -1), work.gate)
        if work.post_norm is not None:
            out = work.post_norm(out)
        if work.entry_out is None:
            work.entry_out = out.new_zeros(out.shape)
        work.entry_out = torch.where(in_wave, out, work.entry_out)

    def combine(self, work: FusedWork, top_k_weights) -> torch.Tensor:
        """[T, H] in the input's dtype: (entries x weights).sum over k, as ``grouped_mm`` ends."""
        num_tokens, top_k = top_k_weights.shape
        weighted = work.entry_out.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(work.dtype)

    def _prepare(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor) -> FusedLaunches:
        """The launches of steps shaped as ``top_k_index`` [T, k] (and, at the layer's first
        step, the slots' address tables); kept, at most MAX_SHAPES shapes.

        Raises:
            ValueError: hidden [T, H] whose H is not what the rows read and write, or rows on
                another device (names both)."""
        if self.rows is None:
            self.rows = layer_rows(self.setup, transposed=bool(module.is_transposed), device=hidden.device)
        gate_up, down = self.rows["gate_up_proj"], self.rows["down_proj"]
        num_entries, top_k = top_k_index.numel(), top_k_index.shape[1]
        if not gate_up.packing.in_features == down.packing.out_features == hidden.shape[1] or \
                gate_up.device != hidden.device:
            raise ValueError(f"hidden {tuple(hidden.shape)} on {hidden.device}: the fused rows read "
                             f"{gate_up.packing.in_features} and write {down.packing.out_features} features on "
                             f"{gate_up.device}")
        launches = FusedLaunches.of(gate_up, down, num_entries=num_entries, top_k=top_k)
        if len(self.launches) >= MAX_SHAPES:
            del self.launches[next(iter(self.launches))]
        self.launches[num_entries] = launches
        return launches

    def wave_view(self, module, wave_slots) -> SlotView:
        """The module over the packed slots, carrying ``fused_rows`` (the address tables the
        kernels read; the independence check dequantizes a slot through them)."""
        tensors = self.setup.slots.kernel_tensors(())
        view = SlotView(module, tensors)
        view.fused_rows = self.rows or slot_rows(self.setup.layout, tensors, transposed=bool(module.is_transposed))
        return view


def _gemm(gemm: PreparedGemm, a: torch.Tensor, alignment) -> torch.Tensor:
    """[S, N] in the GEMM's dense dtype: ``gemm`` over ``a`` [M, in] (made contiguous)."""
    a = a.contiguous()
    c = torch.empty((alignment.num_entries, gemm.out_features), dtype=gemm.dense_dtype, device=a.device)
    gemm.launch(a_ptr=a, c_ptr=c, alignment=(alignment.sorted_entry, alignment.block_row, alignment.num_padded),
                stride_am=a.stride(0), stride_cm=c.stride(0))
    return c
