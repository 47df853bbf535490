"""Exactly one device-to-host transfer per MoE layer per step, counted by instrumentation.

On a GPU every device-to-host read (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, a
boolean-mask index, a D2H ``copy_``) stalls the host until the device catches up. On CPU no
such stall exists, so the test makes one visible: a ``TorchFunctionMode`` marks every tensor
that would live on the device (model inputs, parameters, slot tensors, uploads, and anything
computed from them) and counts each syncing call made on a marked tensor from pagedexperts
code; ``transfer.read_back``, the one allowed read, is wrapped and counted apart. The model's
own code (router, attention, the inner experts kernels) is not counted: the unpaged model runs
it too.
"""

from __future__ import annotations


import pytest
import torch

from support.tiny import E, PAD_ID, TOP_K
from pagedexperts.loading.runners import install_prefetch
from pagedexperts.paging import transfer
from pagedexperts.loading.loader import load_model
from support.reads import _run



@pytest.mark.parametrize("k_slots", [TOP_K, E // 2])
@pytest.mark.parametrize("with_prefetch", [False, True])
def test_one_device_read_per_layer_step(tiny_moe_dir, device_reads, k_slots, with_prefetch):
    """Prefill (multi-wave at K = top_k) and decode of a padded batch, with and without
    prefetch: one read_back per layer-step, and no other syncing call from the package."""
    model, _ = load_model(tiny_moe_dir, num_resident=k_slots)
    if with_prefetch:
        install_prefetch(model)
    ids = torch.randint(2, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = PAD_ID
    _run(model, device_reads, ids, mask)
    stats = model.pagedexperts.stats().total()
    assert device_reads.layer_steps == stats.steps > 0
    if k_slots == TOP_K:
        assert stats.multi_wave_steps > 0
    if with_prefetch:
        assert model.pagedexperts.prefetch_stats()["total"]["issued"] > 0
    assert device_reads.reads == []
    assert device_reads.read_backs == device_reads.layer_steps


def test_counter_sees_a_sync(device_reads):
    """The instrument itself: a ``.tolist()`` on a marked tensor from package code counts."""
    t = torch.arange(3)
    device_reads.mark(t)
    with device_reads:
        transfer.StepRead(t.reshape(1, 3), None, 0).union()  # its .tolist() would stall a GPU
    assert len(device_reads.reads) == 1 and "pagedexperts.paging.transfer" in device_reads.reads[0]
