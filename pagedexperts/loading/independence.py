"""The start-up independence check: a paged-in expert computes with its own tensors only.

Owns: for a sample of experts of every MoE layer, page expert e into a slot through the
executor's own page-in, build what the experts kernel reads for that slot, and compare every
tensor with expert e built from the checkpoint file alone; also that no other slot changed and
that the experts module keeps no [E, ...] tensor outside the slots. Raises naming the layer,
expert and tensor (a per-expert scale, zero point or bias left out of paging: fluent, wrong
text). Does not: load (``loading.loader``) or page during inference (``paging``).
"""

from __future__ import annotations

import random

import torch

from pagedexperts.formats.base import ExpertFormat
from pagedexperts.formats.cpu_pack import CpuPackedSlots
from pagedexperts.formats.slots import DenseSlots
from pagedexperts.loading.checkpoint import KeyMap
from pagedexperts.paging.runner_contract import PagedExecutor

DEFAULT_EXPERTS_PER_LAYER = 2


class IndependenceError(ValueError):
    """A paged-in expert would compute with values that are not its own (names the tensor)."""


def check_model_independence(model, files, fmt: ExpertFormat, *, experts_per_layer: int = DEFAULT_EXPERTS_PER_LAYER, seed: int = 0) -> int:
    """Run the check on ``experts_per_layer`` experts (first, last and random) of every paged layer;
    returns the number of (layer, expert) pairs checked (0 when no layer is paged).

    Raises:
        IndependenceError: names layer, expert, slot and tensor of the first mismatch.
    """
    rt = model.pagedexperts
    paged = {s.name: (s, rt.runners[s.layer]) for s in rt.sites if isinstance(rt.runners.get(s.layer), PagedExecutor)}
    if not paged:
        return 0
    rng = random.Random(seed)
    wanted = {name: _sample(site.num_experts, experts_per_layer, rng) for name, (site, _) in paged.items()}
    specs = {name: rt.layouts[name].packed_specs if rt.layouts.get(name) else rt.stores[name].specs for name in paged}
    reference = reference_rows(files, KeyMap(model.config.model_type, {n: s for n, (s, _) in paged.items()}, fmt), specs, wanted)
    checked = 0
    with torch.no_grad():
        for name, (site, executor) in paged.items():
            check_no_module_copies(site, executor)
            for i, expert in enumerate(wanted[name]):
                check_expert(site, executor, rt.layouts[name], expert, i % executor.num_slots, reference[name][expert])
                checked += 1
    return checked


def _sample(num_experts: int, count: int, rng: random.Random) -> list[int]:
    """The first and last expert, then random others: ``count`` distinct experts at most."""
    picks = [0, num_experts - 1] + rng.sample(range(num_experts), num_experts)
    return list(dict.fromkeys(picks))[:count]


def reference_rows(files, keymap: KeyMap, specs, wanted: dict[str, list[int]]) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """{site: {expert: {packed name: row}}} of the checkpoint's packed tensors (``specs`` as the store
    was filled), read through safetensors' own reader, not the fill's byte ranges: the reference
    must not share the reader it checks.
    """
    from safetensors import safe_open

    rows = {
        name: {e: {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs[name]} for e in experts}
        for name, experts in wanted.items()
    }
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for raw_key in f.keys():
                target = keymap.expert_target(keymap.rename(raw_key))
                if target is None:
                    continue
                site, tname, expert, src_index, n_src = target
                for e in wanted.get(site.name, ()):
                    if expert is not None and expert != e:
                        continue
                    value = f.get_slice(raw_key)[e] if expert is None else f.get_tensor(raw_key)
                    dst = rows[site.name][e][tname]
                    if n_src > 1:
                        dim = next(s.concat_dim for s in specs[site.name] if s.name == tname)
                        size = dst.shape[dim] // n_src
                        dst = dst.narrow(dim, src_index * size, size)
                    dst.copy_(value)
    return rows


def check_no_module_copies(site, executor: PagedExecutor) -> None:
    """The experts module keeps no [E, ...] tensor the slots do not replace (the kernel would index it
    with slot ids). Raises IndependenceError naming the tensor.
    """
    view_names = set(executor.slots.kernel_tensors(()))
    tensors = list(site.module.named_parameters(recurse=False)) + list(site.module.named_buffers(recurse=False))
    for tname, t in tensors:
        if t.dim() > 0 and t.shape[0] == site.num_experts and tname not in view_names:
            raise IndependenceError(
                f"layer {site.layer}: per-expert tensor {tname!r} {tuple(t.shape)} of {site.name} is not "
                "paged (not in the store or the slots); a paged-in expert would read another expert's row"
            )


