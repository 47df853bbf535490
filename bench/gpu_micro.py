"""The device-planned step's kernels at Qwen3-30B-A3B's shapes: a microbenchmark of about 20 s.

Run by ``bench/gpu_check.sh`` on an NVIDIA GPU (python 3.12, torch 2.11, triton 3.6; nothing
installed). ``--dry-run`` runs the same code on CPU at tiny shapes (the kernels under
``TRITON_INTERPRET=1``; the test suite runs it). Rows (JSON and markdown under ``--out``):
1. decide: microseconds per ``decide_triton`` (one layer, E 128, top_k 8) at K 40 and 92, LRU and
   LFU, batch 1 and 8 (one wave; several at K 40), on random routing (hits and misses).
2. page_in: one wave's page-in of a bf16 layer (gate_up [2 I, H] + down [H, I]: 9.4 MB an
   expert) at count 0, 1 and 8, grid sized for batch 1: microseconds and GB/s of the GPU's
   direct reads of the page-locked, mapped host store (count 0: the cost of a wave with
   nothing to load).
3. quantized layer-step: one ``DeviceExecutor`` step of a block-FP8 layer (packed slots, each
   wave dequantized over all K) at batch 1, K 40: microseconds with 0 and top_k misses.
Times: CUDA events around ``--repeats`` calls after a warm-up (Triton's compile); on CPU,
wall time. Every row records ``decide`` ("device": these are the device-planned step's
kernels) and the torch and triton versions.

Legend: E experts, K slots, H hidden, I expert intermediate, T tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REAL = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768, ks=(40, 92), batches=(1, 8))
TINY = dict(num_experts=16, top_k=4, hidden=64, intermediate=32, ks=(4, 8), batches=(1, 4))


def timed_us(fn, *, device: torch.device, repeats: int) -> float:
    """Mean microseconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.perf_counter() - t0) / repeats


def decide_rows(shape: dict, device: torch.device, repeats: int, meta: dict) -> list[dict]:
    from pagedexperts.paging.kernels.decide import DecidePlan, decide_triton
    from pagedexperts.paging.kernels.decide import DecideState, num_waves_for
    from pagedexperts.paging.device_residency import device_rule

    e, k = shape["num_experts"], shape["top_k"]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_slots in shape["ks"]:
        for policy in ("lru", "lfu"):
            for batch in shape["batches"]:
                steps = [torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(batch)]).to(device)
                         for _ in range(16)]
                state = DecideState.empty(e, num_slots, device)
                plan = DecidePlan.empty(num_waves_for(batch * k, num_slots, e), e, num_slots, device)
                rule, turn = device_rule(policy), iter(range(1 << 62))
                us = timed_us(lambda: decide_triton(state, steps[next(turn) % len(steps)], plan, rule),
                              device=device, repeats=repeats)
                rows.append(dict(kernel="decide", K=num_slots, policy=policy, batch=batch, waves=plan.num_waves,
                                 us=us, **meta))
                print(f"  decide K={num_slots:3d} {policy} batch {batch}: {us:8.1f} us", flush=True)
    return rows


def page_in_rows(shape: dict, device: torch.device, repeats: int, meta: dict) -> list[dict]:
    from pagedexperts.formats.base import TensorSpec
    from pagedexperts.formats.slots import allocate
    from pagedexperts.paging.kernels.page_in import PageIn
    from pagedexperts.storage.host_store import HostExpertStore

    e, h, i, k = shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
    num_slots = shape["ks"][-1]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    specs = [TensorSpec("gate_up_proj", (2 * i, h), dtype), TensorSpec("down_proj", (h, i), dtype)]
    store = HostExpertStore(specs, e, pin=device.type == "cuda")
    slots = allocate(specs, num_slots, device)
    page_in = PageIn(store.tensors, slots, device, backend="triton")
    src = torch.randperm(e)[:num_slots].view(1, -1).to(device)
    dst = torch.randperm(num_slots).view(1, -1).to(device)
    rows = []
    for count in (0, 1, k):
        n = torch.tensor([count], device=device)
        us = timed_us(lambda: page_in(src, dst, n, 0, k), device=device, repeats=repeats)
        gbps = count * store.expert_bytes / (us * 1e-6) / 1e9 if count else None
        rows.append(dict(kernel="page_in", K=num_slots, count=count, expert_bytes=store.expert_bytes, us=us, gbps=gbps,
                         pinned=store.pinned, **meta))
        print(f"  page_in count {count}: {us:8.1f} us" + (f", {gbps:6.1f} GB/s" if gbps else ""), flush=True)
    store.release()
    return rows


