"""Speculative decoding on the bundled model: tok/s, acceptance, misses and bytes paged per
generated token, with and without speculation, at batch 1 and 4, in one run.

Each mode (``none``, ``ngram``, ``draft``, ``early-exit``, ``self``) gets its own paged copy of the model (same K,
policy and prompts), so one mode's residency never warms another's slots. Per batch size B,
B prompts run greedy through the server's scheduler (``--max-running-requests`` B), every
mode once as warm-up, then ``--repeats`` rounds with the modes alternating; the table shows
medians. Decode = every step after the prompts' prefill step: decode tok/s = tokens generated
in decode / wall seconds (CPU ms per token = ``time.process_time``), misses and bytes paged
per generated token = the pager's decode counters / tokens generated in decode (a verification
step routes n + 1 tokens per request, rejected ones too). The ``draft`` mode's draft, unless
``--draft-model-path`` names another, is the shipped ``pagedexperts/data/tiny-qwen3-draft``
(distilled from the bundled model, ``scripts/train_draft.py``); ``early-exit`` drafts with the
bundled model's first ``--draft-layers`` layers (``save_truncated_draft``: untrained as a
draft, the baseline the shipped draft replaces). Greedy outputs of all modes are
compared token for token (they must be equal). Mode ``self`` drafts with the target itself
(unpaged): every greedy proposal is accepted, the bound on what a better draft does to paging
(its tok/s pays a full draft model per proposal, so it is no speed target). Usage::

    OMP_NUM_THREADS=1 python bench/speculative_bench.py --max-new-tokens 48 --repeats 3 --out results/speculative.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pagedexperts import load_model
from pagedexperts.generation.config import SamplingConfig
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import SchedulerConfig
from pagedexperts.engine.speculative.config import speculative_config
from pagedexperts.engine.speculative.draft import save_truncated_draft

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further", "KING HENRY:"]
# early-exit: the target's first layers; self: the draft is the target itself (the acceptance bound)
MODES = ("none", "ngram", "draft", "early-exit", "self")


def run_once(model, tokenizer, spec, prompts, max_new_tokens: int) -> dict:
    """One batch through a fresh scheduler: decode counters and the output ids."""
    rt = model.pagedexperts
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(len(prompts), 512), speculative=spec)
    reqs = [sched.submit(tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=max_new_tokens), lambda e: None)
            for p in prompts]
    with torch.no_grad():
        sched.step()  # the prefill step (and each request's first token)
    rt.reset_stats()
    first = sum(len(r.output_ids) for r in reqs)
    wall, cpu = time.perf_counter(), time.process_time()
    while sched.num_running or sched.num_waiting:
        with torch.no_grad():
            sched.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(r.output_ids) for r in reqs) - first
    st = rt.stats().as_dict()
    spec_stats = sched.speculative.stats.as_dict() if sched.speculative else {}
    return dict(tok_s=tokens / wall, cpu_ms_per_token=1e3 * cpu / tokens, tokens=tokens,
                forwards=sched.stats.decode_steps, misses_per_token=st["misses"] / tokens,
                bytes_per_token=st["bytes_paged"] / tokens, union_mean=st["union_mean"],
                acceptance=spec_stats.get("acceptance_rate"), accepted_per_step=spec_stats.get("mean_accepted_per_step"),
                outputs=[r.output_ids for r in reqs])


def median_row(runs: list[dict]) -> dict:
    row = {k: statistics.median(run[k] for run in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    row.update({k: runs[0][k] for k in runs[0] if not isinstance(runs[0][k], (int, float))})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-resident", type=int, default=None, help="K (default: the loader's E/4)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-model-path", default=None, help="the draft mode's draft (default: the shipped tiny-qwen3-draft)")
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the target the early-exit mode keeps")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}; none always runs")
    ap.add_argument("--batch", default="1,4", help="batch sizes, comma-separated (each <= 4 prompts)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON report path")
    args = ap.parse_args()
    modes = ["none"] + [m for m in args.modes.split(",") if m != "none"]
    if set(modes) - set(MODES):
        ap.error(f"--modes {args.modes}: unknown {sorted(set(modes) - set(MODES))}; choose from {', '.join(MODES)}")
    n = args.num_speculative_tokens
    drafts = {"draft": lambda: args.draft_model_path or str(_bundled().parent / "tiny-qwen3-draft"),
              "early-exit": lambda: save_truncated_draft(_bundled(), tempfile.mkdtemp(), num_layers=args.draft_layers),
              "self": lambda: _bundled()}
    specs = {"none": None, "ngram": speculative_config("ngram", num_speculative_tokens=n)}
    specs |= {m: speculative_config("draft", draft_model_path=str(drafts[m]()), num_speculative_tokens=n)
              for m in modes if m in drafts}
    models = {m: load_model(None, num_resident=args.num_resident) for m in modes}
    tokenizer = models["none"][1]
    report = {"num_resident": models["none"][0].pagedexperts.num_resident, "threads": torch.get_num_threads(),
              "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": args.num_speculative_tokens, "rows": []}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = PROMPTS[:batch]
        runs = {m: [] for m in modes}
        for rep in range(args.repeats + 1):  # round 0: warm-up, discarded
            for m in modes:
                result = run_once(models[m][0], tokenizer, specs[m], prompts, args.max_new_tokens)
                if rep:
                    runs[m].append(result)
        identical = all(runs[m][0]["outputs"] == runs["none"][0]["outputs"] for m in modes)
        for m in modes:
            row = median_row(runs[m])
            row.pop("outputs")
            report["rows"].append(dict(mode=m, batch=batch, identical_to_none=identical, **row))
    print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _bundled():
    from pagedexperts import bundled_model_path

    return bundled_model_path()


def print_table(report: dict) -> None:
    print(f"K={report['num_resident']}, {report['threads']} threads, {report['max_new_tokens']} new tokens, "
          f"n={report['num_speculative_tokens']} proposals per step; medians")
    print(f"{'mode':10} {'B':>2} {'tok/s':>7} {'CPU ms/tok':>10} {'accept':>7} {'acc/step':>8} {'forwards':>8} "
          f"{'union':>6} {'miss/tok':>8} {'MB/tok':>7} {'same':>5}")
    base = {r["batch"]: r for r in report["rows"] if r["mode"] == "none"}
    for r in report["rows"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        per = "-" if r["accepted_per_step"] is None else f"{r['accepted_per_step']:.2f}"
        speed = r["tok_s"] / base[r["batch"]]["tok_s"]
        print(f"{r['mode']:10} {r['batch']:>2} {r['tok_s']:7.1f} {r['cpu_ms_per_token']:10.1f} {acc:>7} {per:>8} "
              f"{r['forwards']:8.0f} {r['union_mean']:6.1f} {r['misses_per_token']:8.2f} {r['bytes_per_token'] / 1e6:7.3f} "
              f"{'yes' if r['identical_to_none'] else 'NO':>5}   x{speed:.2f} tok/s")


if __name__ == "__main__":
    main()
