"""The wave-compute contract of a paged layer-step, and the host-planned steps that implement it.

Owns the contract both layer-step executors compute through (neither defines it): ``SlotView``
(the experts module as the inner kernel sees it over the [K, ...] slot tensors), ``StepEntries``
(one step's per-(token, k) entry outputs [T, k, H], unweighted; ``run_wave(view, wave,
slot_map)``, one signature for both paths, fills one wave's entries; ``combine`` weights and
sums them exactly as the unpaged implementation does) and the pieces every step reuses
(``activate``, ``post_expert_norm``, ``in_reference_layout``, ``up_and_down_weights``); and
the host-planned steps (``HostStep``: the waves and the read-back ids known on the host):
``GroupedStep``, ``BatchedStep``, ``EagerStep``. The device-planned steps are
``paging.device_layout``; which step runs which experts implementation, the table, is
``paging.inner``. Does not: page anything in or decide residency (``paging.transfer``,
``residency``).

Why not simply call transformers' experts function on the slot ids: on CPU with more than one
thread, a GEMM row's bits depend on the row's index inside its expert's group, and
``grouped_mm``'s ``torch.sort`` of the ids is not stable, so slot ids (a different key order)
give each group another row order than expert ids do. And the activation (SiLU, sigmoid) runs a
vectorised body and a scalar tail whose results differ in the last bit; which elements fall in
the tail depends on the buffer's size, its row order and the threads' chunk boundaries. So
every kernel here is handed exactly the unpaged model's layout (measured, see
docs/exactness.md):

- ``grouped_mm``: the reference's own ``torch.sort`` of the flat expert ids gives its row
  order; a wave's rows are regrouped stably by slot (groups in slot order, rows inside a group
  in the reference's order; a group's position in the buffer does not change its bits), padded
  to the reference's S rows (rows past the last offset are not computed), and run through
  transformers' ``_grouped_linear`` over the slot tensors in place (the slots are the groups:
  no weight is gathered, nothing weight-sized is allocated per step; on CPU only the slots from
  the wave's lowest to its highest, a view). ``batched_mm``: entries in the
  reference's token-major order through ``_batched_linear`` (a one-entry wave is padded to two: a batch of one takes
  another CPU kernel). Both apply the module's own ``_apply_gate`` / ``act_fn`` (and post-expert
  norm) to a buffer of the reference's full [S, ...] shape with each wave row at its reference
  position, so every element takes the same vector or scalar path as in the unpaged run.
- ``eager``: the class's own per-expert loop over the entries (each as a token with top_k 1, in
  the k-major order its one_hot mask visits them): an expert's rows are the same rows in the
  same order as unpaged, since all of one expert's entries are in one wave.

The routing weights are applied afterwards with the same elementwise product as the reference
(``proj_out * weight``, in the promoted dtype), and the k entries of a token are summed in the
implementation's order: one ``sum(dim=1)`` (grouped_mm, batched_mm) or one by one in ascending
expert id (eager's ``index_add_`` loop). Source: transformers.integrations.moe
(``grouped_mm_experts_forward``, ``batched_mm_experts_forward``), 5.17 to 5.24, read line by line.

Syncs: none. A wave's rows are found on the host from the step's read-back ids [T, k] (for
grouped_mm: expert e's rows sit at [start_e, start_e + count_e) of the reference's sorted order,
whatever the sort did inside) and uploaded; nothing is read back from the device.

Legend: T tokens, H hidden, I expert intermediate, k top_k, E experts, K slots, S = T * k
entries, S_w entries of one wave.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from pagedexperts.paging.transfer import upload


class SlotView:
    """Stand-in for an experts module during one wave: the module's own attributes and methods,
    except that the per-expert tensors are the [K, ...] slot tensors and ``num_experts`` is K.
    """

    def __init__(self, module: torch.nn.Module, slots: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(slots)
        self.num_experts = next(iter(slots.values())).shape[0]
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def activate(view, proj: torch.Tensor) -> torch.Tensor:
    """The module's gating (``_apply_gate``: e.g. SiLU(gate) * up) or plain activation:
    [N, 2I] or [N, I] -> [N, I], as transformers' experts functions apply it."""
    return view._apply_gate(proj) if view.has_gate else view.act_fn(proj)


