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

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from conftest import E, PAD_ID, TOP_K
from pagedexperts.paging import host_executor
from pagedexperts.loading.runners import install_prefetch
from pagedexperts.paging.steps import host_batched, host_eager, host_grouped
from pagedexperts.paging import transfer
from pagedexperts.loading.loader import load_model

SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
    torch.nonzero, torch.Tensor.nonzero, torch.unique, torch.Tensor.unique, torch.masked_select,
    torch.Tensor.masked_select, torch.argwhere,
}


def _called_from_package() -> str | None:
    """The first caller outside torch, if it is pagedexperts code: 'module:line'."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return f"{name}:{frame.f_lineno}" if name.startswith("pagedexperts") else None


class DeviceReads(TorchFunctionMode):
    """Counts syncing calls on would-be device tensors from pagedexperts code."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, torch.Tensor] = {}
        self.reads: list[str] = []
        self.read_backs = 0
        self.paused = False

    def mark(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device[id(t)] = t

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._device.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = tree_flatten((args, kwargs))[0]
        if any(self.on_device(t) for t in inputs):
            if self._syncs(func, args, kwargs):
                where = _called_from_package()
                if where is not None:
                    self.reads.append(f"{getattr(func, '__name__', func)} at {where}")
            self.mark(*tree_flatten(out)[0])
        return out

    def _syncs(self, func, args, kwargs) -> bool:
        if func in SYNCING:
            return True
        if func is torch.Tensor.to:
            dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            return dev is not None and torch.device(dev).type == "cpu"
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # tensor repeats
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if func is torch.Tensor.copy_:
            return self.on_device(args[1]) and not self.on_device(args[0])
        if func is torch.Tensor.__getitem__:
            index = tree_flatten(args[1])[0]
            return any(self.on_device(i) and i.dtype == torch.bool for i in index)
        return False


@pytest.fixture
def device_reads(monkeypatch):
    """Install the counter: executor steps mark their inputs and slots; read_back and upload are
    wrapped (read_back's result is host memory, upload's is device memory)."""
    mode = DeviceReads()
    original_read_back, original_upload = transfer.read_back, transfer.upload
    original_step = host_executor.HostExecutor.step

    def read_back(parts):
        mode.read_backs += 1
        mode.paused = True
        try:
            return original_read_back(parts)
        finally:
            mode.paused = False

    def upload(values, device):
        out = original_upload(values, device)
        mode.mark(out)
        return out

    def step(self, module, hidden, ids, weights, padding_count=None):
        mode.mark(hidden, ids, weights, padding_count, *self.slots.values())
        mode.layer_steps += 1
        return original_step(self, module, hidden, ids, weights, padding_count)

    mode.layer_steps = 0
    monkeypatch.setattr(transfer, "read_back", read_back)
    for target in (transfer, host_grouped, host_batched, host_eager):  # every module that uploads
        monkeypatch.setattr(target, "upload", upload)
    monkeypatch.setattr(host_executor.HostExecutor, "step", step)
    return mode


def _run(model, mode, ids, mask) -> None:
    mode.mark(ids, mask, *model.parameters(), *model.buffers())
    with mode, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=PAD_ID)


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
