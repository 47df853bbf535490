"""The CPU host path's grouped_mm step: the slots read in place, only the routed slots' span.

A decode step whose routed experts all fit in K runs one wave; on CPU ``HostGroupedStep`` then
runs transformers' ``grouped_mm`` over a view of the slot tensors from the wave's lowest slot
to its highest (groups in slot order), gathering no expert weight, when its experts are as large
as a real model's (here: ``GATHER_MAX_BYTES`` set to 0; small experts are gathered instead,
tests/paging/test_host_grouped_gather.py). These tests pin down that
the weights handed to the kernel are the slot table's own storage and that the groups span only
the routed slots (the bench's speed depends on it: exactness alone would not notice a gather
or a fall-back to all K groups), and that output and counters equal the reference's: the
logits of the plain transformers model, and hits/misses/waves counted by hand from the plan.

Legend: E = 16 routed experts, k = 2 (top_k), K slots.
"""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.moe as moe

import pagedexperts
from support.tiny import E, TOP_K, assert_same
from pagedexperts.paging.steps import host_grouped

pytestmark = pytest.mark.default_threads


def _decode(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits [steps, V] of a greedy decode after the prefill of ``ids`` [1, P]."""
    out = []
    with torch.inference_mode():
        mask = torch.ones_like(ids)
        res = model(input_ids=ids, attention_mask=mask, use_cache=True)
        for _ in range(steps):
            tok = res.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
            res = model(input_ids=tok, attention_mask=mask, past_key_values=res.past_key_values, use_cache=True)
            out.append(res.logits[:, -1])
    return torch.cat(out)


@pytest.mark.parametrize("k_slots", [E, E // 2])
def test_single_wave_decode_reads_the_slots_in_place(tiny_moe_dir, reference_model, monkeypatch, k_slots):
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = _decode(reference_model(), ids, 8)
    monkeypatch.setattr(host_grouped, "GATHER_MAX_BYTES", 0)  # experts as large as a real model's
    paged, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=k_slots, experts_implementation="grouped_mm",
                                       check_independence=False)
    routed: dict[int, list[set]] = {}  # layer -> each step's distinct experts, read by the trace hook
    def trace(layer, step_ids, _weights):
        routed.setdefault(layer, []).append(set(step_ids.flatten().tolist()))

    for runner in paged.pagedexperts.runners.values():
        runner.trace_hook = trace
    groups, original = [], moe._grouped_linear

    slot_storage = {r.slots[name].untyped_storage().data_ptr()
                    for r in paged.pagedexperts.runners.values() for name in r.slots}

    def recording(input, weight, offs, bias=None, is_transposed=False):
        in_place = weight.untyped_storage().data_ptr() in slot_storage
        groups.append((input.shape[0], weight.shape[0], in_place))
        return original(input, weight, offs, bias=bias, is_transposed=is_transposed)

    monkeypatch.setattr(moe, "_grouped_linear", recording)
    assert_same(_decode(paged.eval(), ids, 8), expected, "decode logits")
    assert all(in_place for *_, in_place in groups)  # no gathered copy of a slot row
    decode_groups = [g for rows, g, _ in groups if rows == TOP_K]  # one token: S = k rows
    assert len(decode_groups) == 2 * 8 * len(routed)  # up and down, 8 steps, every layer
    stats = paged.pagedexperts.stats()
    # the routed slots' span: at least the k routed experts, at most K, and not always all K
    assert TOP_K <= min(decode_groups) and max(decode_groups) <= k_slots
    assert sum(decode_groups) < len(decode_groups) * k_slots
    for layer, steps in routed.items():
        s = stats.layers[layer]
        assert s.union_sum == sum(map(len, steps))
        if k_slots == E:  # nothing evicted: one miss per expert the layer ever routes to
            assert (s.misses, s.waves) == (len(set().union(*steps)), len(steps))
