"""``loading.runners.repage`` and the read-ahead flag over a disk tier: the stores (and their host rows) outlive the runners,
so the re-attached model starts as a fresh load would. Oracles, independent of the code under test:
- every page-in of a step claims its expert's host row once (no prefetch here), so the tier's host
  accesses (hits + misses) equal the layers' ``page_ins``: counters the repage left un-zeroed break
  that equality (they kept the accesses made before it);
- the disk tier reads ahead by default (``read_ahead``); after a repage it still does, as after a load;
  with --no-read-ahead it reads nothing ahead, --prefetch or not (``read_ahead_issued`` stays 0).
"""

from __future__ import annotations

import torch

from pagedexperts.loading.loader import load_model
from pagedexperts.loading.runners import repage
from support.paths import DATA
from support.tiny import host_budget_gb

INT4 = DATA / "autoround/qwen3_moe-auto_round-experts"  # E = 8, top_k = 2


def _tiered(tmp_path):
    budget = host_budget_gb(INT4, 1, num_resident=2, dtype="bfloat16", experts_implementation="packed")
    model, _ = load_model(INT4, num_resident=2, dtype="bfloat16", experts_implementation="packed",
                          host_memory_gb=budget, stored_layout_dir=str(tmp_path))
    assert model.pagedexperts.host_memory.disk_tier
    return model.eval()


def _forward(model, seed: int) -> None:
    ids = torch.randint(2, 100, (3, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids)


def test_a_repage_zeroes_the_disk_tiers_counters_with_the_layers(tmp_path):
    model = _tiered(tmp_path)
    _forward(model, 0)
    before = model.pagedexperts.stats().as_dict()
    assert before["host_hits"] + before["host_misses"] == before["page_ins"] > 0
    repage(model, num_resident=3)
    now = model.pagedexperts.stats().as_dict()
    assert now["page_ins"] == 0 and now["host_hits"] == now["host_misses"] == now["disk_reads"] == 0
    _forward(model, 1)
    after = model.pagedexperts.stats().as_dict()
    assert after["host_hits"] + after["host_misses"] == after["page_ins"] > 0


def test_the_disk_tier_still_reads_ahead_after_a_repage(tmp_path):
    model = _tiered(tmp_path)
    repage(model, num_resident=2)
    for seed in range(3):
        _forward(model, seed)
    assert model.pagedexperts.stats().as_dict()["read_ahead_issued"] > 0


def test_no_read_ahead_holds_with_prefetch(tmp_path):
    """--prefetch --no-read-ahead: the prefetch pages the predicted experts in, and the disk tier
    reads none ahead (the prefetcher read them ahead regardless of the flag)."""
    budget = host_budget_gb(INT4, 1, num_resident=2, dtype="bfloat16", experts_implementation="packed")
    model, _ = load_model(INT4, num_resident=2, dtype="bfloat16", experts_implementation="packed", prefetch=True,
                          read_ahead=False, host_memory_gb=budget, stored_layout_dir=str(tmp_path))
    assert model.pagedexperts.host_memory.disk_tier
    for seed in range(3):
        _forward(model.eval(), seed)
    assert model.pagedexperts.prefetch_stats()["total"]["issued"] > 0
    assert model.pagedexperts.stats().as_dict()["read_ahead_issued"] == 0
