"""The model card of the bundled tiny model (``train_tiny_moe.py``): its README.md, generated.

Owns: the card's text (architecture, data, training recipe and budget, held-out evaluation,
routing statistics beside Qwen3-30B-A3B's, greedy samples, files) and the markdown helpers the
draft's card reuses (``md_table``, ``result_command``: ``draft_card.py``). Does not: measure
anything (``train_tiny_moe``, ``tiny_moe_routing``). A helper module of the scripts, not part
of the library.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import torch

# this folder's modules (scripts/ is on sys.path when a script of it runs)
from tiny_moe_corpus import EOS
from tiny_moe_routing import QWEN3_30B, RESIDENT_SLOTS, LayerRouting
from train_schedule import WARM_STEPS


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table: ``header``, then one line per row (cells through ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def routing_section(stats: list[LayerRouting], cfg, n_prompts: int, n_tokens: int) -> str:
    """The card's routing statistics: per-layer table, and the comparison with Qwen3-30B-A3B."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    uniform, max_h = k / E, math.log2(E)
    def pct(x):
        return f"{100 * x:.1f}"

    rows = [[s.layer, f"{s.load_entropy_bits:.3f}", f"{s.load_entropy_bits / max_h:.3f}",
             pct(s.overlap_mean), f"{s.overlap_mean / uniform:.2f}x"]
            + [f"{pct(s.lru_hit[K])} / {pct(s.belady_hit[K])}" for K in RESIDENT_SLOTS] for s in stats]
    def mean(f):
        return sum(f(s) for s in stats) / len(stats)

    rows.append(["mean", f"{mean(lambda s: s.load_entropy_bits):.3f}",
                 f"{mean(lambda s: s.load_entropy_bits) / max_h:.3f}",
                 pct(mean(lambda s: s.overlap_mean)), f"{mean(lambda s: s.overlap_mean) / uniform:.2f}x"]
                + [f"{pct(mean(lambda s: s.lru_hit[K]))} / {pct(mean(lambda s: s.belady_hit[K]))}"
                   for K in RESIDENT_SLOTS])
    header = ["layer", "load entropy (bits)", f"/ log2 E = {max_h:.0f}", "adjacent overlap %",
              f"vs uniform {pct(uniform)}%"] + [f"LRU / Belady % K={K}" for K in RESIDENT_SLOTS]
    q = QWEN3_30B
    cmp_rows = []
    for ours_K, qwen_K in zip(RESIDENT_SLOTS, (8, 16, 32, 64)):
        cmp_rows.append([f"K={ours_K} of {E} (K/E={ours_K / E:.3g}, K/k={ours_K // k})",
                         f"{pct(mean(lambda s: s.lru_hit[ours_K]))} / {pct(mean(lambda s: s.belady_hit[ours_K]))}",
                         f"K={qwen_K} of 128", f"{pct(q['lru'][qwen_K])} / {pct(q['belady'][qwen_K])}"])
    return f"""## Routing statistics

Measured on {n_prompts} held-out prompts ({n_tokens} tokens: GSM8K test questions as
"Question: ...\\nAnswer:", MT-Bench first turns through the chat template, WikiText-2 test
paragraphs truncated to 256 tokens), teacher-forced, one token per step, each prompt its own
stream. Hit rates count one hit or miss per distinct expert per layer per step and start from
an empty cache in every prompt (cold misses included, which lowers the rates of short streams,
most at large K). Overlap is |S_t ∩ S_t+1| / k over adjacent tokens; uniform random routing
gives k/E = {pct(uniform)}%.

{md_table(header, rows)}

### Against the published Qwen3-30B-A3B figures

Qwen3-30B-A3B has E = 128, k = 8; this model keeps the same E/k = 16, so K values are compared
at equal K/E (and equal K/k): our K = 4/8/16/32 of 64 against its K = 8/16/32/64 of 128.

{md_table(["this model", "LRU / Belady %", "Qwen3-30B-A3B", "LRU / Belady %"], cmp_rows)}

Mean adjacent-token overlap: this model {pct(mean(lambda s: s.overlap_mean))}% (uniform
{pct(uniform)}%, {mean(lambda s: s.overlap_mean) / uniform:.2f}x); Qwen3-30B-A3B {pct(q['overlap'])}%
(uniform 6.25%, {q['overlap'] / 0.0625:.2f}x). The tiny model is a stand-in with the same
routing shape (softmax top-k, normalised top-k weights, E/k = 16), trained for minutes on a few
MB of text; its locality is its own and not a prediction of a large model's. Use it to exercise
paging code and the simulator end to end, and the real checkpoints for numbers that matter.
"""