def quantized_rows(shape: dict, device: torch.device, repeats: int, meta: dict) -> list[dict]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from pagedexperts.formats.base import ExpertLayout, QuantizedTensor, TensorSpec
    from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
    from pagedexperts.formats.slots import DequantizingSlots, allocate
    from pagedexperts.paging.device_executor import DeviceExecutor
    from pagedexperts.paging.steps.contract import SlotSetup
    from pagedexperts.storage.host_store import HostExpertStore

    e, h, i, k = shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
    num_slots, dtype = shape["ks"][0], torch.bfloat16
    cfg = Qwen3MoeConfig(num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i)
    with torch.device("meta"):  # the step reads the slots, never the module's own [E, ...] weights
        module = Qwen3MoeExperts(cfg).to(dtype)
    block = (128, 128) if device.type == "cuda" else (16, 16)
    fmt = Fp8BlockFormat(block=block)
    layout = ExpertLayout(fmt, tuple(QuantizedTensor(s, fmt.pack(s, sources=1, transposed=False)) for s in (
        TensorSpec("gate_up_proj", (2 * i, h), dtype), TensorSpec("down_proj", (h, i), dtype))))
    store = HostExpertStore(list(layout.packed_specs), e, pin=device.type == "cuda")
    for t in store.tensors.values():
        t.zero_()
    table = DequantizingSlots(layout, allocate(store.specs, num_slots, device),
                              allocate(layout.dense_specs, num_slots, device))
    pager = DeviceExecutor(layer=0, store=store, num_slots=num_slots, device=device, inner="grouped_mm", policy="lru",
                           backend="triton", setup=SlotSetup(table))
    hidden = torch.randn(1, h, dtype=dtype, device=device)
    weights = torch.full((1, k), 1.0 / k, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for misses in (0, k):
        fresh = [torch.randperm(e, generator=gen)[:k].view(1, k).to(device) for _ in range(16)]
        turn = iter(range(1 << 62))
        ids = (lambda: fresh[0]) if misses == 0 else (lambda: fresh[next(turn) % len(fresh)])
        us = timed_us(lambda: pager.step(module, hidden, ids(), weights), device=device, repeats=repeats)
        rows.append(dict(kernel="quantized_layer_step", format=fmt.name, K=num_slots, batch=1, misses=misses, us=us,
                         **meta))
        print(f"  quantized layer-step ({fmt.name}, K={num_slots}) misses {misses}: {us:8.1f} us", flush=True)
    store.release()
    return rows


def summary(result: dict) -> str:
    lines = [f"# gpu_micro {result['date']} on {result['device']} (torch {result['torch']}, triton {result['triton']})",
             "", "| kernel | K | case | us | GB/s |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        case = {"decide": lambda: f"{r['policy']} batch {r['batch']} ({r['waves']} waves)",
                "page_in": lambda: f"count {r['count']}",
                "quantized_layer_step": lambda: f"{r['format']} batch 1, {r['misses']} misses"}[r["kernel"]]()
        gbps = f"{r['gbps']:.1f}" if r.get("gbps") else "-"
        lines.append(f"| {r['kernel']} | {r['K']} | {case} | {r['us']:.1f} | {gbps} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, the kernels interpreted")
    p.add_argument("--out", default="results/gpu", help="output folder")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1 set before python starts (the kernels on CPU)", file=sys.stderr)
            return 2
        device, shape, repeats = torch.device("cpu"), TINY, 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run", file=sys.stderr)
            return 2
        device, shape, repeats = torch.device("cuda"), REAL, args.repeats
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_decode import versions
    from pagedexperts.analysis import linkbench

    meta = dict(decide="device", **versions())
    result = dict(date=time.strftime("%Y-%m-%d"), device=linkbench.accelerator_name() or "cpu (dry run)", **meta,
                  rows=[])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for part in (decide_rows, page_in_rows, quantized_rows):
        result["rows"] += part(shape, device, repeats, meta)
        (out / "gpu_micro.json").write_text(json.dumps(result, indent=2))
        print(f"[{part.__name__} done, {time.perf_counter() - t0:.1f} s]", flush=True)
    (out / "gpu_micro.md").write_text(summary(result))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
