"""CPU time per decode token of each mode against plain transformers, two source trees in one run.

Measures a change (``--before`` tree vs ``--after`` tree, e.g. ``git archive main`` unpacked
next to this checkout) on the same machine at the same time: the two trees' child processes
alternate, round by round, in rotating order; each child loads the model once (paged via
``loader.load_model`` + ``repage``, plain via transformers' ``from_pretrained``), warms every
mode up, then runs its modes interleaved and reports each mode's CPU time
(``time.process_time``) per decode token over plain's in the same child. The parent prints
the median and [min-max] of those ratios over all rounds, per tree and mode.

Only ``load_model(mode=..., num_resident=...)`` and ``repage`` are used, so trees from before
``bench``'s plain mode work too. Modes: ``plain``, ``resident``, ``paged:K``.

    python bench/before_after.py --before /tmp/main-src --after . --rounds 6 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(modes: list[str], rounds: int, tokens: int, threads: int) -> dict:
    """{mode: [CPU seconds per decode token, one per inner round]} in this process's tree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # trees before the loading package
        from pagedexperts import loader
    except ImportError:
        from types import SimpleNamespace

        from pagedexperts.loading.bundled import bundled_model_path
        from pagedexperts.loading.loader import load_model
        from pagedexperts.loading.runners import repage
        loader = SimpleNamespace(bundled_model_path=bundled_model_path, load_model=load_model, repage=repage)

    torch.set_num_threads(threads)
    path = loader.bundled_model_path()
    plain = AutoModelForCausalLM.from_pretrained(path, experts_implementation="grouped_mm").eval()
    paged, _ = loader.load_model(mode="resident")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(["ROMEO: what light through yonder window breaks?"], return_tensors="pt")

    def decode_cpu_s(model) -> float:
        cpu = []

        class Clock:
            def put(self, value):
                cpu.append(time.process_time())

            def end(self):
                pass

        with torch.no_grad():
            model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=tok.eos_token_id, streamer=Clock())
        return (cpu[-1] - cpu[1]) / (len(cpu) - 2)  # put 0: the prompt; put 1: the first new token

    def switch(mode: str):
        if mode == "plain":
            return plain
        name, _, k = mode.partition(":")
        loader.repage(paged, mode=name, num_resident=int(k) if k else None)
        return paged

    out = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            model = switch(mode)
            decode_cpu_s(model)  # warm-up after the switch, untimed
            out[mode].append(decode_cpu_s(model))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="source tree of the code before the change")
    p.add_argument("--after", required=True, help="source tree of the code after the change")
    p.add_argument("--modes", default="plain,resident,paged:16,paged:64")
    p.add_argument("--rounds", type=int, default=6, help="outer rounds; each runs both trees once")
    p.add_argument("--inner-rounds", type=int, default=2, help="rounds of every mode inside one child")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.child:
        print(json.dumps(child(modes, args.inner_rounds, args.tokens, args.threads)))
        return 0
    if "plain" not in modes:
        raise ValueError("--modes must include plain: every ratio is against it")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    ratios = {t: {m: [] for m in modes} for t in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            env = dict(os.environ, PYTHONPATH=trees[name])
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--before", "-", "--after", "-",
                   "--modes", args.modes, "--inner-rounds", str(args.inner_rounds), "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            res = json.loads(subprocess.run(cmd, env=env, cwd=trees[name], check=True, capture_output=True,
                                            text=True).stdout.splitlines()[-1])
            for m in modes:
                ratios[name][m] += [a / b for a, b in zip(res[m], res["plain"])]
            print(f"round {r} {name}: " + ", ".join(f"{m} {1e3 * statistics.median(res[m]):.2f} ms" for m in modes),
                  flush=True)
    print("\nCPU time per decode token vs plain, median [min-max] over rounds (each vs the same child's plain)")
    for name in trees:
        cells = [f"{m} {statistics.median(v):.3f}x [{min(v):.3f}-{max(v):.3f}]" for m, v in ratios[name].items()]
        print(f"{name:6s}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