def write_card(out: Path, args, model, pc: dict[str, int], domains, result, evals, stats, n_prompt_tokens,
               n_prompts, check, files) -> None:
    """``out``/README.md: the model card of the trained ``model`` (``pc``: its parameter counts,
    ``train_tiny_moe.param_counts``; ``result``: its ``TrainResult``; ``stats``: its
    ``LayerRouting`` rows; ``check``: the reload check and greedy samples; ``files``: name ->
    bytes)."""
    cfg = model.config
    bytes_per = next(model.parameters()).element_size()
    expert_bytes = pc["per_expert"] * bytes_per
    arch_keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                 "tie_word_embeddings", "max_position_embeddings", "rope_parameters", "rms_norm_eps",
                 "hidden_act", "router_aux_loss_coef", "output_router_logits"]
    arch = md_table(["config", "value"], [[k, f"`{getattr(cfg, k, None)}`"] for k in arch_keys])
    data = md_table(["file", "train docs", "train tokens", "held-out docs", "held-out tokens"],
                    [[f"`{Path(d.path).name}`", d.train_docs, len(d.train_ids), d.heldout_docs,
                      len(d.heldout_ids)] for d in domains])
    ev = md_table(["held-out split", "scored tokens", "model (nats/token)", "unigram (nats/token)"],
                  [[n, r["tokens"], f"{r['model_nats']:.3f}", f"{r['unigram_nats']:.3f}"]
                   for n, r in evals.items()])
    gens = "\n\n".join(f"Prompt `{p!r}`:\n\n```\n{p}{g}\n```" for p, g in check["generations"].items())
    files_t = md_table(["file", "bytes"], [[f"`{n}`", s] for n, s in files.items()])
    text = f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3_moe, mixture-of-experts, tiny, test-model]
---

# tiny-qwen3-moe

A tiny `Qwen3MoeForCausalLM` trained from scratch on CPU as the default model of
`pagedexperts`: small enough to ship in the repository and run in tests on any machine, shaped
like Qwen3-30B-A3B where paging cares (64 routed experts, top-4: E/k = 16; every layer MoE;
softmax top-k router with normalised top-k weights). It writes plausible-looking Shakespeare,
GSM8K-style and WikiText-style text and nothing more: it is a test model, not a useful one.

## Architecture

{arch}

- Parameters: {pc['total']:,} total; {pc['routed_experts']:,} in routed experts
  ({pc['per_expert']:,} per expert); about {pc['active_per_token']:,} active per token.
- Stored as {str(next(model.parameters()).dtype).replace('torch.', '')} (`model.safetensors`,
  {files.get('model.safetensors', 0):,} bytes; experts one tensor per expert, as transformers 5
  `save_pretrained` writes them).
- Expert bytes (gate, up, down of one expert in one layer): {expert_bytes:,};
  slot bytes (x {cfg.num_hidden_layers} layers): {expert_bytes * cfg.num_hidden_layers:,};
  all routed experts: {pc['routed_experts'] * bytes_per:,} bytes.

## Data

Three local corpora, split by documents ("Question: ...\\nAnswer: ..." per GSM8K row, articles
for WikiText-2, 40-line blocks for Tiny Shakespeare); the last {100 * args.heldout_frac:g}% of each
file's characters is held out. Every document ends with `{EOS}`. Training sequences of
{args.seq_len} tokens are cut from each domain's stream and interleaved across domains by a
seeded shuffle every epoch. Tokenizer: byte-level BPE (vocab {len_vocab(cfg)}), trained on the
training split only; `{EOS}` is eos and pad; chat template "User: ...\\nAssistant:".

{data}

## Training

```
{result_command(args)}
```

- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr},
  {args.warmup} warmup steps, cosine to lr/10; batch {args.batch_size} x {args.seq_len} tokens;
  gradient clip 1.0; router load-balancing loss on (coef {args.aux_loss_coef}); seed {args.seed};
  default experts implementation (`grouped_mm`); {torch.get_num_threads()} CPU threads;
  torch {torch.__version__}, transformers {transformers_version()}.
- Steps: {result.steps}; tokens seen: {result.tokens_seen:,}; wall-clock: {result.wall_s / 60:.1f} min.
  {budget_note(args, result)}
- Final training cross-entropy (EMA): {result.final_loss:.3f} nats/token; final aux loss
  {result.final_aux_loss:.3f} (transformers sums it over layers; top_k = {cfg.num_experts_per_tok} when perfectly balanced).

## Held-out evaluation

Cross-entropy of the next token, nats/token, on the held-out tokens (chunks of {args.seq_len}),
against an add-one smoothed unigram model of the training split on the same tokens.

{ev}

{routing_section(stats, cfg, n_prompts, n_prompt_tokens)}

## Greedy samples (reloaded with `AutoModelForCausalLM.from_pretrained`)

Reloaded logits match the trained model (max |diff| {check['reload_max_abs_logit_diff']:.2g}).

{gens}

## Files

{files_t}

Plus this `README.md`. `routing_stats.json` holds the numbers of this card (and the training log).
The config saves `output_router_logits: false` (as Qwen3 checkpoints do); training passed
`output_router_logits=True` to every forward so the load-balancing loss was on.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def budget_note(args, result) -> str:
    """How the step count of ``result`` (a ``TrainResult``) was chosen, and how to rerun it."""
    if args.steps:
        return "Step count fixed by --steps: deterministic given the seed (same data order)."
    return (f"The step count was planned from the --max-minutes budget (mean step time from step "
            f"{WARM_STEPS}, re-planned every {args.replan_every} steps; the CPUs were shared); "
            f"`--steps {result.steps}` reruns the same number of steps deterministically "
            "(same seed and data order).")


def len_vocab(cfg) -> int:
    return cfg.vocab_size


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def result_command(args) -> str:
    """The command line this process was started with, shell-quoted (the card's recipe)."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)
