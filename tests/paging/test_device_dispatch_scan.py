"""A device-planned decode step reads nothing back: every aten op of one step, scanned (CPU).

The step is what ``generation.graphs`` captures on CUDA: the model's decode forward over
static buffers (``DecodeGraphs``' eager backend runs the same function, no capture), paged
with ``--decide device`` at K = top_k, batch 2 (two waves: every step evicts). A
``TorchDispatchMode`` sees every aten op the step dispatches (the model's, transformers' and
pagedexperts', below autograd, whatever Python API made them) and fails on each one a capture
cannot hold: a device-to-host read (``aten::_local_scalar_dense``: ``.item()``, ``int()``,
``bool()``), a data-dependent shape (``nonzero``, ``unique``, ``masked_select``, indexing or
index_put with a boolean mask) or a tensor built from host values (``lift_fresh``:
``torch.tensor(...)`` / ``as_tensor`` of Python data). On CPU none of these fails, so without
this scan the first GPU capture would be the first to find them. The kernels run as their
torch references and as the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import traceback

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_device_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from support.tiny import PAD_ID, TOP_K  # noqa: E402
from pagedexperts.generation.graphs import DecodeGraphs  # noqa: E402
from pagedexperts.loading.loader import load_model  # noqa: E402
from pagedexperts.paging.kernels import HAVE_TRITON  # noqa: E402

aten = torch.ops.aten
READ_BACKS = {aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.argwhere, aten._unique,
              aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.masked_select, aten.lift_fresh,
              aten.lift_fresh_copy, aten.repeat_interleave}
MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class ReadBackScan(TorchDispatchMode):
    """Records each aten op of READ_BACKS, and each boolean-mask index, with where it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.paging_ops = 0  # ops dispatched from pagedexperts.paging (the scan saw the pager)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        self.paging_ops += "/pagedexperts/paging/" in _caller()
        if packet in READ_BACKS and not (packet is aten.repeat_interleave and _static_repeats(args, kwargs)):
            self.found.append(f"{func} from {_caller()}")
        elif packet in MASK_INDEXED and _bool_index(args):
            self.found.append(f"{func} with a boolean mask from {_caller()}")
        return func(*args, **(kwargs or {}))


def _static_repeats(args, kwargs) -> bool:
    """``repeat_interleave(x, int, dim=...)`` (a fixed output size): not a read-back; a tensor
    of repeats (``repeat_interleave(repeats)`` / ``repeats=Tensor``) sizes its output by data."""
    repeats = args[1] if len(args) > 1 else (kwargs or {}).get("repeats")
    return isinstance(repeats, int) or (isinstance(args[0], torch.Tensor) and len(args) > 1
                                        and isinstance(args[1], int))


def _caller() -> str:
    """The innermost frame outside torch: file:line function."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename:
            return f"{frame.filename.split('/site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


def _decode_step_scan(model) -> list[str]:
    """Prefill 2 rows (one left-padded), one decode step (the build), then scan the next."""
    graphs = DecodeGraphs(model, backend="eager", max_batch=2)
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD_ID, 0
    st = graphs.step_for(2, 16)
    with torch.no_grad():
        st.prefill(ids, mask)
        graphs.decode(st, torch.tensor([5, 9]), 7)
        st.load(torch.tensor([11, 13]), 8)  # the step's inputs, loaded before it (as decode does)
        with ReadBackScan() as scan:
            st.forward()
    assert graphs.counters.captures == 1
    assert scan.paging_ops > 20 * len(model.pagedexperts.runners), scan.paging_ops  # decide, remap, waves, combine
    return scan.found


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')"))])
def test_device_planned_decode_step_reads_nothing_back(tiny_moe_dir, kernels, impl):
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, decide="device", device_kernels=kernels,
                          experts_implementation=impl, cuda_graphs="off", check_independence=False)
    assert model.pagedexperts.decide == "device"
    assert _decode_step_scan(model) == []
    stats = model.pagedexperts.stats().total()
    assert stats.misses > 0 and stats.multi_wave_steps > 0  # the scanned steps paged, in waves


def test_the_scan_sees_each_kind_of_read_back():
    """The scan itself: one of each thing it must catch, and none of the fixed-shape ops."""
    x, repeats = torch.arange(6), torch.tensor([1, 0, 1, 0, 1, 0])
    with ReadBackScan() as scan:
        x.sum().item()
        torch.nonzero(x > 2)
        x[x > 2]
        torch.unique(x)
        torch.tensor([1, 2])
        x.repeat_interleave(repeats)
    kinds = [f.split(" ")[0] for f in scan.found]
    assert kinds == ["aten._local_scalar_dense.default", "aten.nonzero.default", "aten.index.Tensor",
                     "aten._unique2.default", "aten.lift_fresh.default", "aten.repeat_interleave.Tensor"], scan.found
    with ReadBackScan() as scan:
        torch.where(x > 2, x, 0).cumsum(0)
        x.repeat_interleave(2, dim=0)
        x[torch.tensor([3])]  # noqa: B018  (an integer index tensor: fixed shape)
    assert [f for f in scan.found if "lift_fresh" not in f] == []
