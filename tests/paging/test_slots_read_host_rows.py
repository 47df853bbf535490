"""On a CPU a packed slot reads its expert's host row in place (issue 46): no copy at page-in.

Both tables are host memory on a CPU, so ``CpuPackedSlots.hold_rows`` points a slot at the host
row when the row is already in the kernels' layout (a full store converted at load, or the disk
tier over a stored kernel layout). Oracles, computed independently of the paging under test:
- where a slot reads: its rows share storage with the full store's row of the expert the
  residency says it holds (``data_ptr``), and ``zero_copy_page_ins`` counts every page-in;
- what a slot reads: after every forward, each resident expert's slot rows equal (torch.equal)
  that expert's rows in an all-resident model's store, converted at load from the checkpoint;
  with one host row per layer and K = 2 the disk tier reuses rows that slots read on nearly
  every miss, so a row overwritten under a slot shows here;
- the logits: torch.equal to all E resident, batch 3, float32 and bfloat16, read-ahead on and off.
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.loading.loader import load_model
from support.paths import DATA
from support.tiny import greedy_logits, host_budget_gb

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"  # E = 8, top_k = 2


def _ids() -> torch.Tensor:
    return torch.randint(2, 100, (3, 5), generator=torch.Generator().manual_seed(11))


def _all_resident(dtype: str):
    model, _ = load_model(INT4, num_resident=8, dtype=dtype, experts_implementation="packed")
    return model.eval()


def _assert_slots_hold_their_experts(model, oracle) -> int:
    """Every resident expert's slot rows torch.equal to its rows in ``oracle``'s full store; the
    number of (layer, expert) pairs checked."""
    checked = 0
    for site in model.pagedexperts.sites:
        runner, want = model.pagedexperts.runners[site.layer], oracle.pagedexperts.stores[site.name].tensors
        for expert, slot in runner.residency.resident().items():
            rows = runner.slots.slot_rows[slot]
            for name, table in want.items():
                assert torch.equal(rows[name], table[expert]), (site.layer, expert, slot, name)
            checked += 1
    return checked


@pytest.mark.default_threads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_full_store_page_in_points_the_slot_at_the_store_row(dtype):
    model, _ = load_model(INT4, num_resident=3, dtype=dtype, experts_implementation="packed")
    rt = model.eval().pagedexperts
    assert not rt.host_memory.disk_tier
    greedy_logits(model, _ids(), steps=3)
    for site in rt.sites:
        runner, store = rt.runners[site.layer], rt.stores[site.name]
        for expert, slot in runner.residency.resident().items():
            for name, table in store.tensors.items():
                assert runner.slots.slot_rows[slot][name].data_ptr() == table[expert].data_ptr(), (expert, name)
    totals = rt.stats().as_dict()
    assert totals["page_ins"] > 0 and totals["zero_copy_page_ins"] == totals["page_ins"]


@pytest.mark.default_threads
@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_slot_keeps_its_expert_when_the_disk_tier_reuses_its_host_row(tmp_path, dtype, read_ahead):
    oracle = _all_resident(dtype)
    budget = host_budget_gb(INT4, 1, num_resident=2, dtype=dtype, experts_implementation="packed")
    tiered, _ = load_model(INT4, num_resident=2, dtype=dtype, experts_implementation="packed",
                           host_memory_gb=budget, stored_layout_dir=str(tmp_path), read_ahead=read_ahead)
    tiered.eval()
    rt = tiered.pagedexperts
    assert rt.host_memory.disk_tier and rt.host_memory.host_rows <= 2, rt.host_memory.host_rows
    ids, checked = _ids(), 0
    with torch.no_grad():
        for length in range(2, ids.shape[1] + 1):  # forwards of growing prompts: each routes anew
            tiered(input_ids=ids[:, :length])
            checked += _assert_slots_hold_their_experts(tiered, oracle)
    assert checked > 0
    assert torch.equal(greedy_logits(tiered, ids, steps=4), greedy_logits(oracle, ids, steps=4))
    totals = rt.stats().as_dict()
    assert totals["zero_copy_page_ins"] == totals["page_ins"] > 0  # every row is in the kernels' layout
    assert totals["host_misses"] > 0  # rows were reused under the slots
    assert (totals["read_ahead_issued"] > 0) == read_ahead


def test_the_start_up_check_sees_a_page_in_that_moves_another_slot(monkeypatch):
    """The independence check compares what each slot reads: a page-in that also repoints another
    slot (here at the same rows) is refused at load, naming it."""
    from pagedexperts.formats.cpu_pack import CpuPackedSlots
    from pagedexperts.loading.independence import IndependenceError

    original = CpuPackedSlots.hold_rows

    def also_the_next_slot(self, rows, slot, *, pinned):
        original(self, rows, (slot + 1) % len(self.slot_rows), pinned=pinned)
        return original(self, rows, slot, pinned=pinned)

    monkeypatch.setattr(CpuPackedSlots, "hold_rows", also_the_next_slot)
    with pytest.raises(IndependenceError, match="paged into slot 0: the page-in also changed what another slot reads"):
        load_model(INT4, num_resident=3, dtype="float32", experts_implementation="packed", check_independence=True)


def test_the_start_up_check_sees_a_slot_reading_another_experts_row(monkeypatch):
    from pagedexperts.loading.independence import IndependenceError
    from pagedexperts.storage.host_store import HostExpertStore

    def the_next_expert(self, expert, slot, slots):
        slots.hold_rows({name: t[(expert + 1) % self.num_experts] for name, t in self.tensors.items()}, slot, pinned=False)

    monkeypatch.setattr(HostExpertStore, "copy_to_slot", the_next_expert)
    with pytest.raises(IndependenceError, match="expert 0 paged into slot 0: the kernel would read"):
        load_model(INT4, num_resident=3, dtype="float32", experts_implementation="packed", check_independence=True)


@pytest.mark.default_threads
def test_prefetched_page_ins_are_not_counted_as_the_steps_zero_copy_page_ins():
    """``zero_copy_page_ins`` counts page-ins of the steps (a part of ``page_ins``); a prefetch's page-ins
    are the prefetch stats' ``issued``. With a full store every step page-in is read in place, so the
    two counters are equal with --prefetch as without (the prefetch's were added: 217% of page-ins)."""
    model, _ = load_model(INT4, num_resident=3, dtype="bfloat16", experts_implementation="packed", prefetch=True)
    rt = model.eval().pagedexperts
    greedy_logits(model, _ids(), steps=4)
    totals = rt.stats().as_dict()
    assert rt.prefetch_stats()["total"]["issued"] > 0
    assert totals["page_ins"] > 0 and totals["zero_copy_page_ins"] == totals["page_ins"]
