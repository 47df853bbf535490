"""Shared by several test modules (moved from paging/test_syncs.py)."""

from __future__ import annotations
import sys
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from support.tiny import PAD_ID


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


def _run(model, mode, ids, mask) -> None:
    mode.mark(ids, mask, *model.parameters(), *model.buffers())
    with mode, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=PAD_ID)


SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__, torch.nonzero, torch.Tensor.nonzero,
    torch.unique, torch.Tensor.unique, torch.masked_select, torch.Tensor.masked_select, torch.argwhere,
}


class HostReads(TorchFunctionMode):
    """Records each syncing call (a host read on a GPU) made from pagedexperts.paging code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING or (func is torch.where and len(args) == 1):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            name = frame.f_globals.get("__name__", "") if frame is not None else ""
            if name.startswith("pagedexperts.paging"):
                self.calls.append(f"{name}:{frame.f_lineno} {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))
