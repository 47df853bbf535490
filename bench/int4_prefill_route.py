"""Where a prefill route for int4 weights would pay (issue 45 item 4): torch's int4 CPU kernel
against dequantizing to bfloat16 and ``F.linear``, by rows M.

``aten._weight_int4pack_mm_for_cpu`` (the packed path, ``formats/cpu_pack.py``) widens every
code per row block, so its cost grows linearly with M; ``F.linear`` over a bfloat16 weight (oneDNN
brgemm) hardly grows with M but needs the weight dequantized. Routes, y = x @ W^T for bfloat16 x
[M, K] and W [N, K] with int4 codes and a scale per 128 columns:

- ``int4pack``: the kernel over the packed weight;
- ``dequant+linear``: the weight dequantized in torch ops from int8-held codes (q - 8, twice
  int4's bytes: the int4pack layout is opaque and capability-dependent) times bfloat16 group
  scales, then ``F.linear``: what a route by rows would run per call;
- ``linear (bf16 held)``: ``F.linear`` over a weight dequantized once (4x int4's bytes): the
  bound a route that keeps bfloat16 copies would reach.

CPU time (``time.process_time``) per matmul, warm, 1 thread, routes interleaved over ``--rounds``
rounds (order rotated), median and [min-max]; Qwen3-30B-A3B expert shapes (gate_up [1536, 2048],
down [2048, 768]).

    python bench/int4_prefill_route.py [--rounds 5] [--rows 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

GROUP = 128
SHAPES = {"gate_up [1536, 2048]": (1536, 2048), "down [2048, 768]": (2048, 768)}


def routes(n: int, k: int, x: torch.Tensor) -> dict:
    """The three routes of the module docstring over one random int4 weight [n, k]."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = torch.rand(n, k // GROUP, generator=gen) * 0.01 + 0.001
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    pair = torch.stack([scales, torch.zeros_like(scales)], -1).to(torch.bfloat16).transpose(0, 1).contiguous()
    codes, s = (q - 8).to(torch.int8), scales.to(torch.bfloat16)

    def dequantized():
        return (codes.view(n, k // GROUP, GROUP).to(torch.bfloat16) * s.unsqueeze(-1)).view(n, k)

    held = dequantized()
    return {
        "int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, pair),
        "dequant+linear": lambda: F.linear(x, dequantized()),
        "linear (bf16 held)": lambda: F.linear(x, held),
    }


def cpu_us(fn, calls: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds, CPU us per matmul, median [min-max]\n")
    print("| shape | M | int4pack | dequant+linear | linear (bf16 held) |\n| --- | --- | --- | --- | --- |")
    for name, (n, k) in SHAPES.items():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            fns = routes(n, k, x)
            order, times = list(fns), {r: [] for r in fns}
            for i in range(args.rounds):
                for r in order[i % len(order):] + order[:i % len(order)]:
                    times[r].append(cpu_us(fns[r], args.calls))
            cells = [f"{statistics.median(t):.0f} [{min(t):.0f}-{max(t):.0f}]" for t in times.values()]
            print(f"| {name} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