def check_expert(site, executor: PagedExecutor, layout, expert: int, slot: int, packed_ref: dict[str, torch.Tensor]) -> None:
    """Page ``expert`` into empty ``slot``, compare what the kernel reads with the checkpoint's expert,
    check the other slots stayed empty, then empty the slot. Raises IndependenceError naming layer,
    expert, slot and tensor.
    """
    dense_ref = layout.dequantize({n: r.unsqueeze(0) for n, r in packed_ref.items()})
    cpu_packed = isinstance(executor.slots, CpuPackedSlots)
    others = _other_slot_rows(executor.slots, slot) if cpu_packed else None
    executor.store.copy_to_slot(expert, slot, executor.slots)
    if executor.device.type == "cuda":
        torch.cuda.synchronize(executor.device)
    where = f"layer {site.layer} ({site.name}): expert {expert} paged into slot {slot}"
    if cpu_packed:  # the kernels' layouts: the rows the slot reads (its own, or host rows in place)
        table = executor.slots
        for name, row in table.convert(packed_ref).items():
            if not torch.equal(table.slot_rows[slot][name], row):
                raise IndependenceError(f"{where}: the kernel would read {name!r} that differs from the checkpoint's "
                                        "expert converted to the CPU kernel's layout")
        if _other_slot_rows(table, slot) != others:
            raise IndependenceError(f"{where}: the page-in also changed what another slot reads")
        table.slot_rows[slot] = table.own_rows[slot]  # empty again (its own row is read only once written)
        return
    try:
        view = executor.wave_view(site.module, (slot,))
    except KeyError as exc:
        raise IndependenceError(f"{where}: packed tensor {exc.args[0]!r} is not in the slots") from None
    for spec in layout.dense_specs:
        got = kernel_reads(view, spec.name, slot)
        if not torch.equal(got, dense_ref[spec.name][0].to(got.dtype)):
            raise IndependenceError(f"{where}: the kernel would read {spec.name!r} {_culprit(executor, layout, spec.name, slot, packed_ref)}")
    _empty_slot(executor, slot, where)


def _other_slot_rows(table: CpuPackedSlots, slot: int) -> list[tuple]:
    """Each other slot's rows as (the rows object, each tensor's byte sum): what its kernels read."""
    return [(id(rows), *(int(t.view(torch.uint8).sum(dtype=torch.int64)) for t in rows.values()))
            for j, rows in enumerate(table.slot_rows) if j != slot]


def _empty_slot(executor, slot: int, where: str) -> None:
    """Check that the page-in into ``slot`` changed no other slot (IndependenceError naming the
    tensor), then zero ``slot`` again.
    """
    for name, table in executor.slots.items():
        others = torch.cat([table[:slot], table[slot + 1:]])
        if others.numel() and bool(others.view(torch.uint8).any()):
            raise IndependenceError(f"{where}: the page-in also changed other slots of tensor {name!r}")
        table[slot].zero_()


def kernel_reads(view, name: str, slot: int) -> torch.Tensor:
    """Dense tensor ``name`` of ``slot`` as the experts kernel reads it, on the CPU: the view's
    tensor, or where the view carries the fused kernels' address tables (``fused_rows``:
    ``paging.steps.fused``) their own dequantization of the packed slot row (in the module's
    orientation)."""
    rows = getattr(view, "fused_rows", None)
    if rows is None or name not in rows:
        return getattr(view, name)[slot].cpu()
    from pagedexperts.paging.kernels.fused_moe import dequantize_rows

    weight = dequantize_rows(rows[name], torch.tensor([slot], device=rows[name].device))[0]
    return (weight.t() if getattr(view, "is_transposed", False) else weight).cpu()


def _culprit(executor, layout, dense_name: str, slot: int, packed_ref) -> str:
    """Which packed tensor of ``dense_name`` differs from the checkpoint in the slot."""
    qt = next(t for t in layout.tensors if t.dense.name == dense_name)
    if isinstance(executor.slots, DenseSlots) and not qt.is_passthrough:
        return "dequantized at page-in into a dense slot that differs from the checkpoint's expert"
    for spec in qt.packed:
        table = executor.slots.get(spec.name)
        if table is None:
            return f"without its packed tensor {spec.name!r} (not in the slots)"
        if not torch.equal(table[slot].cpu(), packed_ref[spec.name]):
            return f"from a packed tensor {spec.name!r} that differs from the checkpoint's expert (left out of the page-in?)"
    return "that differs from the checkpoint's expert"
