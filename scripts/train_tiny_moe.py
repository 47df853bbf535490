"""Train the tiny Qwen3-MoE model that pagedexperts ships as its default model.

What it owns: the whole recipe for `pagedexperts/data/tiny-qwen3-moe` -- corpus mixing and
held-out split, a byte-level BPE tokenizer, a from-scratch `Qwen3MoeForCausalLM` (64 routed
experts, top-4, every layer MoE), training with the router load-balancing loss, held-out
evaluation against a unigram baseline, routing statistics (load entropy, adjacent-token
overlap, LRU and Belady hit rates), and the Hugging Face directory with a generated model card.

Its pieces live beside it in scripts/: the corpus and tokenizer (`tiny_moe_corpus.py`), the
optimiser and step schedule (`train_schedule.py`, shared with `train_draft.py`), the routing
statistics (`tiny_moe_routing.py`: the LRU and Belady hit rates are the package's own
simulator's, `pagedexperts.analysis.simulate`) and the model card (`tiny_moe_card.py`).

What it deliberately does not do: it is not part of the library (nothing in the package imports
it). It never downloads anything; corpora are local text files.

Example (the command the bundled model was trained with is in its README.md):
    python scripts/train_tiny_moe.py \\
        --corpus /work/shared/data/corpus/tinyshakespeare.txt \\
                 /work/shared/data/corpus/gsm8k_train.jsonl \\
                 /work/shared/data/corpus/wikitext2_valid.txt \\
        --prompts-dir /work/shared/data/prompts --max-minutes 18

Dimension letters: B batch, T tokens, E routed experts, k top_k, K resident slots, L layers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_moe_card import result_command, write_card  # noqa: E402
from tiny_moe_corpus import Domain, load_domains, mixed_order  # noqa: E402
from tiny_moe_routing import QWEN3_30B, route_streams, routing_prompts, routing_stats  # noqa: E402
from train_schedule import WARM_STEPS, lr_at, make_optimizer, planned_steps  # noqa: E402


# ----------------------------------------------------------------------------- data records
@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    wall_s: float
    final_loss: float
    final_aux_loss: float
    log: list[dict]


# ----------------------------------------------------------------------------- model
def build_model(args, tokenizer):
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,  # dense MLP size; unused (no mlp_only_layers)
        moe_intermediate_size=args.moe_intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=args.experts, num_experts_per_tok=args.top_k, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=True,
        max_position_embeddings=512, output_router_logits=False,  # on per forward in training
        router_aux_loss_coef=args.aux_loss_coef, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=False, max_new_tokens=128)
    return model


def param_counts(model) -> dict[str, int]:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = experts // (cfg.num_hidden_layers * cfg.num_experts)
    active = total - experts + per_expert * cfg.num_experts_per_tok * cfg.num_hidden_layers
    return {"total": total, "routed_experts": experts, "per_expert": per_expert,
            "active_per_token": active}


# ----------------------------------------------------------------------------- training
def train(model, domains: list[Domain], args) -> TrainResult:
    torch.manual_seed(args.seed)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    model.train()
    started, step, epoch, log = time.time(), 0, 0, []
    total, loss_ema, aux, timed_from = None, None, float("nan"), (0, started)
    while True:
        batches = mixed_order(domains, args.seq_len, epoch, args.seed).split(args.batch_size)
        for x in batches:
            if len(x) < args.batch_size:
                continue
            if step == WARM_STEPS:
                timed_from = (step, time.time())
            replan = not args.steps and step >= args.calibrate and (
                step - args.calibrate) % args.replan_every == 0 and step < total
            if total is None or replan:
                total = planned_steps(args, step, started, timed_from)
                if replan:
                    print(f"planned: {total} steps fit in {args.max_minutes} min", flush=True)
            elapsed = time.time() - started
            if step >= total or (args.max_minutes and elapsed > args.max_minutes * 60):
                return TrainResult(step, step * args.batch_size * args.seq_len, elapsed,
                                   loss_ema, aux, log)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args.lr, args.warmup)
            out = model(input_ids=x, labels=x, output_router_logits=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ce = out.loss.item() - args.aux_loss_coef * out.aux_loss.item()
            loss_ema = ce if loss_ema is None else 0.95 * loss_ema + 0.05 * ce
            aux, step = out.aux_loss.item(), step + 1
            if step % args.log_every == 0 or step == 1:
                row = {"step": step, "epoch": epoch, "ce": round(ce, 4), "ce_ema": round(loss_ema, 4),
                       "aux": round(aux, 4), "lr": opt.param_groups[0]["lr"],
                       "elapsed_s": round(time.time() - started, 1)}
                log.append(row)
                print(json.dumps(row), flush=True)
        epoch += 1


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_nll(model, ids: list[int], seq_len: int) -> tuple[float, int, list[int]]:
    """Summed next-token NLL (nats) over chunks of a stream; also returns the scored targets."""
    model.eval()
    pieces = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    pieces = [p for p in pieces if len(p) >= 2]
    nll, targets = 0.0, []
    for p in pieces:
        x = torch.tensor([p])
        logits = model(input_ids=x, output_router_logits=False).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        targets.extend(p[1:])
    return nll, len(targets), targets


def unigram_nll(train_counts: Counter, n_train: int, vocab: int, targets: list[int]) -> float:
    """Summed NLL (nats) of add-one smoothed unigram frequencies from the training split."""
    return -sum(math.log((train_counts[t] + 1) / (n_train + vocab)) for t in targets)


def evaluate(model, domains: list[Domain], seq_len: int, vocab: int) -> dict:
    counts = Counter(t for d in domains for t in d.train_ids)
    n_train = sum(counts.values())
    rows, tot = {}, {"model": 0.0, "unigram": 0.0, "tokens": 0}
    for d in domains:
        nll, n, targets = heldout_nll(model, d.heldout_ids, seq_len)
        uni = unigram_nll(counts, n_train, vocab, targets)
        rows[d.name] = {"tokens": n, "model_nats": nll / n, "unigram_nats": uni / n}
        tot["model"] += nll
        tot["unigram"] += uni
        tot["tokens"] += n
    rows["all"] = {"tokens": tot["tokens"], "model_nats": tot["model"] / tot["tokens"],
                   "unigram_nats": tot["unigram"] / tot["tokens"]}
    return rows


# ----------------------------------------------------------------------------- save and check
def verify_reload(out: Path, model, tokenizer, samples: list[str], max_new_tokens: int) -> dict:
    """Reload with Auto* classes, check logits match the trained model, greedy-generate samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    re_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok("ROMEO:\nWhat light is this?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a = model.eval()(input_ids=ids, output_router_logits=False).logits
        b = re_model(input_ids=ids, output_router_logits=False).logits
    diff = (a - b).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"reloaded model differs from the trained one: max |diff| {diff:.3g}")
    gens = {}
    for prompt in samples:
        x = tok(prompt, return_tensors="pt")
        y = re_model.generate(**x, max_new_tokens=max_new_tokens, do_sample=False)
        gens[prompt] = tok.decode(y[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"--- {prompt!r}\n{gens[prompt]}", flush=True)
    return {"reload_max_abs_logit_diff": diff, "generations": gens}


def dir_files(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--corpus", nargs="+", required=True, help="text / .txt / .jsonl corpus files")
    g.add_argument("--prompts-dir", default="/work/shared/data/prompts",
                   help="held-out prompts for routing stats (gsm8k_test.jsonl, "
                        "mt_bench_questions.jsonl, wikitext2_test.txt)")
    g.add_argument("--heldout-frac", type=float, default=0.02, help="tail of each file held out")
    g.add_argument("--vocab-size", type=int, default=4096)
    g = p.add_argument_group("model")
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--moe-intermediate-size", type=int, default=64)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--experts", type=int, default=64)
    g.add_argument("--top-k", type=int, default=4)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=0, help="0: as many as fit in --max-minutes")
    g.add_argument("--max-minutes", type=float, default=18.0, help="wall-clock budget; 0: none")
    g.add_argument("--calibrate", type=int, default=30, help="steps timed to plan the schedule")
    g.add_argument("--replan-every", type=int, default=50,
                   help="re-plan the step count from the mean step time (shared CPUs vary)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup", type=int, default=40)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--aux-loss-coef", type=float, default=0.01)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--log-every", type=int, default=20)
    g = p.add_argument_group("output")
    g.add_argument("--out", default="pagedexperts/data/tiny-qwen3-moe")
    g.add_argument("--prompts-per-source", type=int, default=10)
    g.add_argument("--sample-tokens", type=int, default=80, help="greedy tokens per card sample")
    args = p.parse_args(argv)
    if not args.steps and not args.max_minutes:
        p.error("give --steps or --max-minutes")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, domains = load_domains(args.corpus, args.heldout_frac, args.vocab_size)
    for d in domains:
        print(f"{d.name}: train {len(d.train_ids)} tokens, held-out {len(d.heldout_ids)}", flush=True)
    model = build_model(args, tokenizer)
    print(json.dumps(param_counts(model)), flush=True)
    result = train(model, domains, args)
    print(f"trained {result.steps} steps, {result.tokens_seen} tokens, {result.wall_s:.0f} s", flush=True)
    model.eval()
    evals = evaluate(model, domains, args.seq_len, len(tokenizer))
    print(json.dumps(evals, indent=1), flush=True)
    prompts = routing_prompts(args.prompts_dir, tokenizer, args.prompts_per_source)
    streams = route_streams(model, tokenizer, prompts, max_tokens=256)
    stats = routing_stats(streams, model.config.num_hidden_layers, model.config.num_experts_per_tok,
                          model.config.num_experts)
    n_prompt_tokens = sum(len(s[0]) for s in streams)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    samples = ["ROMEO:", "Question: A farmer has 12 cows and buys 5 more. How many cows does he have?\nAnswer:",
               " = The Battle of Hastings = \n"]
    check = verify_reload(out, model, tokenizer, samples, args.sample_tokens)
    stats_json = {"command": result_command(args), "train": asdict(result) | {"log": result.log},
                  "params": param_counts(model), "heldout": evals, "prompts": len(prompts),
                  "prompt_tokens": n_prompt_tokens, "num_experts": model.config.num_experts,
                  "top_k": model.config.num_experts_per_tok,
                  "layers": [asdict(s) for s in stats], "qwen3_30b_a3b_published": QWEN3_30B, **check}
    (out / "routing_stats.json").write_text(json.dumps(stats_json, indent=1) + "\n")
    write_card(out, args, model, param_counts(model), domains, result, evals, stats, n_prompt_tokens,
               len(prompts), check, dir_files(out))
    print(f"wrote {out}: {json.dumps(dir_files(out))}", flush=True)


if __name__ == "__main__":
    main()
