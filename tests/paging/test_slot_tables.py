"""The slot-table contract (issue 47, step 2): a slot table says how its kernel reads it.

Four tables implement ``formats.slots.SlotTable``: the plain one (``PackedSlots``: the store's
rows as they are), dense slots dequantized at page-in (``DenseSlots``), packed slots dequantized
each wave into a shared scratch (``DequantizingSlots``) and slots in torch's CPU kernel layouts
(``CpuPackedSlots``). Each answers the page-in (``write_rows``, ``copy_rows``), what the kernel
reads for a wave (``kernel_tensors``) and what a CUDA graph or a device-side page-in cannot hold;
so no body and no executor asks which table it holds (checked on the source of ``paging/``).

Legend: E experts, K slots.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pagedexperts.paging
from pagedexperts.formats import format_for_config
from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec
from pagedexperts.formats.cpu_pack import CpuPackedSlots, plan_layout
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat, quantize_fp8_block
from pagedexperts.formats.slots import DenseSlots, DequantizingSlots, SlotTable, allocate
from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.residency.planner import Load
from pagedexperts.storage.host_store import HostExpertStore
from support.synthetic_layer import E, H, I

PAGING = Path(pagedexperts.paging.__file__).parent
K = 3  # slots
TABLES = (PackedSlots, DenseSlots, DequantizingSlots, CpuPackedSlots)


def _fp8():
    """(layout, host store) of an FP8 block layer (gate_up [2I, H], down [H, I]), E random experts."""
    fmt, gen = Fp8BlockFormat(block=(16, 16)), torch.Generator().manual_seed(0)
    specs = (TensorSpec("gate_up_proj", (2 * I, H), torch.bfloat16), TensorSpec("down_proj", (H, I), torch.bfloat16))
    layout = ExpertLayout(fmt, tuple(QuantizedTensor(s, fmt.pack(s, sources=1, transposed=False)) for s in specs))
    store = HostExpertStore(list(layout.packed_specs), E, pin=False)
    for spec in specs:
        for e in range(E):
            q, s = quantize_fp8_block(torch.randn(spec.shape, generator=gen) * 0.1, (16, 16))
            store.write_row(spec.name, e, q)
            store.write_row(spec.name + "_scale_inv", e, s)
    return layout, store


def _cpu_packed() -> CpuPackedSlots:
    fmt = format_for_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                     "desc_act": False}})
    layout = fmt.layout((TensorSpec("gate_up_proj", (2 * I, H), torch.float32),
                         TensorSpec("down_proj", (H, 2 * I), torch.float32)), sources={"gate_up_proj": 2})
    return CpuPackedSlots(layout, plan_layout(layout), K, "cpu")


def test_every_table_implements_the_contract():
    assert all(issubclass(t, SlotTable) and not t.__abstractmethods__ for t in TABLES)
    assert {t.__name__ for t in _subclasses(SlotTable)} == {t.__name__ for t in TABLES}


def _subclasses(cls) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))}


def test_the_dequantizing_table_fills_only_the_wave_rows_of_its_scratch():
    layout, store = _fp8()
    scratch = {n: torch.full_like(t, 7.0) for n, t in allocate(layout.dense_specs, K, "cpu").items()}
    table = DequantizingSlots(layout, allocate(store.specs, K, "cpu"), scratch)
    table.copy_rows(store.rows_in_memory(), [Load(4, 0), Load(1, 2)], pinned=False)
    got = table.kernel_tensors([2])
    assert got is scratch and table.kernel_tensors(()) is scratch  # the same objects every wave
    want = layout.dequantize({n: t[[1]] for n, t in store.tensors.items()})
    for name, rows in want.items():
        assert torch.equal(got[name][2], rows[0]), name
        assert bool((got[name][:2] == 7.0).all()), f"{name}: a row outside the wave was written"
    assert "--no-cuda-graphs" in table.capture_problem() and table.device_page_in_problem() is None


def test_dense_slots_hold_the_dequantized_rows_and_are_what_the_kernel_reads():
    layout, store = _fp8()
    table = DenseSlots(layout, allocate(layout.dense_specs, K, "cpu"), allocate(layout.packed_specs, 1, "cpu"))
    table.copy_rows(store.rows_in_memory(), [Load(5, 1)], pinned=False)  # the contract's default: write_rows
    want = layout.dequantize({n: t[[5]] for n, t in store.tensors.items()})
    assert table.kernel_tensors([1]) is table
    assert all(torch.equal(table[n][1], rows[0]) for n, rows in want.items())
    assert table.capture_problem() is None and "--slot-format packed" in table.device_page_in_problem()


def test_the_plain_and_the_cpu_tables_are_read_as_they_are():
    _, store = _fp8()
    plain = PackedSlots(allocate(store.specs, K, "cpu"))
    plain.copy_rows(store.rows_in_memory(), [Load(3, 2)], pinned=False)
    assert plain.kernel_tensors([2]) is plain and all(torch.equal(plain[n][2], t[3]) for n, t in store.tensors.items())
    assert plain.capture_problem() is None and plain.device_page_in_problem() is None
    cpu = _cpu_packed()
    assert cpu.kernel_tensors([0, 1]) is cpu and cpu.capture_problem() is None
    assert "--decide host" in cpu.device_page_in_problem()


# ---- no body and no executor asks which table it holds ---------------------------------------

TABLE_NAMES = {t.__name__ for t in (SlotTable, *TABLES)} | {"WaveDequantizer"}


def table_questions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every place a module asks which slot table it holds: ``isinstance`` /
    ``issubclass`` / ``type(...) is`` against a table class, or a ``dequantizer`` attribute."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "dequantizer":
            found.append((node.lineno, ".dequantizer"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
            if named & TABLE_NAMES:
                found.append((node.lineno, f"{node.func.id} {sorted(named & TABLE_NAMES)}"))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops):
            named = {getattr(n, "id", getattr(n, "attr", "")) for n in node.comparators}
            if isinstance(node.left, ast.Call) and getattr(node.left.func, "id", "") == "type" and named & TABLE_NAMES:
                found.append((node.lineno, f"type() against {sorted(named & TABLE_NAMES)}"))
    return found


def test_no_module_of_paging_asks_which_slot_table_it_holds():
    found = [f"{p.relative_to(PAGING)}:{line}: {what}" for p in sorted(PAGING.rglob("*.py"))
             for line, what in table_questions(ast.parse(p.read_text()))]
    assert found == [], "branch on the table's contract (formats.slots.SlotTable), not its class:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "if self.setup.dequantizer is not None:\n    pass",
    "packed = isinstance(setup.slots, CpuPackedSlots)",
    "rows = store.rows_in_memory() if isinstance(slots, (PackedSlots, DenseSlots)) else None",
    "if type(slots) is slots_module.DenseSlots:\n    pass",
])
def test_the_check_sees_each_kind_of_question(source):
    assert table_questions(ast.parse(source)) != []
