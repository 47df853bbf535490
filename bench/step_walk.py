"""The layer-step walk: package modules and functions one decode step of one MoE layer crosses.

Loads the bundled model (float32, CPU) paged with K = 16, runs a batch-2 prefill and two decode
steps, and on the second decode step records, with ``sys.setprofile``, every Python function of
the ``pagedexperts`` package called from ``integration.paged_experts_forward`` down in the first
MoE layer (the dispatcher itself included; transformers', torch's and Triton's own functions are
not counted). A function is counted once however often it runs; a module is a package file.
Two counts:

- functions: the package's functions and lambdas, and each Triton kernel launched (its body, run
  by the interpreter on a CPU, is one function: on a GPU it is one launch), not the
  ``@triton.jit`` helpers a kernel calls (inlined into the kernel by the compiler) nor the
  comprehensions and generator expressions inside a function (their own code objects only on
  some Python versions: PEP 709 inlines comprehensions from 3.12);
- raw: every package code object the profiler saw (helpers and comprehensions included).

The count is deterministic (fixed seed, fixed routing): issue 37's target is at most 8 modules
and 24 functions per path (``tests/paging/test_step_walk.py`` keeps each path within its bound).

Paths: "host" (host-planned, grouped_mm), "device" (device-planned grouped_mm, the decide /
page-in / remap kernels as their torch references, or as Triton kernels with ``--device-kernels
triton`` under ``TRITON_INTERPRET=1``), "fused" (device-planned fused; needs triton and
``TRITON_INTERPRET=1``, set by this script before anything imports triton).

Usage: python bench/step_walk.py [--path host device fused] [--device-kernels torch|triton] [--list]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PATHS = {  # path -> load_model options
    "host": dict(decide="host", experts_implementation="grouped_mm"),
    "device": dict(decide="device", experts_implementation="grouped_mm"),
    "fused": dict(decide="device", experts_implementation="fused"),
    # torch's packed int4 / int8 CPU matmuls (host-planned): needs --model-path of an int4 / int8 checkpoint
    "packed": dict(decide="host", experts_implementation="packed"),
}
BATCH, NUM_RESIDENT, PROMPT = 2, 16, 3


INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # parts of a function, not functions


@dataclass(frozen=True)
class Walk:
    """What one layer-step crossed: ``functions`` (module, qualified name) in first-call order
    (the count's rule, module docstring), ``raw`` every package code object seen."""

    functions: tuple[tuple[str, str], ...]
    raw: tuple[tuple[str, str], ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m for m, _ in self.functions))


def _module_of(filename: str, root: Path) -> str | None:
    """``pagedexperts.x.y`` for a file of the package, else None."""
    try:
        rel = Path(filename).resolve().relative_to(root)
    except ValueError:
        return None
    parts = (root.name, *rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _kernel_codes(root: Path) -> set[tuple[str, str]]:
    """(file, name) of every ``@triton.jit`` function of the package's imported modules."""
    out = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(root.name + ".") or module is None:
            continue
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if type(value).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(fn, "__code__"):
                out.add((str(Path(fn.__code__.co_filename).resolve()), fn.__name__))
    return out


def record_walk(model, input_ids, **forward_kw) -> Walk:
    """Run ``model(input_ids, **forward_kw)`` and record the first paged experts step's walk."""
    import pagedexperts
    from pagedexperts.integration import paged_experts_forward

    root = Path(pagedexperts.__file__).resolve().parent
    entry = paged_experts_forward.__code__
    kernels = _kernel_codes(root)
    counted: dict = {}
    raw: dict = {}
    state = {"frame": None, "done": False, "kernel": None}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if state["frame"] is None:
                if state["done"] or code is not entry:
                    return
                state["frame"] = frame
            module = _module_of(code.co_filename, root)
            if module is None:
                return
            name, key = (module, code.co_qualname), (code.co_filename, code.co_firstlineno, code.co_qualname)
            raw.setdefault(key, name)
            is_kernel = (str(Path(code.co_filename).resolve()), code.co_name) in kernels
            if state["kernel"] is None and is_kernel:
                state["kernel"] = frame  # a launched kernel: its helpers are part of it
            elif state["kernel"] is not None or code.co_name in INLINE:
                return
            counted.setdefault(key, name)
        elif event == "return":
            if frame is state["kernel"]:
                state["kernel"] = None
            if frame is state["frame"]:
                state["frame"], state["done"] = None, True

    sys.setprofile(profile)
    try:
        model(input_ids, **forward_kw)
    finally:
        sys.setprofile(None)
    if not state["done"]:
        raise RuntimeError("no paged experts step ran (is the model paged?)")
    return Walk(tuple(counted.values()), tuple(raw.values()))


def walk(path: str, *, device_kernels: str = "triton", model_path=None, num_resident: int = NUM_RESIDENT) -> Walk:
    """The walk of one decode step (batch 2, the second decode step) of the first MoE layer of
    ``model_path`` (None: the bundled model; a copy cut to its first layers walks the same) at
    K = ``num_resident``."""
    import torch

    from pagedexperts.loading.loader import load_model

    options = dict(PATHS[path], device_kernels=device_kernels) if PATHS[path]["decide"] != "host" else PATHS[path]
    model, _ = load_model(model_path, num_resident=num_resident, dtype="float32", check_independence=False,
                          **options)
    ids = torch.randint(1, 4000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        for step in range(2):
            nxt = out.logits[:, -1:].argmax(-1)
            if step == 1:
                return record_walk(model, nxt, past_key_values=past, use_cache=True)
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
    raise AssertionError("unreachable")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", nargs="+", choices=list(PATHS), default=["host", "device", "fused"],
                        help="default: host device fused (packed needs --model-path of an int4 / int8 checkpoint)")
    parser.add_argument("--device-kernels", choices=("torch", "triton"), default="triton",
                        help="the device decide / page-in / remap as Triton kernels (interpreted on a CPU; issue 37 "
                             "counted these) or as their torch references")
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument("--num-resident", type=int, default=NUM_RESIDENT, help=f"K (default {NUM_RESIDENT})")
    parser.add_argument("--list", action="store_true", help="print every function crossed")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    if "packed" in args.path and args.model_path is None:
        parser.error("--path packed needs --model-path of an int4 / int8 checkpoint (the bundled model is bfloat16)")
    print(f"one decode step of one MoE layer, {args.model_path or 'bundled model'}, batch {BATCH}, K = {args.num_resident}, "
          f"device kernels {args.device_kernels}")
    for path in args.path:
        w = walk(path, device_kernels=args.device_kernels, model_path=args.model_path, num_resident=args.num_resident)
        raw_modules = len(dict.fromkeys(m for m, _ in w.raw))
        print(f"{path:7s} {len(w.modules):3d} modules {len(w.functions):3d} functions "
              f"(raw: {raw_modules} modules, {len(w.raw)} code objects)")
        if args.list:
            for module in w.modules:
                names = [f for m, f in w.functions if m == module]
                print(f"    {module}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
