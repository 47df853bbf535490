"""Experts beyond K in waves vs read in place, on a GPU: decode tok/s by batch, captured and not.

Run by ``bench/gpu_check.sh`` (phase ``beyond_k``). A 2-layer Qwen3-30B-A3B-shaped model
(``gpu_bench.REAL``, E = 128, top_k = 8) with random weights in GPTQ int4 (group 128) at K = 92
and block FP8 (128 x 128) at K = 40, ``--experts-implementation fused`` on the device-planned
step; for ``--beyond-k waves`` and ``in-place`` at batch 1, 4, 8, 16 and 32: decode tok/s with
every decode step replayed from a CUDA graph (``generation.graphs``, max batch 32: every batch
captured) and with transformers' eager generate, under the random router (near-uniform: at
batch 32 the union nears E, so waves run ceil(union / K) waves and in-place reads the misses
beyond K over the link). Each row also records the paging counters of its eager run: waves
per layer-step, multi-wave steps, page-ins and rows read in place per token. Random int4 words
are zero after the fill's float-to-int cast: the bytes moved and the kernels' times are real,
the numbers are not. The JSON is rewritten after every row (a phase cut at its limit keeps
what finished). ``--dry-run``: tiny sizes on CPU under ``TRITON_INTERPRET=1``, the static step
run eagerly.

    python bench/gpu_beyond_k.py --out DIR [--layers 2] [--dry-run]
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
sys.path.insert(0, str(ROOT / "bench"))

ROWS = (("gptq-int4", 92), ("fp8-block", 40))  # (format, K): gpu_fused's rows
BATCHES = (1, 4, 8, 16, 32)
MODES = ("waves", "in-place")


def build(name: str, k: int, args):
    from transformers import Qwen3MoeConfig

    import gpu_bench
    from gpu_fused import expert_format
    from pagedexperts.loading import build as build_module, runners

    shape = gpu_bench.TINY if args.dry_run else gpu_bench.REAL
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **shape)
    fill = lambda m, sites, stores, dev: runners.random_fill(m, sites, stores, dev, seed=0)  # noqa: E731
    return build_module.build_from_options(config, fill, expert_format=expert_format(name), num_resident=k,
                                          device=args.device, dtype=args.dtype, mode="paged",
                                          experts_implementation="fused", slot_format="packed", decide="device",
                                          cuda_graph_max_batch=max(args.batches))


def switch(model, beyond_k: str, k: int) -> None:
    """Re-attach the runners over the same stores with ``--beyond-k beyond_k`` (empty slots)."""
    from pagedexperts.loading import runners

    runners.repage(model, mode="paged", num_resident=k, beyond_k=beyond_k)
    model.pagedexperts.decode_graphs = None  # built again over the new runners (and max batch)


def measure(model, args, batch: int) -> dict:
    """Captured (or, on CPU, the static step run eagerly) and eager decode tok/s at ``batch``,
    and the eager run's paging counters."""
    import gpu_bench
    from gpu_decode import static_decode_tok_s
    from pagedexperts.generation.graphs import DecodeGraphs, decode_graphs_for

    if model.device.type == "cuda":
        graphs = decode_graphs_for(model)
    else:
        graphs = DecodeGraphs(model, backend="eager", max_batch=max(args.batches))
    run = dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    static_decode_tok_s(model, graphs, batch=batch, prompt_len=8, new_tokens=3)  # warm-up: compile, capture
    captured = static_decode_tok_s(model, graphs, **run)
    model.pagedexperts.reset_stats()
    _, eager = gpu_bench.decode_run(model, **run)
    p = model.pagedexperts.stats().as_dict(times=False)
    steps = max(1, p["layer_steps"])
    return dict(graphs_tok_s=captured, eager_tok_s=eager, graphs=graphs.summary(), waves_per_step=p["waves"] / steps,
                multi_wave_steps=p["multi_wave_steps"], page_ins_per_token=p["page_ins"] / max(1, p["tokens"]),
                in_place_rows_per_token=p["in_place_rows_per_token"], union_max=p["union_max"])


def summary(rows: list[dict]) -> str:
    na = lambda v, f=".1f": "n/a" if v is None else format(v, f)  # noqa: E731
    lines = ["| format | K | batch | beyond K | graphs tok/s | eager tok/s | waves/step | in place/token |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['K']} | {r['batch']} | {r['beyond_k']} | {na(r['graphs_tok_s'])} | "
              f"{na(r['eager_tok_s'])} | {na(r['waves_per_step'], '.2f')} | {na(r['in_place_rows_per_token'], '.1f')} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8)
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from gpu_decode import row_meta

    args.batches = BATCHES
    if args.dry_run:
        args.device, args.dtype, args.layers, args.new_tokens, args.prompt_len = "cpu", "float32", 1, 2, 2
        args.batches, rows_plan = (1, 4), (("fp8-block", 4),)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run", file=sys.stderr)
        return 2
    else:
        args.device, args.dtype, rows_plan = "cuda", "bfloat16", ROWS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for name, k in rows_plan:
        model = build(name, k, args)
        for beyond_k in MODES:
            switch(model, beyond_k, k)
            for batch in args.batches:
                row = dict(format=name, K=k, batch=batch, beyond_k=beyond_k, **row_meta(model),
                           **measure(model, args, batch))
                rows.append(row)
                print(f"  {name} K={k} batch {batch} {beyond_k}: graphs {row['graphs_tok_s']:.1f} tok/s, eager "
                      f"{row['eager_tok_s']:.1f} tok/s, {row['waves_per_step']:.2f} waves/step", flush=True)
                (out / "gpu_beyond_k.json").write_text(json.dumps(dict(rows=rows, seconds=time.perf_counter() - t0),
                                                                  indent=2, default=str))
        del model
    (out / "gpu_beyond_k.md").write_text(summary(rows))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
