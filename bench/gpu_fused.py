"""Fused MoE kernels against the dequantizing path on a GPU: decode tok/s over packed quantized slots.

Run by ``bench/gpu_check.sh`` (phase ``fused``). A 4-layer Qwen3-30B-A3B-shaped model
(``gpu_bench.REAL``) with random weights in two packed formats: GPTQ int4 (group 128, no
act-order) at K = 92 and block FP8 (128 x 128) at K = 40 (the seed's rows). For each format,
paged with ``--experts-implementation fused`` (decode steps replayed from CUDA graphs: packed
slots read in place, capturable) and with ``grouped_mm`` over the dequantizing path (every wave
dequantizes all K slots; not capturable: eager generate), at batch 1 and 4, under the random
router. Random int4 words are zero after the fill's float-to-int cast: the bytes moved and the
kernels' times are real, the numbers are not. ``--dry-run``: tiny sizes on CPU under
``TRITON_INTERPRET=1`` (set here before anything imports Triton), the static step run eagerly.

    python bench/gpu_fused.py --out DIR [--layers 4] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = (("gptq-int4", 92), ("fp8-block", 40))  # (format, K)
BATCHES = (1, 4)


def expert_format(name: str):
    from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
    from pagedexperts.formats.gptq.gptq import GptqFormat

    if name == "gptq-int4":
        return GptqFormat(group_size=128, desc_act=False, zero_offset=1)
    return Fp8BlockFormat(block=(128, 128))


def build(name: str, k: int, args):
    from transformers import Qwen3MoeConfig

    import gpu_bench
    from pagedexperts.loading import build as build_module, runners

    shape = gpu_bench.TINY if args.dry_run else gpu_bench.REAL
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **shape)
    fill = lambda m, sites, stores, dev: runners.random_fill(m, sites, stores, dev, seed=0)  # noqa: E731
    return build_module.build_from_options(config, fill, expert_format=expert_format(name), num_resident=k,
                                          device=args.device, dtype=args.dtype, mode="paged",
                                          experts_implementation="fused", slot_format="packed", decide="device")


def switch(model, implementation: str, k: int) -> None:
    """Re-attach the runners over the same stores with ``implementation``."""
    from pagedexperts.loading import runners

    runners.repage(model, mode="paged", num_resident=k, experts_implementation=implementation)


def rows_for(name: str, k: int, args) -> list[dict]:
    import gpu_bench
    import gpu_decode

    model = build(name, k, args)
    out = []
    for implementation in ("fused", "grouped_mm"):
        switch(model, implementation, k)
        for batch in BATCHES:
            run = dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
            row = dict(format=name, K=k, batch=batch, implementation=implementation, **gpu_decode.row_meta(model),
                       **gpu_decode.graphs_row(model, args, run, gpu_bench.decode_run))
            out.append(row)
            print(f"  {name} K={k} batch {batch} {implementation}: graphs {row['graphs_tok_s']} tok/s, eager "
                  f"{row['eager_router_tok_s']} tok/s" + (f" (graphs off: {row['graphs_off']})" if row["graphs_off"] else ""),
                  flush=True)
    return out


def summary(rows: list[dict]) -> str:
    na = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = ["| format | K | batch | experts | graphs tok/s | eager tok/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['K']} | {r['batch']} | {r['implementation']} | {na(r['graphs_tok_s'])} | "
              f"{na(r['eager_router_tok_s'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.dry_run:
        args.device, args.dtype, args.layers, args.new_tokens, args.prompt_len = "cpu", "float32", 1, 3, 4
        rows_plan = (("fp8-block", 4),)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run", file=sys.stderr)
        return 2
    else:
        args.device, args.dtype, rows_plan = "cuda", "bfloat16", ROWS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for name, k in rows_plan:
        rows += rows_for(name, k, args)
        (out / "gpu_fused.json").write_text(json.dumps(dict(rows=rows, seconds=time.perf_counter() - t0), indent=2))
    (out / "gpu_fused.md").write_text(summary(rows))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
