"""EleutherAI's lm-evaluation-harness against ``pagedexperts serve``, on local data only.

Starts ``pagedexperts serve`` (the bundled model unless ``--model-path``) on a free loopback
port, writes two local lm-eval tasks into a temporary folder, and runs the ``lm_eval`` CLI
of a SEPARATE virtual environment (``--lm-eval``, default /work/lmeval-venv/bin/lm_eval;
install with ``python -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install
'lm_eval[api]' transformers``), so the project's own environment is untouched:

- ``gsm8k_local`` (generate_until): GSM8K test questions from ``--data``
  (``../shared/data/prompts/gsm8k_test.jsonl``), 5 stop strings, exact match on the number
  after ``####``;
- ``gsm8k_mc_local`` (multiple_choice = loglikelihood): the same questions with the true
  answer and three wrong numbers; lm-eval scores each choice with echo + logprobs.

Runs: ``local-completions`` (token-id prompts, lm-eval's default ``tokenized_requests``) on
both tasks, and ``local-chat-completions`` (``--apply_chat_template``) on both: lm-eval's chat
client implements generation only and refuses loglikelihood itself, which is printed as such.
The tiny model answers maths badly: the point is that every request type runs end to end.
Usage::

    python bench/lm_eval_local.py --limit 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

GEN_TASK = """task: gsm8k_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>", "\\n\\n", "\\n\\n\\n"]
  max_gen_toks: 32
  do_sample: false
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9.,]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

MC_TASK = """task: gsm8k_mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path, data: Path, limit: int) -> None:
    """The two task YAMLs, and the multiple-choice JSON lines built from ``data``."""
    rows = [json.loads(line) for line in data.read_text().splitlines()[:limit]]
    rng = random.Random(0)
    with (folder / "gsm8k_mc.jsonl").open("w") as f:
        for row in rows:
            answer = int(re.sub(r"[^0-9-]", "", row["answer"].split("####")[-1]) or 0)
            choices = sorted({answer, answer + 1, answer * 2 + 3, max(0, answer - 7)} - {None})
            while len(choices) < 4:
                choices.append(choices[-1] + 11)
            rng.shuffle(choices)
            f.write(json.dumps({"question": row["question"], "choices": [f" {c}" for c in choices],
                                "label": choices.index(answer)}) + "\n")
    (folder / "gsm8k_local.yaml").write_text(GEN_TASK.format(data=data))
    (folder / "gsm8k_mc_local.yaml").write_text(MC_TASK.format(data=folder / "gsm8k_mc.jsonl"))


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedexperts.cli", "serve", "--port", str(port), "--served-model-name", "tiny",
           "--max-running-requests", "8"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 120 s")


def run_lm_eval(args, url: str, tokenizer: str, folder: Path, *, chat: bool, tasks: str) -> int:
    endpoint = "chat/completions" if chat else "completions"
    model_args = (f"model=tiny,base_url={url}/v1/{endpoint},tokenizer={tokenizer},tokenizer_backend=huggingface,"
                  f"max_length=512,num_concurrent=4,max_retries=1")
    cmd = [args.lm_eval, "--model", "local-chat-completions" if chat else "local-completions",
           "--model_args", model_args, "--tasks", tasks, "--include_path", str(folder), "--limit", str(args.limit)]
    if chat:
        cmd.append("--apply_chat_template")
    print(f"\n$ {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env={**os.environ, "OPENAI_API_KEY": "unused"}).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", default="/work/lmeval-venv/bin/lm_eval", help="the lm_eval CLI of its own venv")
    p.add_argument("--data", default="../shared/data/prompts/gsm8k_test.jsonl", help="GSM8K JSON lines")
    p.add_argument("--model-path", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--limit", type=int, default=20, help="documents per task")
    args = p.parse_args(argv)
    if not Path(args.lm_eval).exists():
        raise SystemExit(f"no lm_eval at {args.lm_eval}; install it in its own venv (see --help)")
    from pagedexperts import bundled_model_path

    tokenizer = str(Path(args.model_path or bundled_model_path()).resolve())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = start_server(args, port)
    codes = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_tasks(folder, Path(args.data).resolve(), args.limit)
            url = f"http://127.0.0.1:{port}"
            codes["completions"] = run_lm_eval(args, url, tokenizer, folder, chat=False,
                                               tasks="gsm8k_local,gsm8k_mc_local")
            codes["chat generate"] = run_lm_eval(args, url, tokenizer, folder, chat=True, tasks="gsm8k_local")
            codes["chat loglikelihood"] = run_lm_eval(args, url, tokenizer, folder, chat=True, tasks="gsm8k_mc_local")
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"\nlm_eval exit codes: {codes} (chat loglikelihood: lm-eval's chat client has no loglikelihood)")
    return 0 if codes["completions"] == 0 and codes["chat generate"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
