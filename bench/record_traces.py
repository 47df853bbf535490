"""Record held-out routing traces of a model on the shared prompt sets, split into tune/report.

For each prompt set (gsm8k_test, mt_bench, wikitext2_test) the first N prompts are taken; even
positions go to the "tune" trace and odd positions to the "report" trace. Each prompt is one
request (its own request id), generated greedily one after another through one paged model, so
residency carries over between requests as in a server. With ``--prefetch`` the runtime records
its next-layer predictions as a per-layer trace extra (``prefetch``), which the simulator replays.

Usage: python bench/record_traces.py --model-path DIR --out DIR [--prompts 16] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pagedexperts.loading.loader import load_model
from pagedexperts.analysis.recording import record_predictions
from pagedexperts.analysis.recording import TraceRecorder
from pagedexperts.analysis.trace import TraceWriter

SETS = ("gsm8k", "mtbench", "wikitext")


def read_prompts(data_dir: str, name: str, n: int) -> list[str]:
    """The first ``n`` prompts of a shared prompt set (wikitext: paragraphs of >= 400 chars)."""
    p = os.path.join(data_dir, "prompts")
    if name == "gsm8k":
        with open(os.path.join(p, "gsm8k_test.jsonl")) as f:
            return [json.loads(line)["question"] for line in f][:n]
    if name == "mtbench":
        with open(os.path.join(p, "mt_bench_questions.jsonl")) as f:
            return [json.loads(line)["turns"][0] for line in f][:n]
    with open(os.path.join(p, "wikitext2_test.txt")) as f:
        paras = [ln.strip() for ln in f if len(ln.strip()) >= 400 and not ln.strip().startswith("=")]
    return [x[:1200] for x in paras[:n]]


def record(model, tokenizer, rec: TraceRecorder, prompts: list[str], *, path: str, new_tokens: int,
           max_prompt: int) -> dict:
    """Generate greedily from each prompt in turn and save the routing trace at ``path``
    (``rec``'s writer is replaced by a fresh one first: one recorder, one trace per call)."""
    rt = model.pagedexperts
    rec.writer = TraceWriter(num_experts=rt.num_experts, top_k=rt.top_k, layers=sorted(rt.runners),
                             model_id=os.path.basename(str(model.config._name_or_path)))
    t0, n_tok = time.perf_counter(), 0
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_prompt]
        rec.request_ids = [i]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        n_tok += out.shape[1]
    rec.save(path)
    return dict(path=path, prompts=len(prompts), tokens=n_tok, wall_s=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set (half tune, half report)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--prefetch", action="store_true", help="record next-layer predictions (trace extra)")
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated prompt sets")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    kw = dict(num_resident=None)
    if args.prefetch:
        kw["prefetch"] = True
    model, tok = load_model(args.model_path, **kw)
    rec = TraceRecorder.attach(model)
    if args.prefetch:
        record_predictions(model, rec)
    for name in args.sets.split(","):
        prompts = read_prompts(args.data_dir, name, args.prompts)
        for half, sub in (("tune", prompts[0::2]), ("report", prompts[1::2])):
            info = record(model, tok, rec, sub, path=os.path.join(args.out, f"{name}_{half}.npz"),
                          new_tokens=args.new_tokens, max_prompt=args.max_prompt_tokens)
            print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
