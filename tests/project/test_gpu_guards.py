"""CPU guards of the GPU-only code, so the first GPU run counts (issue 27's review items).

Each checks on CPU what a GPU run would otherwise find first: every test of the CUDA test files
is collected (item 2: three tests sat inside a helper after its return), grouped_mm is judged
capturable by compute capability as well as dtype (item 6), a decode step is warmed up and
captured on one stream (item 11), a failed page-lock consumes the CUDA error it leaves pending
(item 9), the device-planned step runs with its tensors' device current (item 10), and
``bench/gpu_check.sh --dry-run`` prints its phases with limits adding up to at most 360 s. The
GPU tests that execute the same code are named in each docstring.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import re
import subprocess

import pytest
import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.generation import capture_checks, graphs
from pagedexperts.storage import host_store
from support.paths import ROOT

CUDA_TEST_FILES = sorted((ROOT / "tests").rglob("test_cuda*.py"))


def uncollected_tests(source: str) -> list[str]:
    """``def test_*`` that pytest would not collect: any not at module level nor a method of
    a module-level ``Test*`` class, and any defined twice in one scope (the second hides the first)."""
    tree = ast.parse(source)
    collected, scoped, problems = {}, set(), []
    for node in tree.body:
        scopes = [("", node)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            scopes = [(node.name + ".", item) for item in node.body if isinstance(item, ast.FunctionDef)]
        for prefix, fn in scopes:
            if fn.name.startswith("test_"):
                name = prefix + fn.name
                scoped.add(fn.lineno)
                if name in collected:
                    problems.append(f"{name} (line {fn.lineno}) hides line {collected[name]}")
                collected[name] = fn.lineno
    every = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    problems += [f"{fn.name} (line {fn.lineno}) is not collected: nested in another definition"
                 for fn in every if fn.lineno not in scoped]
    return problems


@pytest.mark.parametrize("path", CUDA_TEST_FILES, ids=[p.name for p in CUDA_TEST_FILES])
def test_every_cuda_test_is_collected(path):
    """Review item 2 (tests/paging/test_cuda.py: three tests indented inside a helper, after its
    ``return``). GPU tests stay in ``Test*`` classes behind skipif (never a skipped module)."""
    source = path.read_text()
    assert uncollected_tests(source) == []
    tree = ast.parse(source)
    module_marks = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    assert all("skipif" not in ast.unparse(n.value) for n in module_marks), "a whole module behind skipif"


def test_the_collection_check_sees_a_nested_test():
    source = "def helper():\n    return 1\n\n    def test_lost(self):\n        pass\n\n" \
             "class TestA:\n    def test_x(self):\n        pass\n\n    def test_x(self):\n        pass\n"
    assert uncollected_tests(source) == ["TestA.test_x (line 11) hides line 8",
                                         "test_lost (line 4) is not collected: nested in another definition"]


# -- generation.capture_checks: what capture needs (GPU: tests/generation/test_cuda_graphs.py) ---------------------


@pytest.mark.parametrize("capability,problem", [((8, 0), True), ((8, 9), True), ((9, 0), False), ((10, 0), False),
                                                ((12, 0), True)])
def test_grouped_mm_capturable_by_capability_and_dtype(monkeypatch, capability, problem):
    """Review item 6: torch's bf16 grouped GEMM kernels exist for sm90 and sm100 only; elsewhere
    ATen's fallback copies the group offsets to the host, which a capture cannot hold (GPU:
    TestCudaGraphs.test_grouped_mm_capture_follows_the_capability_rule)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    found = capture_checks.grouped_mm_problem(torch.bfloat16, cuda)
    assert (found is not None) == problem, found
    if problem:
        assert f"compute capability {capability[0]}.{capability[1]}" in found and "batched_mm" in found
    assert "reads its group offsets back" in capture_checks.grouped_mm_problem(torch.float32, cuda)
    assert capture_checks.grouped_mm_problem(torch.bfloat16, torch.device("cpu")) is None


