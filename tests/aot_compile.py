"""Ahead-of-time compilation of a Triton kernel for a CUDA arch, without a GPU: registers, spills.

``compile_for_arch`` runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
(Triton lowers to PTX and runs its bundled ``ptxas``; no driver is touched) and reads the
cubin's resource usage with the bundled ``cuobjdump``: ``n_regs`` registers per thread and
``n_spills`` bytes of local memory per thread, which is where ptxas puts spilled registers
(what Triton itself reports as ``n_spills``: the function's LOCAL_SIZE_BYTES). Triton caches
compiles on disk (``~/.triton/cache``), so a second run only reads the cubins.

Under ``TRITON_INTERPRET=1`` (the CPU test runs: conftest sets it before triton is imported)
every ``@triton.jit`` function, Triton's own ``tl.sum`` / ``tl.cumsum`` included, is an
interpreter function that cannot be compiled. The compile then runs in one worker process
started without the variable (kept for the session, fed one JSON request per line; it exits
when this process closes its stdin), which imports the kernel's module by name.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class CompiledInfo:
    """Per-thread registers and spill (local memory) bytes of one kernel compiled for ``arch``."""

    n_regs: int
    n_spills: int
    arch: int


def _cuobjdump() -> str:
    from triton.backends.nvidia import compiler

    return os.path.join(os.path.dirname(compiler.__file__), "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) of the one function in ``cubin``, from ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    if not regs or not local:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text!r}")
    return int(regs.group(1)), int(local.group(1))


def _compile_here(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int,
                  divisible: list[str]) -> tuple[int, int]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return resource_usage(compiled.asm["cubin"])


def _encode(value):
    import triton.language as tl

    return {"dtype": value.name} if isinstance(value, tl.dtype) else value


def _decode(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value


@functools.cache
def _worker() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def compile_for_arch(kernel, *, signature: dict[str, str], constexprs: dict, arch: int, num_warps: int = 4,
                     num_stages: int = 3, divisible: tuple[str, ...] = ()) -> CompiledInfo:
    """Compile ``kernel`` (a ``@triton.jit`` function of an importable module) for sm_``arch``.

    ``signature``: every non-constexpr parameter -> its Triton type ("*bf16", "*i64", "i32");
    ``constexprs``: every constexpr parameter -> its value (ints, bools, strings, None, tl dtypes);
    ``divisible``: parameters known to be multiples of 16 (pointers 16-byte aligned, ints), as
    Triton's launcher specialises them at run time.

    Raises:
        RuntimeError: the kernel does not compile for ``arch`` (the compiler's message)."""
    import triton

    if not triton.knobs.runtime.interpret:
        return CompiledInfo(*_compile_here(kernel, signature, constexprs, arch, num_warps, num_stages, list(divisible)),
                            arch)
    request = dict(module=kernel.fn.__module__, name=kernel.fn.__name__, signature=signature,
                   constexprs={k: _encode(v) for k, v in constexprs.items()}, arch=arch, num_warps=num_warps,
                   num_stages=num_stages, divisible=list(divisible))
    worker = _worker()
    worker.stdin.write(json.dumps(request) + "\n")
    worker.stdin.flush()
    reply = json.loads(worker.stdout.readline() or '{"error": "the compile worker exited"}')
    if "error" in reply:
        raise RuntimeError(f"{kernel.fn.__name__} does not compile for sm_{arch}:\n{reply['error']}")
    return CompiledInfo(reply["n_regs"], reply["n_spills"], arch)


def _serve() -> None:
    """The worker: one JSON request per stdin line -> one JSON reply per stdout line."""
    import traceback

    replies, sys.stdout = sys.stdout, sys.stderr  # anything the compiler prints stays off the reply channel
    for line in sys.stdin:
        r = json.loads(line)
        try:
            fn = getattr(importlib.import_module(r["module"]), r["name"])
            regs, spills = _compile_here(fn, r["signature"], {k: _decode(v) for k, v in r["constexprs"].items()},
                                         r["arch"], r["num_warps"], r["num_stages"], r["divisible"])
            reply = {"n_regs": regs, "n_spills": spills}
        except Exception:  # noqa: BLE001 (sent back to the test, which raises it)
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