def post_expert_norm(view, proj: torch.Tensor) -> torch.Tensor:
    """The module's optional post-expert norm (transformers >= 5.24 ``has_post_expert_norm``)."""
    return view.post_expert_norm(proj) if getattr(view, "has_post_expert_norm", False) else proj


def in_reference_layout(fn: Callable, rows: torch.Tensor, positions: torch.Tensor | None, num_rows: int):
    """``fn`` applied to ``rows`` [S_w, D] as if each sat at ``positions`` [S_w] of a [num_rows, D]
    buffer (the unpaged buffer's shape); the other rows are zeros, computed and dropped.
    ``positions`` None: ``rows`` already is that buffer."""
    if positions is None:
        return fn(rows)
    full = rows.new_zeros((num_rows, rows.shape[1]))
    full[positions] = rows
    return fn(full)[positions]


def up_and_down_weights(view) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(up or gate_up weights [K, ...], their bias [K, ...] or None, down weights, down bias)."""
    up = view.gate_up_proj if view.has_gate else view.up_proj
    up_bias = (view.gate_up_proj_bias if view.has_gate else view.up_proj_bias) if view.has_bias else None
    down_bias = view.down_proj_bias if view.has_bias else None
    return up, up_bias, view.down_proj, down_bias


class StepEntries:
    """One step's entries: hidden [T, H] and top_k_index [T, k] (expert ids, on the device).
    ``run_wave`` fills the unweighted outputs of one wave's entries ([S, H], flat entry
    s = t * k + j); ``combine`` weights and sums them -> [T, H].

    Attributes:
        needs_slot_map: whether ``run_wave`` reads a slot map (the host executor then hands it
            one from ``transfer.SlotTransfers.slot_map``; else None).
    """

    needs_slot_map = False

    def __init__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        self.module = module
        self.hidden = hidden
        self.top_k_index = top_k_index
        self.num_tokens, self.top_k = top_k_index.shape
        self.num_entries = self.num_tokens * self.top_k
        self.entry_out: torch.Tensor | None = None  # [S, H] unweighted, flat entry s = t * k + j

    def _store(self, entries: torch.Tensor | None, out: torch.Tensor) -> None:
        """Write ``out`` [S_w, H] at flat entry indices ``entries`` (None: all, in order)."""
        if entries is None:
            self.entry_out = out
            return
        if self.entry_out is None:
            self.entry_out = out.new_empty((self.num_entries, out.shape[1]))
        self.entry_out.index_copy_(0, entries, out)

    def run_wave(self, view: SlotView, wave: int, slot_map: torch.Tensor | None = None) -> None:
        """Compute the entries of wave ``wave`` (0-based, in the step's order) over ``view``
        (its slots paged in); ``slot_map`` [E] int64 maps expert ids to the wave's slots on the
        device (-1: not in the wave) when ``needs_slot_map``, else None. An empty wave leaves
        the outputs as they are."""
        raise NotImplementedError

    def combine(self, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, H] in hidden's dtype: (entries x weights).sum over k, as ``grouped_mm`` and
        ``batched_mm`` end (``weighted_out.view(T, k, H).sum(dim=1)``)."""
        entries = self.entry_out.view(self.num_tokens, self.top_k, -1)
        return (entries * top_k_weights.unsqueeze(-1)).sum(dim=1).to(self.hidden.dtype)


class HostStep(StepEntries):
    """A host-planned step: its waves (``residency.planner.Wave``: experts, slots) and its ids
    read back, ``ids_host`` [T, k] (numpy int64), are known on the host."""

    def __init__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor, ids_host: np.ndarray,
                 waves: Sequence) -> None:
        super().__init__(module, hidden, top_k_index)
        self.ids_host = ids_host
        self.waves = waves
        self.only_wave = len(waves) == 1  # the step's one wave: every entry

    def _rows_of(self, wave, entry_ids_host: np.ndarray) -> tuple[torch.Tensor, int]:
        """Rows [S_w] (on the device) of the entries routed into ``wave``, in entry order."""
        rows = np.flatnonzero(np.isin(entry_ids_host, wave.experts))
        return upload(rows, self.hidden.device), len(rows)


