"""Decode tok/s and TTFT of ``pagedexperts generate`` at several ``--threads`` values, interleaved.

Each round runs one ``generate`` child process per setting, in an order rotated by the round
(so no setting always runs first after a pause), and reads its ``--stats-json``: decode tok/s
(small decode steps: batch 1) and TTFT of a long prompt (one large prefill step). The machine's
1-minute load average and the setting the child actually ran with are recorded with each run,
since the answer depends on how busy the cores are. Prints medians with [min-max] per setting
and the ratio of each setting's decode tok/s to the first setting's, per round.

    python bench/threads_bench.py --threads 0,1,2 --rounds 5
    python bench/threads_bench.py --threads auto,1,2 --rounds 5 --prompt-words 400

``--threads`` values are passed through: ``0`` is torch's own default (one thread per core),
``auto`` the command's default; a value ending in ``p`` (``2p``) runs with
``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of spinning).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PASSIVE = "p"  # a setting ending in p runs with OMP_WAIT_POLICY=PASSIVE
WORDS = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
         "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief. ").split()


def run_once(threads: str, *, tokens: int, prompt_words: int, resident: int, workdir: str) -> dict:
    """One ``generate`` child: its decode tok/s, TTFT (s), the thread count it ran with and the
    load average before it started."""
    stats = os.path.join(workdir, f"stats-{threads}.json")
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_words))
    argv = [sys.executable, "-m", "pagedexperts.cli", "generate", "--prompt", prompt, "--max-new-tokens", str(tokens),
            "--num-resident", str(resident), "--seed", "0", "--stats-json", stats, "--quiet"]
    env = dict(os.environ)
    if threads.endswith(PASSIVE):  # OpenMP's idle threads sleep instead of spinning
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    value = threads.removesuffix(PASSIVE)
    if value != "auto":
        argv += ["--threads", value]
    load = os.getloadavg()[0]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(f"--threads {threads}: {done.stderr[-2000:]}")
    with open(stats) as f:
        s = json.load(f)
    return dict(decode_tok_s=s["decode_tok_s"], ttft_s=s["ttft_s"], threads_used=s.get("threads"), load=load)


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="0,1,2", help="comma-separated --threads values (0: torch's default; auto)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-words", type=int, default=3, help="prompt length in words (3: the main job's short prompt)")
    p.add_argument("--num-resident", type=int, default=16)
    p.add_argument("--json", help="write every run here")
    a = p.parse_args()
    settings = [t.strip() for t in a.threads.split(",") if t.strip()]
    runs: dict[str, list[dict]] = {t: [] for t in settings}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(a.rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            for t in order:
                runs[t].append(run_once(t, tokens=a.max_new_tokens, prompt_words=a.prompt_words,
                                        resident=a.num_resident, workdir=workdir))
                print(f"round {r} --threads {t}: {runs[t][-1]}", file=sys.stderr, flush=True)
    base = settings[0]
    print(f"{os.cpu_count()} CPUs; {a.rounds} rounds, settings rotated per round; median [min-max]\n")
    print("| --threads | ran with | load avg | decode tok/s | TTFT ms | decode tok/s vs " + base + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in settings:
        rs = runs[t]
        ratio = [x["decode_tok_s"] / b["decode_tok_s"] for x, b in zip(rs, runs[base])]
        used = sorted({str(x["threads_used"]) for x in rs})
        print(f"| {t} | {','.join(used)} | {spread([x['load'] for x in rs])} | {spread([x['decode_tok_s'] for x in rs])} "
              f"| {spread([1e3 * x['ttft_s'] for x in rs], '.0f')} | {spread(ratio, '.2f')}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
