"""Ahead-of-time compile of a Triton kernel for a GPU architecture, without a GPU.

``compile_for_arch`` runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
(what the JIT does at a launch, for a given signature and constants) and reads the compiled
kernel's registers and spills from ``ptxas -v`` over its PTX (run by Triton's own
``make_cubin``: the ptxas and flags Triton compiles with). Nothing touches a GPU or a CUDA
driver: it runs in the CPU suite. Results are cached for the test session
(``functools.cache``); Triton's on-disk cache, and the ptxas figures kept beside each kernel
in it, make a later session fast. Under the Triton interpreter the compiles run in a worker
process without it (``compile_for_arch``). Used by tests/paging/kernels/test_kernels_aot.py and the
fused-kernel tests.

Signature types are Triton's: "*i64", "*bf16", "i32", "constexpr", a tuple of them for a tuple
argument; a pointer hinted "*i64:16" is compiled as 16-byte aligned (what the launcher
specialises an aligned tensor to; unhinted pointers compile without that assumption); a
constexpr inside a tuple argument is keyed by its path (argument index, element index, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class CompiledInfo:
    """One compiled kernel: ``n_regs`` registers per thread, ``n_spills`` bytes of spill
    stores per thread (ptxas's "bytes spill stores"), ``arch`` (80, 89, 90), ``spill_loads``
    bytes of spill loads, ``shared`` bytes of shared memory (Triton's metadata), ``name``."""

    n_regs: int
    n_spills: int
    arch: int
    spill_loads: int = 0
    shared: int = 0
    name: str = ""


def compile_for_arch(kernel, *, signature: dict[str, str], constexprs: dict, arch: int,
                     num_warps: int = 4, num_stages: int = 3) -> CompiledInfo:
    """Compile ``kernel`` (a module-level ``@triton.jit`` function) for ``sm_{arch}``.

    Under ``TRITON_INTERPRET=1`` (the CPU suite: conftest sets it) Triton's code generator
    cannot run in this process (the interpreter takes over ``tl``'s builders), so the compile
    runs in one worker process started without it (spawned once per session).

    Args:
        signature: every argument's type by name ("constexpr" for those in ``constexprs``).
        constexprs: the compile-time constants by name.
        arch: compute capability x 10 (80 A100, 89 L4/4090, 90 H100/H200).

    Raises:
        triton.CompilationError (or RuntimeError from ptxas): the kernel does not compile.
    """
    fn = getattr(kernel, "fn", kernel)
    return _cached((fn.__module__, fn.__name__, tuple(signature.items()), tuple(constexprs.items()), arch,
                    num_warps, num_stages))


def jit_of(kernel):
    """The ``JITFunction`` of ``kernel`` with its decorator's arguments (``do_not_specialize``
    ...): the kernel itself, or under ``TRITON_INTERPRET=1`` one built from its Python function."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))


@functools.cache
def _cached(request: tuple) -> CompiledInfo:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _worker().submit(_compile, request).result()
    return _compile(request)


@functools.cache
def _worker() -> ProcessPoolExecutor:
    """One spawned process (the interpreter switched off before anything imports triton)."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_no_interpreter)


def _no_interpreter() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


def _compile(request: tuple) -> CompiledInfo:
    """``compile_for_arch`` in a process where the kernel is a real ``JITFunction``."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature_items, constexpr_items, arch, num_warps, num_stages = request
    kernel = getattr(importlib.import_module(module), name)
    signature, constexprs = dict(signature_items), dict(constexpr_items)
    attrs, types = {}, {}
    for index, (arg, ty) in enumerate(signature.items()):
        types[arg] = _leaf_types(ty, (index,), attrs)
    compiled = triton.compile(ASTSource(kernel, types, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return _cached_usage(compiled, arch, num_warps, num_stages)


def _leaf_types(ty, path: tuple, attrs: dict):
    """``ty`` without its ":16" hints (a tuple argument's types leaf by leaf), each hint recorded in
    ``attrs`` at its path (argument index, element index, ...) as Triton's divisibility."""
    if isinstance(ty, tuple):
        return tuple(_leaf_types(t, path + (i,), attrs) for i, t in enumerate(ty))
    if ty.endswith(":16"):
        attrs[path] = [["tt.divisibility", 16]]
    return ty.split(":")[0]


def _cached_usage(compiled, arch: int, num_warps: int, num_stages: int) -> CompiledInfo:
    """Registers and spills of ``compiled``, kept in Triton's cache beside the kernel (keyed
    by its hash): a later session reads them instead of running ptxas again."""
    from triton.runtime.cache import get_cache_manager

    cache = get_cache_manager(hashlib.sha256(f"aot-usage-{compiled.metadata.hash}".encode()).hexdigest())
    found = cache.get_file("usage.json")
    if found is not None:
        with open(found) as f:
            return CompiledInfo(**json.load(f))
    log = _ptxas_log(compiled.asm["ptx"], arch, num_warps, num_stages)
    info = _usage(log, arch, compiled.metadata.name, compiled.metadata.shared)
    cache.put(json.dumps(dataclasses.asdict(info)), "usage.json", binary=False)
    return info


def _ptxas_log(ptx: str, arch: int, num_warps: int, num_stages: int) -> str:
    """``ptxas -v`` output for ``ptx``, run by Triton's own ``make_cubin`` (its ptxas, its
    flags) with its ``dump_ptxas_log`` knob on (Triton's cache skips ptxas on a hit)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    opt = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    before, knobs.nvidia.dump_ptxas_log = knobs.nvidia.dump_ptxas_log, True
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            backend.make_cubin(ptx, {}, opt, arch)
    finally:
        knobs.nvidia.dump_ptxas_log = before
    return out.getvalue()


def _usage(log: str, arch: int, name: str, shared: int) -> CompiledInfo:
    """Registers and spills from a ``ptxas -v`` log ("Used N registers", "N bytes spill
    stores, M bytes spill loads")."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no register count in the ptxas -v output for {name} on sm_{arch}: {log[-2000:]}")
    return CompiledInfo(n_regs=int(regs.group(1)), n_spills=int(spills.group(1)), arch=arch,
                        spill_loads=int(spills.group(2)), shared=shared, name=name)
