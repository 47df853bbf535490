"""The contracts' capabilities: what callers ask a runner, a store or the inner table instead of
its type (STYLE.md 13), and the import rule that keeps the two executors apart.

Oracles: the host residency's own map (``is_resident``), the store's rows (``gather``), hand-
written expectations of each capability per runner kind, and the package's import graph read
from its source (``ast``).

Legend: T tokens, H hidden, k top_k, E experts, K slots.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from pagedexperts import integration
from pagedexperts.formats.slots import DequantizingSlots, allocate
from pagedexperts.paging.steps.contract import PackedSlots
from pagedexperts.loading.loader import load_model
from pagedexperts.loading.runtime import PagingRuntime, runtime_of
from pagedexperts.paging.baselines import ResidentRunner
from pagedexperts.paging.device_executor import DeviceExecutor
from pagedexperts.paging.host_executor import HostExecutor
from pagedexperts.paging.steps.table import STEP_BODIES, inner_problem
from pagedexperts.paging.kernels.page_in import page_in_torch
from pagedexperts.paging.steps.contract import LayerStep
from pagedexperts.storage.host_tier import TieredExpertStore
from support.synthetic_layer import E, TOP_K, paged, step_inputs, synthetic_experts

PACKAGE = Path(integration.__file__).parent
EXECUTOR_MODULES = {"pagedexperts.paging.host_executor", "pagedexperts.paging.device_executor"}
BUILDER = "pagedexperts.loading.runners"


def host_and_device(num_slots: int = 3):
    """A host and a device executor (LRU both) over one store of a synthetic layer."""
    module = synthetic_experts(torch.float32)
    host = paged(module, num_slots)
    dev = DeviceExecutor(layer=0, store=host.store, num_slots=num_slots, device="cpu", inner="grouped_mm",
                         policy="lru")
    return module, host, dev


# ---- the inner table: one check, one step signature ---------------------------------------


def test_inner_problem_is_the_one_check_for_both_paths():
    assert inner_problem("grouped_mm") is None and inner_problem("grouped_mm", decide="device") is None
    assert inner_problem("eager") is None
    device_eager = inner_problem("eager", decide="device")
    assert "--decide device" in device_eager and "grouped_mm or batched_mm" in device_eager
    assert "--decide host" in device_eager
    unknown = inner_problem("sonic", decide="device")
    assert "'sonic'" in unknown and "['grouped_mm', 'batched_mm', 'eager', 'fused', 'packed']" in unknown
    assert "--experts-implementation" in unknown
    with pytest.raises(ValueError, match="'gpu'.*host.*device"):
        inner_problem("grouped_mm", decide="gpu")


def test_a_runner_checks_its_inner_when_it_is_set():
    """Refused before any step (host: an unknown name; device: one without a device step)."""
    with pytest.raises(ValueError, match="'sonic' is not supported under paging"):
        paged(synthetic_experts(), 3, inner="sonic")
    _, host, dev = host_and_device()
    host.inner = "eager"
    assert type(host.body) is STEP_BODIES["eager"].host
    with pytest.raises(ValueError, match="--decide host"):
        dev.inner = "eager"
    assert dev.inner == "grouped_mm" and type(dev.body) is STEP_BODIES["grouped_mm"].device


def test_every_body_implements_the_one_step_contract():
    """Seven bodies, each a LayerStep of its path, with the contract's signatures (begin, run_wave,
    combine), so an executor holds any of them the same way."""
    bodies = [(b.host, "host") for b in STEP_BODIES.values() if b.host] + \
        [(b.device, "device") for b in STEP_BODIES.values() if b.device]
    assert len(bodies) == 7  # host: grouped_mm, batched_mm, eager, packed; device: grouped_mm, batched_mm, fused
    for body, planned in bodies:
        assert issubclass(body, LayerStep) and body.planned == planned, body.__name__
        for method in ("begin", "run_wave", "combine"):
            want = list(inspect.signature(getattr(LayerStep, method)).parameters)
            assert list(inspect.signature(getattr(body, method)).parameters) == want, (body.__name__, method)


# ---- runner capabilities: inline, capture_problem, is_resident -----------------------------


def test_capture_problem_per_runner_kind():
    module, host, dev = host_and_device()
    cpu = torch.device("cpu")
    assert "HostExecutor reads the step back" in host.capture_problem(torch.bfloat16, cpu)
    assert dev.capture_problem(torch.bfloat16, cpu) is None
    table = DequantizingSlots(None, dict(dev.slots), {})  # packed slots of a quantized format
    dev.setup = dataclasses.replace(dev.setup, slots=table)
    dev.inner = "grouped_mm"  # the body is rebuilt over the setup: its table dequantizes each wave on the host
    assert "quantized format" in dev.capture_problem(torch.bfloat16, cpu)
    resident = ResidentRunner(layer=0, store=host.store, device="cpu", inner="grouped_mm")
    assert resident.inline and not host.inline and not dev.inline
    assert resident.capture_problem(torch.bfloat16, cpu) is None
    resident.trace_hook = lambda layer, ids, weights: None
    assert "--record-trace" in resident.capture_problem(torch.bfloat16, cpu)


def test_is_resident_is_the_residency_map_on_both_executors():
    module, host, dev = host_and_device()
    for n, routing in enumerate([[[0, 1]], [[2, 3], [4, 0]], [[5, 6]], [[1, 7], [3, 2]]]):
        hidden, ids, weights = step_inputs(routing, torch.float32, seed=n)
        host.step(module, hidden, ids, weights)
        dev.step(module, hidden, ids, weights)
        resident = set(host.residency.resident())
        assert len(resident) == (2 if n == 0 else 3)
        assert {e for e in range(E) if host.is_resident(e)} == resident, f"step {n}"
        assert {e for e in range(E) if dev.is_resident(e)} == resident, f"step {n}"


class _Recorder:
    """A runner stand-in: records how the dispatcher called it."""

    def __init__(self, inline: bool) -> None:
        self.inline, self.padding_count, self.calls = inline, torch.tensor(1), []

    def step(self, module, hidden, ids, weights, padding_count=None):
        self.calls.append(padding_count)
        return hidden


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("inline", [False, True])
def test_the_dispatcher_calls_every_runner_one_way(monkeypatch, inline, compiling):
    """``step`` with the runner's padding rows, directly, except a non-inline runner under
    torch.compile: through the opaque custom op."""
    module, runner, ops = torch.nn.Linear(1, 1), _Recorder(inline), []
    integration.attach(module, runner)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    monkeypatch.setattr(integration, "experts_step", lambda *args: ops.append(args) or args[0])
    hidden = torch.zeros(2, 1)
    integration.paged_experts_forward(module, hidden, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    through_op = compiling and not inline
    assert (len(ops), len(runner.calls)) == ((1, 0) if through_op else (0, 1))
    if not through_op:
        assert runner.calls[0] is runner.padding_count


# ---- the store's device gather -------------------------------------------------------------


def test_the_store_gathers_the_planned_rows_and_says_when_it_cannot():
    _, host, _ = host_and_device()
    store = host.store
    slots = PackedSlots(allocate(store.specs, 3, torch.device("cpu")))
    src, dst, count = torch.tensor([5, 2, -1]), torch.tensor([1, 0, 2]), torch.tensor(2)
    page_in_torch(store.gather_source(torch.device("cpu")), slots, src, dst, count)
    for name, rows in store.tensors.items():
        assert torch.equal(slots[name][1], rows[5]) and torch.equal(slots[name][0], rows[2])
        assert torch.equal(slots[name][2], torch.zeros_like(rows[0]))  # j >= count: untouched
    assert store.gather_problem(torch.device("cpu")) is None
    pageable = store.gather_problem(torch.device("cuda"))  # an unpinned store on CUDA
    assert "pageable" in pageable and "--decide host" in pageable
    tier = TieredExpertStore(store.specs, E, 3, policy="lru", pin=False, layer=0)
    assert "--decide host" in tier.gather_problem(torch.device("cpu"))
    with pytest.raises(ValueError, match="does not hold every expert"):
        tier.gather_source(torch.device("cpu"))


# ---- the runtime: one way to ask a model for it --------------------------------------------


def test_runtime_of_a_paged_and_a_plain_model(tiny_moe_dir, tiny_moe_model):
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K, check_independence=False)
    rt = runtime_of(model)
    assert isinstance(rt, PagingRuntime) and rt is model.pagedexperts
    assert sorted(rt.runners) == [0, 1] and all(isinstance(r, HostExecutor) for r in rt.runners.values())
    assert runtime_of(tiny_moe_model) is None


# ---- imports: the executors apart ----------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    """Package modules a source file imports (module- and function-level, ``from`` included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_only_the_runner_registry_imports_an_executor():
    importers = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        hits = imported_modules(path) & EXECUTOR_MODULES
        if hits and name not in EXECUTOR_MODULES:
            importers[name] = sorted(hits)
    assert importers == {BUILDER: sorted(EXECUTOR_MODULES)}


def test_an_executor_names_no_format_and_no_kernel():
    """Issue 37: the executors hold a body (``paging.steps``) behind its contract and import no
    format, no kernel and no body of their own: what is format- or kernel-specific is the body's."""
    for name in sorted(EXECUTOR_MODULES):
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        named = {m for m in imported_modules(path) if m.startswith("pagedexperts.")}
        forbidden = sorted(m for m in named if m.startswith(("pagedexperts.formats", "pagedexperts.paging.kernels"))
                           or (m.startswith("pagedexperts.paging.steps.") and "steps.contract" not in m))
        assert forbidden == [], f"{name} imports {forbidden}"
