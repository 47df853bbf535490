"""Host overhead of the host-planned path on CPU: CPU time per decode token, paged vs plain.

Issue 23 item 6: at K = E and K = 16 (bundled model, batch 1, 1 thread) the paged model must
cost at most 1.05x plain transformers' CPU time per decode token. Plain is transformers' own
``AutoModelForCausalLM.from_pretrained`` with the same experts implementation, nothing attached.

Method (developer guide): CPU time (``time.process_time``), one process, every model warmed up
first, then rounds in which the modes alternate (the order rotates each round, to cancel
drift); per round and mode a greedy decode of ``--tokens`` tokens after an untimed prefill,
fed its own argmax with the attention mask ``generate`` would pass. Ratios are taken per
round (paged / plain of the same round) and reported as median [min, max] over the rounds.
Every paged decode is checked against plain's tokens and logits (torch.equal): a fast path
that changed the output fails the bench.

``--compare DIR``: run this script alternately from DIR (e.g. a checkout of the branch's
start, on PYTHONPATH) and from this tree, ``--runs`` times each, in subprocesses (two copies of
the package cannot share one process: one custom op name), and print both tables.

Usage: python bench/host_overhead.py [--tokens 16] [--rounds 21] [--num-resident 64,16]
       [--experts-implementation grouped_mm] [--compare /tmp/base --runs 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def decode(model, prompt: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(CPU seconds per decode token, tokens [tokens], logits [tokens, V]) of a greedy decode
    after an untimed prefill of ``prompt`` [1, P]."""
    with torch.inference_mode():
        mask = torch.ones_like(prompt)
        out = model(input_ids=prompt, attention_mask=mask, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        toks, logits = [], []
        t0 = time.process_time()
        for _ in range(tokens):
            mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            toks.append(tok)
            logits.append(out.logits[:, -1])
        per_token = (time.process_time() - t0) / tokens
    return per_token, torch.cat(toks).reshape(-1), torch.cat(logits)


def load_models(ks: list[int], impl: str) -> dict:
    from transformers import AutoModelForCausalLM

    import pagedexperts

    path = pagedexperts.bundled_model_path()
    models = {"plain": AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl).eval()}
    for k in ks:
        models[f"paged K={k}"] = pagedexperts.load_model(path, num_resident=k, experts_implementation=impl)[0].eval()
    return models


def measure(args) -> dict[str, list[float]]:
    """Per mode, the CPU seconds per decode token of each round (modes alternating)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = load_models(args.num_resident, args.experts_implementation)
    prompt = torch.randint(2, 4096, (1, args.prompt_tokens))
    ref = {}
    for name, model in models.items():  # warm-up, and the reference output
        for _ in range(2):
            ref[name] = decode(model, prompt, args.tokens)[1:]
    names = list(models)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t, toks, logits = decode(models[name], prompt, args.tokens)
            if not (torch.equal(toks, ref["plain"][0]) and torch.equal(logits, ref["plain"][1])):
                raise SystemExit(f"{name}: decode differs from plain transformers (not exact)")
            times[name].append(t)
    return times


def table(times: dict[str, list[float]], label: str) -> str:
    plain = times["plain"]
    lines = [f"## {label}", "| mode | ms / decode token, median [min, max] | ratio to plain, median [min, max] |",
             "|---|---|---|"]
    for name, ts in times.items():
        ms = f"{statistics.median(ts) * 1e3:.3f} [{min(ts) * 1e3:.3f}, {max(ts) * 1e3:.3f}]"
        ratios = [t / p for t, p in zip(ts, plain)]
        rs = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        lines.append(f"| {name} | {ms} | {rs if name != 'plain' else '1'} |")
    return "\n".join(lines)


def compare(args, argv: list[str]) -> None:
    """Alternate subprocess runs of this script from ``args.compare`` (before) and this tree."""
    inner = [a for a in argv if a not in ("--compare", args.compare, "--runs", str(args.runs))]
    trees = {"before": Path(args.compare).resolve(), "after": ROOT}
    for run in range(args.runs):
        for label, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
            script = tree / "bench" / "host_overhead.py"
            script = script if script.exists() else Path(__file__).resolve()
            cmd = [sys.executable, str(script), *inner, "--label", f"{label} ({tree}), run {run + 1}"]
            print(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16, help="decode tokens per round and mode")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=21, help="rounds (>= 7): medians over them")
    p.add_argument("--num-resident", type=lambda s: [int(x) for x in s.split(",")], default=[64, 16])
    p.add_argument("--experts-implementation", default="grouped_mm")
    p.add_argument("--compare", default=None, help="a tree to run alternately with this one (before)")
    p.add_argument("--runs", type=int, default=2, help="with --compare: runs of each tree")
    p.add_argument("--label", default=f"this tree ({ROOT})")
    args = p.parse_args(argv)
    if args.compare:
        compare(args, argv)
        return
    import pagedexperts

    print(f"pagedexperts from {Path(pagedexperts.__file__).parent}; torch {torch.__version__}, 1 thread, "
          f"{args.experts_implementation}, {args.tokens} tokens x {args.rounds} rounds, CPU time")
    print(table(measure(args), args.label))


if __name__ == "__main__":
    main()
