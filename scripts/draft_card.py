"""The model card of the distilled draft (``train_draft.py``): its README.md, generated.

Owns the card's text: the recipe (initialisation, loss, data, optimiser, steps), the held-out
agreement with the target, the acceptance in pagedexperts' speculative decoding, the files.
Does not: measure anything (``train_draft``). A helper module of the scripts, not part of the
library.
"""

from __future__ import annotations

from pathlib import Path

import torch

# this folder's modules (scripts/ is on sys.path when a script of it runs)
from tiny_moe_card import md_table, result_command


def pct(x: float) -> str:
    """A fraction as a percentage, one decimal."""
    return f"{100 * x:.1f}%"


def write_card(out: Path, args, draft, domains, result, evals: dict, spec: dict, files: dict) -> None:
    """``out``/README.md: the card of the trained ``draft`` (``result``: its ``TrainResult``;
    ``evals``: held-out agreement per draft; ``spec``: acceptance per draft in the speculative
    decoding run; ``files``: name -> bytes)."""
    cfg = draft.config
    n_params = sum(p.numel() for p in draft.parameters())
    ev_rows = [[name, split, r["tokens"], pct(r["agree"]), f"{r['kl']:.3f}", pct(r["min_pq"]),
                f"{r['draft_ce']:.3f}", f"{r['teacher_ce']:.3f}"]
               for name, rows in evals.items() for split, r in rows.items()]
    ev = md_table(["draft", "held-out split", "tokens", "top-1 agreement", "KL(p‖q) nats", "E[min(p,q)]",
                   "draft CE", "target CE"], ev_rows)
    sp = md_table(["draft", "proposed", "accepted", "acceptance", "accepted/step", "= plain greedy"],
                  [[n, s["proposed"], s["accepted"], pct(s["acceptance_rate"]), f"{s['mean_accepted_per_step']:.2f}",
                    "yes" if s["identical_to_plain_greedy"] else "NO"] for n, s in spec.items()])
    data = md_table(["file", "train docs", "train tokens", "held-out docs", "held-out tokens"],
                    [[f"`{Path(d.path).name}`", d.train_docs, len(d.train_ids), d.heldout_docs, len(d.heldout_ids)]
                     for d in domains])
    files_t = md_table(["file", "bytes"], [[f"`{n}`", s] for n, s in files.items()])
    text = f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3, draft-model, speculative-decoding, tiny, test-model]
---

# tiny-qwen3-draft

The draft model for `--speculative draft` with pagedexperts' bundled model
(`pagedexperts/data/tiny-qwen3-moe`, the target): a dense `Qwen3ForCausalLM` of
{cfg.num_hidden_layers} layers (hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_attention_heads} heads /
{cfg.num_key_value_heads} KV heads of {cfg.head_dim}; {n_params:,} parameters, float32, tied embeddings) with the
target's tokenizer files (vocabulary {cfg.vocab_size}, equal to the target's), distilled from the target's
next-token distributions. A test model like its target: it only has to predict the target.

```
pagedexperts generate --prompt "ROMEO:" --speculative draft --draft-model-path pagedexperts/data/tiny-qwen3-draft
```

## Recipe

```
{result_command(args)}
```

- Initialised from the target: token embeddings (= the tied LM head), final norm, and the
  attention and norms of its first {cfg.num_hidden_layers} layers; the dense MLPs are new (seed {args.seed}).
- Loss: forward KL(p_target || q_draft) at temperature 1, every position of every sequence
  (the target's full next-token distribution, computed in the same step, unpaged, eval mode).
- Data: the target's own training split ({100 * args.heldout_frac:g}% of each file held out, the same documents:
  the script calls `tiny_moe_corpus.read_documents` / `split_documents`); sequences of {args.seq_len} tokens
  interleaved across domains by a seeded shuffle every epoch.
- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr}, {args.warmup} warmup
  steps, cosine to lr/10, batch {args.batch_size} x {args.seq_len}, gradient clip 1.0, {args.threads} CPU thread(s),
  torch {torch.__version__}.
- Steps: {result.steps}; tokens: {result.tokens_seen:,}; wall-clock {result.wall_s / 60:.1f} min (planned from the
  --max-minutes budget on a shared machine; `--steps {result.steps}` reruns the same steps); final KL (EMA)
  {result.final_loss:.3f} nats/token.

{data}

## Agreement with the target on the held-out split

Teacher-forced over the held-out tokens (chunks of {args.seq_len}). Top-1 agreement is the chance a greedy
proposal is accepted given an accepted prefix; E[min(p,q)] = sum_v min(p(v), q(v)) is the
chance a proposal sampled at temperature 1 is accepted (Leviathan et al. 2023, Sec. 3.3).
`early-exit` is the baseline it replaces: the target's first 2 layers, untrained as a draft
(`save_truncated_draft`), measured in the same run.

{ev}

## Acceptance in pagedexperts' speculative decoding

Greedy, the paged target (K = E/4) through the server's scheduler, n = {args.num_speculative_tokens} proposals per
verification step, {args.spec_tokens} new tokens per prompt, batch {args.spec_batch}: {args.spec_prompts} prompts of
{args.spec_prompt_len} tokens from each held-out
stream (evenly spaced). Every output equal to plain greedy decoding is checked, not assumed.

{sp}

## Files

{files_t}

Plus this `README.md`. `train_stats.json` holds the numbers of this card and the training log.
"""
    (out / "README.md").write_text(text, encoding="utf-8")