class GroupedStep(HostStep):
    """``grouped_mm`` in the reference's row order (module docstring)."""

    def __init__(self, module, hidden, top_k_index, ids_host, waves) -> None:
        super().__init__(module, hidden, top_k_index, ids_host, waves)
        # the reference's own call: the same (unstable, deterministic) sort of the same ids
        self.perm = torch.sort(top_k_index.reshape(-1))[1]
        self.counts = np.bincount(ids_host.reshape(-1))  # [max id + 1] rows per expert

    @property
    def starts(self) -> np.ndarray:
        """Expert e's first row in the reference's sorted order (multi-wave steps only)."""
        return np.cumsum(self.counts) - self.counts

    def _layout(self, wave, first: int, num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(reference positions [S_w] grouped by slot, group offsets [num_groups] over slots
        ``first`` .. ``first + num_groups - 1``, slot per row [S_w])."""
        experts, slots = np.asarray(wave.experts), np.asarray(wave.slots)
        by_slot = np.argsort(slots, kind="stable")
        experts, slots = experts[by_slot], slots[by_slot]
        lengths = self.counts[experts]
        group_start = np.cumsum(lengths) - lengths
        pos = np.arange(int(lengths.sum())) + np.repeat(self.starts[experts] - group_start, lengths)
        per_slot = np.zeros(num_groups, dtype=np.int64)
        per_slot[slots - first] = lengths
        return pos, np.cumsum(per_slot), np.repeat(slots, lengths)

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        """The wave's entries through ``_grouped_linear`` over the slot tensors in place (no
        gather of weights: the groups are the slots, a wave's rows regrouped by slot). On CUDA
        the groups are all K slots (the kernel's shapes do not change from step to step); on
        CPU only the slots from the wave's lowest to its highest (a view: CPU ``grouped_mm``
        visits every group, ~2.5 us each). The activation and the post-expert norm run in the
        reference's row order (``in_reference_layout``; skipped when the slot order already is
        the reference's), so every element takes the path it takes unpaged."""
        from transformers.integrations.moe import _grouped_linear

        planned = self.waves[wave]  # its rows and groups come from the host's ids and its slots
        dev = self.hidden.device
        first, num_groups = 0, view.num_experts
        if dev.type == "cpu":
            first = min(planned.slots)
            num_groups = max(planned.slots) - first + 1
        pos_host, offsets_host, slots_host = self._layout(planned, first, num_groups)
        n = len(pos_host)
        in_order = self.only_wave and bool((pos_host == np.arange(n)).all())
        pos_w = None if in_order else upload(pos_host, dev)
        offsets = upload(offsets_host, dev).to(torch.int32)
        up_w, up_b, down_w, down_b = (None if w is None else w[first : first + num_groups]
                                      for w in up_and_down_weights(view))
        slots_w = upload(slots_host - first, dev) if view.has_bias else None
        rows = self.perm if in_order else self.perm[pos_w]
        x = self._padded(self.hidden.index_select(0, rows // self.top_k))
        up = _grouped_linear(x, up_w, offsets, is_transposed=view.is_transposed)[:n]
        if up_b is not None:
            up.add_(up_b[slots_w])
        act = in_reference_layout(lambda p: activate(view, p), up, pos_w, self.num_entries)
        down = _grouped_linear(self._padded(act), down_w, offsets, is_transposed=view.is_transposed)[:n]
        if down_b is not None:
            down.add_(down_b[slots_w])
        down = in_reference_layout(lambda p: post_expert_norm(view, p), down, pos_w, self.num_entries)
        self._store(rows, down)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [S_w, D] in a [S, D] buffer: the kernel sees the reference's row count
        (CUDA picks its tile config from it); rows past the last offset are not computed."""
        if rows.shape[0] == self.num_entries:
            return rows
        out = rows.new_empty((self.num_entries, rows.shape[1]))
        out[: rows.shape[0]] = rows
        return out


class BatchedStep(HostStep):
    """``batched_mm`` in the reference's token-major entry order (module docstring)."""

    needs_slot_map = True

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        from transformers.integrations.moe import _batched_linear

        ids = slot_map[self.top_k_index.reshape(-1)]  # [S] slot per entry, -1: other wave
        if self.only_wave:
            entries, run, n = None, ids, self.num_entries
            x = self.hidden.repeat_interleave(self.top_k, dim=0)
        else:
            entries, n = self._rows_of(self.waves[wave], self.ids_host.reshape(-1))
            # torch.bmm of a batch of one takes another CPU kernel: pad with a copy, drop it after
            run_rows = entries.repeat(2) if n == 1 and self.num_entries > 1 else entries
            run = ids[run_rows]
            x = self.hidden[run_rows // self.top_k]
        up_w, up_b, down_w, down_b = up_and_down_weights(view)
        bias = up_b[run] if up_b is not None else None
        up = _batched_linear(x, up_w[run], bias=bias, is_transposed=view.is_transposed)[:n]
        act = in_reference_layout(lambda p: activate(view, p), up, entries, self.num_entries)
        if run.shape[0] != n:
            act = act.repeat(2, 1)
        bias = down_b[run] if down_b is not None else None
        down = _batched_linear(act, down_w[run], bias=bias, is_transposed=view.is_transposed)[:n]
        down = in_reference_layout(lambda p: post_expert_norm(view, p), down, entries, self.num_entries)
        self._store(entries, down)


class EagerStep(HostStep):
    """``eager``: the class's own loop over the entries, k-major (module docstring)."""

    needs_slot_map = True

    def __init__(self, module, hidden, top_k_index, ids_host, waves) -> None:
        super().__init__(module, hidden, top_k_index, ids_host, waves)
        self.loop = type(module).forward.__wrapped__
        self.entry_hidden = hidden.repeat(self.top_k, 1)  # [k * T, H], entry j * T + t
        self.entry_ids = top_k_index.t().reshape(-1, 1)
        self.unit = torch.ones_like(self.entry_ids, dtype=hidden.dtype)  # weights applied in combine

    def run_wave(self, view, wave: int, slot_map=None) -> None:
        slots = slot_map[self.entry_ids]
        if self.only_wave:
            self._store(None, self.loop(view, self.entry_hidden, slots, self.unit))
            return
        rows, _ = self._rows_of(self.waves[wave], self.ids_host.T.reshape(-1))
        self._store(rows, self.loop(view, self.entry_hidden[rows], slots[rows], self.unit[rows]))

    def combine(self, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, H]: each entry weighted, then added to zeros one by one in ascending expert id
        per token, in hidden's dtype (eager's ``index_add_`` loop over experts)."""
        dtype = self.hidden.dtype
        entries = self.entry_out.view(self.top_k, self.num_tokens, -1).transpose(0, 1)
        weighted = entries * top_k_weights.unsqueeze(-1)
        order = torch.argsort(self.top_k_index, dim=1, stable=True)  # ascending expert id per token
        ordered = torch.gather(weighted, 1, order.unsqueeze(-1).expand_as(weighted))
        out = torch.zeros(weighted.shape[0], weighted.shape[2], dtype=dtype, device=weighted.device)
        for j in range(self.top_k):
            out = out + ordered[:, j].to(dtype)
        return out
