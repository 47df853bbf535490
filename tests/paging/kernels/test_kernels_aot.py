"""Every Triton kernel of the device-planned step compiles for the GPUs it runs on (no GPU needed).

Ahead-of-time compiles (``tests/support/aot_compile.py``: ``triton.compile`` for a ``GPUTarget``, then
ptxas) of ``decide`` (LRU and LFU), ``page_in`` (word and byte rows), ``remap`` and the address
probe, for sm_80 (A100), sm_89 (L4) and sm_90 (H100/H200), at the bundled model's shape (E 64,
top_k 4, K 16) and Qwen3-30B-A3B's (E 128, top_k 8, K 40 and 92; hidden 2048, moe
intermediate 768, bf16: a page-in reads its row sizes from its table at run time, so only E and
K enter a compile). Each prints its registers and spills (``pytest -s``) and fails on a compile
error or a spill. Also the CPU guards of what a compile cannot show: the decide kernel's
barriers between a read and a write of shared state, and no compiled variant per batch size.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_device_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedexperts.paging.kernels import HAVE_TRITON  # noqa: E402
from pagedexperts.paging.kernels.decide import DecidePlan, DecideRule  # noqa: E402
from pagedexperts.paging.kernels.decide import DecideState, num_waves_for  # noqa: E402
from support import bundled  # noqa: E402

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
ARCHS = (80, 89, 90)
# (label, E, top_k, K): the bundled model at its default K, Qwen3-30B-A3B at K 40 and 92
SHAPES = (("bundled", bundled.E, bundled.TOP_K, 16), ("qwen3-30b-a3b", 128, 8, 40), ("qwen3-30b-a3b", 128, 8, 92))
RULES = {"lru": DecideRule(False), "lfu": DecideRule(True, 128), "lfu-in-place": DecideRule(True, 128, in_place=True)}


def _signature(kernel, ints: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    """Every argument: constexpr, a 32-bit int, or an aligned int64 pointer (the launcher
    specialises torch's allocations to 16-byte alignment)."""
    names = kernel.arg_names
    return {n: "constexpr" if n in constexprs else "i32" if n in ints else "*i64:16" for n in names}


def _report(label: str, info) -> None:
    print(f"\n  {label:48s} sm_{info.arch}: {info.n_regs:3d} registers, {info.n_spills} B spill stores, "
          f"{info.spill_loads} B spill loads")


@needs_triton
@pytest.mark.slow  # a cold Triton cache: about 30 compiles (40-70 s on 2 cores); warm: under 10 s
class TestAheadOfTimeCompile:
    @pytest.mark.parametrize("arch", ARCHS)
    @pytest.mark.parametrize("policy", list(RULES))
    @pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-K{s[3]}" for s in SHAPES])
    def test_decide(self, shape, policy, arch):
        from support.aot_compile import compile_for_arch
        from pagedexperts.paging.kernels import decide

        label, num_experts, _, num_slots = shape
        constexprs = decide.decide_constexprs(num_experts, num_slots, RULES[policy])
        sig = _signature(decide._decide_kernel, ("num_ids", "E", "K", "num_waves", "admit"), constexprs)
        info = compile_for_arch(decide._decide_kernel, signature=sig, constexprs=constexprs, arch=arch,
                                num_warps=decide.NUM_WARPS)
        _report(f"decide {policy} {label} E={num_experts} K={num_slots}", info)
        assert info.n_spills == 0 and info.spill_loads == 0, info

    @pytest.mark.parametrize("arch", ARCHS)
    @pytest.mark.parametrize("bytewise", [False, True], ids=["words", "bytes"])
    def test_page_in(self, bytewise, arch):
        from support.aot_compile import compile_for_arch
        from pagedexperts.paging.kernels import page_in

        constexprs = dict(BYTES=bytewise, BLOCK=page_in.BLOCK_WORDS)
        sig = _signature(page_in._page_in_kernel, ("wave", "K"), constexprs)
        info = compile_for_arch(page_in._page_in_kernel, signature=sig, constexprs=constexprs, arch=arch)
        _report(f"page_in {'bytes' if bytewise else 'int32 words'}", info)
        assert info.n_spills == 0, info

    @pytest.mark.parametrize("arch", ARCHS)
    def test_remap_and_address(self, arch):
        from support.aot_compile import compile_for_arch
        from pagedexperts.paging.kernels import decide, page_in

        constexprs = dict(BLOCK=decide.REMAP_BLOCK)
        info = compile_for_arch(decide._remap_kernel, signature=_signature(decide._remap_kernel, ("n",), constexprs),
                                constexprs=constexprs, arch=arch)
        _report("remap", info)
        probe = compile_for_arch(page_in._address_kernel, signature=_signature(page_in._address_kernel, (), {}),
                                 constexprs={}, arch=arch)
        _report("page_in address probe", probe)
        assert info.n_spills == 0 and probe.n_spills == 0


# -- what a compile cannot show ---------------------------------------------------------------


def _statements(body) -> list:
    """The kernel's statements in execution order, each loop's body twice (its next iteration
    follows its end), branches inline (both may run)."""
    out = []
    for node in body:
        if isinstance(node, (ast.For, ast.While)):
            inner = _statements(node.body)
            out += inner + inner
        elif isinstance(node, ast.If):
            out += _statements(node.body) + _statements(node.orelse)
        else:
            out.append(node)
    return out


def _accesses(stmt) -> list[tuple[str, str]]:
    """(kind, buffer) of each tl.load / tl.store / tl.debug_barrier call in ``stmt``, in
    evaluation order (arguments before the call); a buffer is the name its address starts
    from (``last_ptr + k``: last_ptr; ``prot_ptr`` = ``scratch_ptr + E`` is a buffer of its own)."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            visit(child)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return
        if node.func.attr == "debug_barrier":
            found.append(("barrier", ""))
        elif node.func.attr in ("load", "store"):
            base = node.args[0]
            while isinstance(base, ast.BinOp):
                base = base.left
            found.append((node.func.attr, ast.unparse(base)))

    visit(stmt)
    return found


def races(source: str) -> list[str]:
    """In a kernel's ``source``: each load then store, or store then load, of one buffer with
    no ``tl.debug_barrier()`` between them (between two threads of one program either order
    can happen: a replicated element, or a lagging warp reading what another already wrote)."""
    body = ast.parse(textwrap.dedent(source)).body[0].body
    seen: dict[str, set[str]] = {"load": set(), "store": set()}
    found = []
    for stmt in _statements(body):
        for kind, buf in _accesses(stmt):
            if kind == "barrier":
                seen = {"load": set(), "store": set()}
                continue
            other = "store" if kind == "load" else "load"
            if buf in seen[other]:
                found.append(f"line {stmt.lineno}: {buf} {'read' if kind == 'load' else 'written'} after a "
                             f"{'write' if kind == 'load' else 'read'} with no barrier between")
            seen[kind].add(buf)
    return sorted(set(found))


@needs_triton
def test_decide_reads_then_writes_shared_state_across_a_barrier():
    """Review item 8: every thread loaded the step counter, thread 0 stored it, no barrier:
    a lagging warp could read the new count and age LFU counts on the wrong step."""
    from pagedexperts.paging.kernels import decide

    assert races(inspect.getsource(decide._decide_kernel.fn)) == []


def test_the_race_check_sees_a_missing_barrier():
    """The check itself, on the old kernel's pattern (load, store, no barrier) and its fix."""
    racy = """
def k(scal_ptr, out_ptr):
    steps = tl.load(scal_ptr + 1) + 1
    tl.store(scal_ptr + 1, steps)
    tl.debug_barrier()
    tl.store(out_ptr, tl.load(scal_ptr))
"""
    assert races(racy) == ["line 4: scal_ptr written after a read with no barrier between"]
    assert races(racy.replace("    tl.store(scal_ptr + 1", "    tl.debug_barrier()\n    tl.store(scal_ptr + 1")) == []
    looped = ("def k(a_ptr, n):\n    for i in range(n):\n        x = tl.load(a_ptr)\n        tl.debug_barrier()\n"
              "        tl.store(a_ptr, x + 1)\n")  # the next iteration reads what this one wrote
    assert races(looped) == ["line 3: a_ptr read after a write with no barrier between"]


@needs_triton
def test_no_compiled_variant_per_batch_size(monkeypatch):
    """Review item 5: the kernels' compile-time constants and specialised arguments must not
    depend on T (each variant costs 3-15 s of compile on a GPU): the decide kernel gets the
    same constexprs at every batch size, and the arguments that vary with T (entry count,
    waves, the wave index) are not specialised; the page-in gets the plan's base tensors (its
    wave's rows at an offset would be specialised on their alignment)."""
    from support.aot_compile import jit_of
    from pagedexperts.paging.kernels import decide, page_in

    kernels = ((decide._decide_kernel, ("num_ids", "num_waves", "admit")), (page_in._page_in_kernel, ("wave",)),
               (decide._remap_kernel, ("n",)))
    for kernel, varying in kernels:
        flags = {p.name: p.do_not_specialize for p in jit_of(kernel).params}
        assert all(flags[name] for name in varying), (kernel.fn.__name__, flags)
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.arg_names = kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(decide, "_decide_kernel", Spy(decide._decide_kernel))
    num_experts, num_slots = 16, 5
    state = DecideState.empty(num_experts, num_slots, "cpu")
    for rows in (1, 2, 3, 8, 33):
        plan = DecidePlan.empty(num_waves_for(rows * 2, num_slots, num_experts), num_experts, num_slots, "cpu")
        decide.decide_triton(state, torch.zeros((rows, 2), dtype=torch.long), plan, DecideRule(True, 4))
    constants = [{k: v for k, v in kw.items() if k.isupper() or k == "num_warps"} for _, kw in launches]
    assert all(c == constants[0] for c in constants), constants
