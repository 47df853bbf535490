"""The CPU host path's grouped_mm step chooses its layout by expert size (issue 38 item 4).

A CPU step's one wave whose experts take at most ``host_grouped.GATHER_MAX_BYTES`` together
gathers them (one group per routed expert, ascending id: the unpaged model's own layout without
its empty groups); any other wave reads the slot tensors in place (tests/paging/test_host_fast_path.py).
These tests pin down which layout each step takes, from the weights handed to the kernel (the
slot table's storage or not) and its group count, counted against the routing read by the trace
hook; and that either layout gives the plain transformers model's logits bit for bit (bf16 and
fp32, batch > 1, default threads) with the same counters.

Legend: E = 16 routed experts, k = 2 (top_k), K slots, U distinct experts of a step.
"""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.moe as moe

import pagedexperts
from support.tiny import E, TOP_K, assert_same
from pagedexperts.paging.steps import host_grouped

pytestmark = pytest.mark.default_threads

COUNTED = ("steps", "tokens", "hits", "misses", "page_ins", "bytes_paged", "waves", "multi_wave_steps", "union_sum")


def _run(path, monkeypatch, *, k_slots: int, dtype: str, ids: torch.Tensor, steps: int):
    """Greedy decode of ``ids`` [B, P] paged: (logits [steps, B, V], each decode layer-step's U
    in order, the kernel calls (rows, groups, weights are slot storage), the counters)."""
    paged, _ = pagedexperts.load_model(path, num_resident=k_slots, experts_implementation="grouped_mm",
                                       dtype=dtype, check_independence=False)
    union_sizes: list[int] = []

    def trace(layer, step_ids, _weights):
        union_sizes.append(len(set(step_ids.flatten().tolist())))

    for runner in paged.pagedexperts.runners.values():
        runner.trace_hook = trace
    slot_storage = {r.slots[n].untyped_storage().data_ptr() for r in paged.pagedexperts.runners.values()
                    for n in r.slots}
    calls, original = [], moe._grouped_linear

    def recording(input, weight, offs, bias=None, is_transposed=False):
        calls.append((input.shape[0], weight.shape[0], weight.untyped_storage().data_ptr() in slot_storage))
        return original(input, weight, offs, bias=bias, is_transposed=is_transposed)

    monkeypatch.setattr(moe, "_grouped_linear", recording)
    logits = []
    with torch.inference_mode():
        res = paged(input_ids=ids, use_cache=True)
        for _ in range(steps):
            res = paged(input_ids=res.logits[:, -1:].argmax(-1), past_key_values=res.past_key_values, use_cache=True)
            logits.append(res.logits[:, -1])
    monkeypatch.setattr(moe, "_grouped_linear", original)
    stats = paged.pagedexperts.stats().total()
    decode_unions = union_sizes[len(paged.pagedexperts.runners):]  # after the prefill's layer-steps
    return torch.stack(logits), decode_unions, calls, {f: getattr(stats, f) for f in COUNTED}


def _reference(reference_model, dtype: str, ids: torch.Tensor, steps: int) -> torch.Tensor:
    model, logits = reference_model(dtype=dtype), []
    with torch.inference_mode():
        res = model(input_ids=ids, use_cache=True)
        for _ in range(steps):
            res = model(input_ids=res.logits[:, -1:].argmax(-1), past_key_values=res.past_key_values, use_cache=True)
            logits.append(res.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_experts_are_gathered_and_exact_either_way(tiny_moe_dir, reference_model, monkeypatch, dtype):
    """K = E / 2, batch 3: the decode steps (one wave each) gather exactly their U experts, a
    prefill's multi-wave step reads the slots in place (each of its waves, up and down); forcing every wave in place gives the same
    logits (the reference's) and the same counters."""
    ids = torch.randint(2, 100, (3, 7), generator=torch.Generator().manual_seed(5))
    steps = 6
    expected = _reference(reference_model, dtype, ids, steps)
    logits, unions, calls, counters = _run(tiny_moe_dir, monkeypatch, k_slots=E // 2, dtype=dtype, ids=ids, steps=steps)
    assert_same(logits, expected, f"{dtype} decode logits, gathered")
    decode = [c for c in calls if c[0] == 3 * TOP_K]  # one token a row: S = B k rows
    assert max(unions) <= E // 2  # every decode step is one wave (U <= B k = 6 <= K)
    assert [g for _, g, _ in decode] == [u for u in unions for _ in (0, 1)]  # up, down: U groups each
    assert not any(in_place for *_, in_place in decode)  # gathered copies, not the slots
    prefill = [c for c in calls if c[0] == 3 * 7 * TOP_K]
    stats_waves = counters["waves"] - counters["steps"]  # waves beyond the first, all in the prefill
    assert stats_waves > 0 and sum(in_place for *_, in_place in prefill) >= 2 * (stats_waves + 1)  # multi-wave: in place

    monkeypatch.setattr(host_grouped, "GATHER_MAX_BYTES", 0)
    logits_in_place, _, calls_in_place, counters_in_place = _run(tiny_moe_dir, monkeypatch, k_slots=E // 2,
                                                                 dtype=dtype, ids=ids, steps=steps)
    assert all(in_place for *_, in_place in calls_in_place)
    assert_same(logits_in_place, expected, f"{dtype} decode logits, in place")
    assert counters_in_place == counters


def test_the_choice_is_by_the_wave_s_expert_bytes(tiny_moe_dir, monkeypatch):
    """Batch 1 decode at K = E (every step one wave of U = k experts): a bound of exactly k
    experts' bytes gathers, one byte less reads in place."""
    ids = torch.randint(2, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    paged, _ = pagedexperts.load_model(tiny_moe_dir, num_resident=E, experts_implementation="grouped_mm",
                                       check_independence=False)
    w = next(iter(paged.pagedexperts.runners.values())).slots
    expert_bytes = sum(t[0].numel() * t.element_size() for t in w.values())
    for bound, gathered in ((TOP_K * expert_bytes, True), (TOP_K * expert_bytes - 1, False)):
        monkeypatch.setattr(host_grouped, "GATHER_MAX_BYTES", bound)
        _, unions, calls, _ = _run(tiny_moe_dir, monkeypatch, k_slots=E, dtype="float32", ids=ids, steps=3)
        decode = [c for c in calls if c[0] == TOP_K]
        assert decode and all(in_place != gathered for *_, in_place in decode), f"bound {bound}"
        if gathered:
            assert all(groups == TOP_K for _, groups, _ in decode)