class _FakeCuda:
    """torch.cuda's stream and graph calls, recording the current stream of each step call."""

    class Stream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            pass

    def __init__(self):
        self.default = self.Stream()
        self.current = self.default
        self.capture_default = self.Stream()  # torch.cuda.graph's own stream when given none

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def graph(self, graph, pool=None, stream=None):
        return self.stream(stream if stream is not None else self.capture_default)

    def install(self, monkeypatch):
        for name in ("Stream", "stream", "graph"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")


def test_warm_up_and_capture_run_on_one_stream(monkeypatch):
    """Review item 11: the warm-up ran on a fresh side stream and the capture on
    ``torch.cuda.graph``'s own, so cuBLAS allocated its workspace for the capture stream
    inside the capture (GPU: TestCudaGraphs.test_capture_runs_on_the_warm_up_stream)."""
    fake = _FakeCuda()
    fake.install(monkeypatch)

    class Model:
        device = torch.device("cuda", 0)

    class Step:
        batch, seen = 1, []
        logits = torch.zeros(1, 4)

        def forward(self):
            self.seen.append(fake.current)

    decode = graphs.DecodeGraphs(Model(), backend="cuda", max_batch=1, strict=True)
    st = Step()
    decode._build(st, ())
    assert decode.counters.captures == 1 and len(st.seen) == 2
    warm_up, capture = st.seen
    assert warm_up is capture is decode._stream and warm_up is not fake.default


# -- storage.host_store: a failed page-lock (GPU: TestCuda.test_failed_page_lock_leaves_no_pending_cuda_error)


def test_failed_page_lock_consumes_the_pending_cuda_error(monkeypatch, caplog):
    """Review item 9: cudaHostRegister's failure stays the runtime's pending error and torch
    raised it at the next unrelated launch; the store consumes it, warns and falls back."""
    consumed = []
    monkeypatch.setattr(host_store, "host_register", lambda t: 712)  # cudaErrorHostMemoryAlreadyRegistered
    monkeypatch.setattr(host_store, "clear_pending_cuda_error", lambda: consumed.append(True))
    with caplog.at_level(logging.WARNING, logger=host_store.__name__):
        store = host_store.HostExpertStore([TensorSpec("w", (8,), torch.float32)], 4, pin=True)
    assert consumed == [True]
    assert not store.pinned and "CUDA error 712" in store.fallback and "--decide auto" in store.fallback
    assert [r.getMessage() for r in caplog.records] == [store.fallback]


def test_no_cuda_runtime_leaves_nothing_to_consume(monkeypatch):
    consumed = []

    def no_runtime(t):
        raise RuntimeError("CUDA driver not found")

    monkeypatch.setattr(host_store, "host_register", no_runtime)
    monkeypatch.setattr(host_store, "clear_pending_cuda_error", lambda: consumed.append(True))
    store = host_store.HostExpertStore([TensorSpec("w", (8,), torch.float32)], 4, pin=True)
    assert consumed == [] and not store.pinned and "RuntimeError" in store.fallback


# -- paging.device_executor: the tensors' device (GPU: TestCuda.test_device_planned_on_the_second_gpu)


def test_device_step_runs_with_its_device_current(monkeypatch):
    """Review item 10: Triton launches on the current device, so ``--device cuda:1`` with
    cuda:0 current launched on the wrong GPU; the step enters its device."""
    from pagedexperts.paging import device_executor
    from support.synthetic_layer import host_and_device, routings, step_inputs, synthetic_experts

    guard = device_executor.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    entered = []
    real = device_executor.on_device

    def spy(device):
        entered.append(device)
        return real(device)

    monkeypatch.setattr(device_executor, "on_device", spy)
    module = synthetic_experts(torch.float32)
    _, dev = host_and_device(module, 3, "grouped_mm", "lru")
    hidden, ids, weights = step_inputs(routings(1, 1)[0], torch.float32, seed=0)
    dev.step(module, hidden, ids, weights)
    assert entered == [dev.device]


# -- bench/gpu_check.sh ---------------------------------------------------------------------------


def test_gpu_check_dry_run_prints_its_phases_within_six_minutes(tmp_path):
    """``--dry-run`` (CPU) prints each phase with its limit and runs nothing on a GPU; the
    limits, in order of value, add up to at most 360 s."""
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                         text=True, timeout=120, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    phases = re.findall(r"^== (\w+) \(limit (\d+) s\)", out.stdout, re.M)
    names = [name for name, _ in phases]
    assert names[:2] == ["cuda_tests", "captured_decode"], names
    assert sum(int(limit) for _, limit in phases) <= 360, phases
    assert "dry run: nothing ran" in out.stdout


@pytest.mark.slow
def test_gpu_bench_phases_record_decide_and_versions(tmp_path):
    """gpu_check.sh's second and last phases on CPU (tiny sizes, same code): the captured
    rows (paged at each K, then resident) and the rest, every row with decide and versions."""
    import json
    import sys

    import triton

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    trace = str(ROOT / "tests" / "data" / "synthetic_trace.npz")
    assert gpu_bench.main(["--dry-run", "--phases", "captured", "--out", str(tmp_path), "--traces", trace]) == 0
    captured = json.loads((tmp_path / "gpu_bench_captured.json").read_text())
    assert captured["phases_done"] == ["build", "captured_decode"]
    rows = captured["captured_decode"]
    assert [(r["mode"], r["K"], r["batch"]) for r in rows] == [("paged", 6, 1), ("paged", 6, 4), ("paged", 10, 1),
                                                              ("paged", 10, 4), ("resident", 16, 1), ("resident", 16, 4)]
    assert all(r["graphs_tok_s"] > 0 for r in rows)
    assert gpu_bench.main(["--dry-run", "--phases", "rest", "--out", str(tmp_path), "--traces", trace]) == 0
    rest = json.loads((tmp_path / "gpu_bench_rest.json").read_text())
    assert rest["phases_done"] == ["build", "link", "modes", "decode_host", "miss_costs", "layer_scaling", "modelled"]
    assert all(r["graphs_tok_s"] is None for r in rest["decode_host"])  # captured in their own phase
    every = rows + rest["modes"] + rest["decode_host"] + rest["miss_costs"] + list(rest["layer_scaling"].values())
    assert all((r["torch"], r["triton"]) == (torch.__version__, triton.__version__) for r in every)
    assert {r["decide"] for r in every} == {"host"}  # CPU: --decide auto plans on the host
    assert all(r["decide"] == "host" for r in rest["modelled"])
    assert {c["executor"] for c in rest["miss_costs"]} == {"HostExecutor"}


def test_miss_costs_use_the_model_s_decide_path():
    """The modelled 48-layer figure uses the device path's own per-miss costs on CUDA (the
    host executor's before, whatever the model ran)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench
    from support.synthetic_layer import paged, synthetic_experts

    store = paged(synthetic_experts(torch.float32), 3).store
    dev = gpu_bench.layer_executor("device", 0, store, 3, torch.device("cpu"))
    host = gpu_bench.layer_executor("host", 0, store, 3, torch.device("cpu"))
    assert type(dev).__name__ == "DeviceExecutor" and type(host).__name__ == "HostExecutor"


@pytest.mark.slow
def test_gpu_micro_dry_run(tmp_path):
    """gpu_check.sh's micro phase on CPU: the kernels interpreted at tiny shapes, every row
    with decide "device" and the versions; page-in rows at count 0, 1 and top_k."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_micro

    assert gpu_micro.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_micro.json").read_text())["rows"]
    kinds = [r["kernel"] for r in rows]
    assert kinds.count("decide") == 8 and kinds.count("quantized_layer_step") == 2
    assert [r["count"] for r in rows if r["kernel"] == "page_in"] == [0, 1, gpu_micro.TINY["top_k"]]
    assert all(r["decide"] == "device" and r["torch"] == torch.__version__ and r["us"] > 0 for r in rows)
