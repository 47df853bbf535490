"""CPU time of one expert's dequantization per format, two source trees in ONE process.

The dequantizing path (``ExpertFormat.dequantize``, what ``formats.slots`` runs per wave or at
page-in: the CPU default for quantized checkpoints) at Qwen3-30B-A3B's shapes: hidden 2048,
moe intermediate 768 (``gate_up_proj`` [1536, 2048] from gate + up, ``down_proj`` [2048, 768]),
group 128, block 128 x 128, experts in bfloat16, random packed rows valid for each role (any
int4 code, e4m3 values without NaN, positive scales, E8M0 exponents near 2**0, GPTQ's g_idx
``k // 128``). ``--before DIR``: a source tree (e.g. ``git archive main | tar -x -C DIR``) whose
``pagedexperts/formats`` is loaded beside this checkout's under another package name (its
imports rewritten), so that both run in this process, interleaved: every round times each
format in both trees in turn (the order alternating between rounds), after a warm-up round.
Each timing is ``time.process_time`` of one ``ExpertLayout.dequantize`` of one expert (both
projections). Prints per format the median seconds of each tree and the median [min-max] of
after / before over the rounds, and checks that both trees give the same bits (torch.equal).

Usage: PYTHONPATH=. python bench/dequantize_speed.py [--before DIR] [--rounds 15] [--threads 1]
       [--formats gptq w4a16 awq fp8-block]
CPU timings of this machine; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE, GROUP = 2048, 768, 128
DTYPE = torch.bfloat16
# module -> its name in a tree whose formats/ was still flat (before issue 47 grouped it by family)
FLAT_MODULES = {"compressed_tensors.packed": "ct_packed", "compressed_tensors.w4a16": "compressed_tensors",
                "compressed_tensors.fp4": "ct_fp4", "compressed_tensors.fp8": "ct_fp8", "compressed_tensors.int8": "ct_int8",
                "gptq.gptq": "gptq", "gptq.autoround": "autoround", "gptq.awq": "awq", "fp8_fp4.fp8_block": "fp8",
                "fp8_fp4.int8_block": "int8_block", "fp8_fp4.modelopt": "modelopt"}


def bound_formats(pkg: str) -> dict:
    """name -> the format instance of package ``pkg`` (``pagedexperts.formats`` or a copy)."""
    def mod(name: str):
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError:  # a --before tree from before formats/ was grouped by family
            return importlib.import_module(f"{pkg}.{FLAT_MODULES[name]}")

    packed = mod("compressed_tensors.packed")
    args = {"gate_up_proj": packed.PackedArgs(4, GROUP, False, True), "down_proj": packed.PackedArgs(4, GROUP, False, True)}
    return {
        "gptq": mod("gptq.gptq").GptqFormat(group_size=GROUP, desc_act=False, zero_offset=1),
        "gptq-2bit": mod("gptq.gptq").GptqFormat(group_size=GROUP, desc_act=False, zero_offset=1, bits=2),
        "gptq-8bit-act-order": mod("gptq.gptq").GptqFormat(group_size=GROUP, desc_act=True, zero_offset=0, bits=8),
        "auto-round": mod("gptq.autoround").AutoRoundFormat(group_size=GROUP, bits=4, zero_offset=1),
        "w4a16": mod("compressed_tensors.w4a16").CompressedTensorsW4A16Format(group_size=GROUP, symmetric=True,
                                                                        scale_dtype=DTYPE),
        "w4a16-asym": mod("compressed_tensors.w4a16").CompressedTensorsW4A16Format(group_size=GROUP, symmetric=False,
                                                                             scale_dtype=DTYPE),
        "awq": mod("gptq.awq").AwqFormat(group_size=GROUP),
        "fp8-block": mod("fp8_fp4.fp8_block").Fp8BlockFormat(block=(128, 128)),
        "int8-block": mod("fp8_fp4.int8_block").Int8BlockFormat(block=(128, 128)),
        "ct-pack-mixed-g_idx": packed.CompressedTensorsMixedPackedFormat(args, scale_dtype=DTYPE),
        "nvfp4": mod("compressed_tensors.fp4").CompressedTensorsNvfp4Format(),
        "ct-mxfp4": mod("compressed_tensors.fp4").CompressedTensorsMxfp4Format(),
        "ct-fp8-block": mod("compressed_tensors.fp8").CompressedTensorsFp8Format(
            {"gate_up_proj": ("block", (128, 128), torch.float32), "down_proj": ("block", (128, 128), torch.float32)}),
        "ct-mxfp8": mod("compressed_tensors.fp8").CompressedTensorsFp8Format(
            {"gate_up_proj": ("group", (1, 32), torch.uint8), "down_proj": ("group", (1, 32), torch.uint8)}),
        "w8a8-int8": mod("compressed_tensors.int8").CompressedTensorsInt8Format(scale_dtype=DTYPE),
        "modelopt-fp8": mod("fp8_fp4.modelopt").ModelOptFp8Format(DTYPE),
        "modelopt-nvfp4": mod("fp8_fp4.modelopt").ModelOptNvfp4Format(DTYPE),
    }


def layout_of(pkg: str, fmt):
    spec = importlib.import_module(f"{pkg}.base").TensorSpec
    dense = (spec("gate_up_proj", (2 * INTERMEDIATE, HIDDEN), DTYPE), spec("down_proj", (HIDDEN, INTERMEDIATE), DTYPE))
    return fmt.layout(dense, sources={"gate_up_proj": 2})


def random_rows(specs, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One expert's packed rows {name: [1, *shape]}, valid for each role."""
    rows = {}
    for s in specs:
        shape = (1, *s.shape)
        if s.name.endswith("_g_idx"):
            in_features = HIDDEN if s.name.startswith("gate_up") else INTERMEDIATE
            rows[s.name] = (torch.arange(s.shape[0]) % in_features // GROUP).to(s.dtype).view(shape)
        elif s.dtype == torch.uint8 and s.name.endswith(("_scale", "_scales")):
            rows[s.name] = torch.randint(120, 135, shape, generator=gen).to(s.dtype)
        elif s.dtype in (torch.int32, torch.int64, torch.uint8, torch.int8):
            lo, hi = {torch.uint8: (0, 256), torch.int8: (-128, 128)}.get(s.dtype, (-(1 << 31), 1 << 31))
            rows[s.name] = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(s.dtype)
        elif s.dtype == torch.float8_e4m3fn:
            rows[s.name] = torch.randn(shape, generator=gen).mul(50).clamp(-448, 448).to(s.dtype)
        else:
            rows[s.name] = (torch.rand(shape, generator=gen) * 0.1 + 0.01).to(s.dtype)
    return rows


def load_copy(tree: Path, workdir: Path) -> str:
    """``tree``'s ``pagedexperts/formats`` as the package ``before_formats`` (imports rewritten)."""
    dst = workdir / "before_formats"
    shutil.copytree(tree / "pagedexperts" / "formats", dst)
    for f in dst.rglob("*.py"):
        f.write_text(re.sub(r"\bpagedexperts\.formats\b", "before_formats", f.read_text()))
    sys.path.insert(0, str(workdir))
    return "before_formats"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="source tree to compare against (its pagedexperts/formats)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: less noise on a shared machine)")
    parser.add_argument("--formats", nargs="+", default=["gptq", "w4a16", "awq", "fp8-block"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trees = {"after": "pagedexperts.formats"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            trees = {"before": load_copy(args.before.resolve(), Path(tmp)), **trees}
        cases = {}
        for name in args.formats:
            rows = None
            for tree, pkg in trees.items():
                layout = layout_of(pkg, bound_formats(pkg)[name])
                rows = rows or random_rows(layout.packed_specs, torch.Generator().manual_seed(0))
                cases[name, tree] = (layout, rows)
        outputs = {key: layout.dequantize(rows) for key, (layout, rows) in cases.items()}  # warm-up
        times = {key: [] for key in cases}
        for r in range(args.rounds):
            for name in args.formats:
                for tree in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    layout, rows = cases[name, tree]
                    start = time.process_time()
                    layout.dequantize(rows)
                    times[name, tree].append(time.process_time() - start)
    print(f"dequantize one expert (H {HIDDEN}, I {INTERMEDIATE}, group {GROUP}, {DTYPE}), {args.threads} thread(s), "
          f"{args.rounds} rounds: median seconds; ratio after / before median [min-max]")
    for name in args.formats:
        line = f"{name:22s}" + "".join(f" {tree} {statistics.median(times[name, tree]) * 1e3:7.2f} ms"
                                       for tree in trees)
        if "before" in trees:
            ratios = [a / b for a, b in zip(times[name, "after"], times[name, "before"])]
            same = all(torch.equal(outputs[name, "after"][k], v) for k, v in outputs[name, "before"].items())
            line += (f"  ratio {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                     f"  bits {'equal' if same else 'DIFFER'}")
        print(line)


if __name__ == "__main__":
    main()
