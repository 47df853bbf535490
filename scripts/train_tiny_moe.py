"""Train the tiny Qwen3-MoE model that pagedexperts ships as its default model.

What it owns: the whole recipe for `pagedexperts/data/tiny-qwen3-moe` -- corpus mixing and
held-out split, a byte-level BPE tokenizer, a from-scratch `Qwen3MoeForCausalLM` (64 routed
experts, top-4, every layer MoE), training with the router load-balancing loss, held-out
evaluation against a unigram baseline, routing statistics (load entropy, adjacent-token
overlap, LRU and Belady hit rates), and the Hugging Face directory with a generated model card.

What it deliberately does not do: it is not part of the library (nothing imports it), and its
small LRU / Belady loops are a self-contained stand-in until the project's trace simulator
replaces them. It never downloads anything; corpora are local text files.

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
import bisect
import json
import math
import re
import shlex
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}System: {{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
WARM_STEPS = 5  # first steps excluded from the --max-minutes step-time calibration
RESIDENT_SLOTS = (4, 8, 16, 32)  # K values for the LRU / Belady tables
# Published Qwen3-30B-A3B figures (E=128, k=8), keyed by resident slots K.
QWEN3_30B = {
    "experts": 128, "top_k": 8, "overlap": 0.389,
    "lru": {8: 0.424, 16: 0.647, 32: 0.810, 64: 0.918},
    "belady": {8: 0.608, 16: 0.784, 32: 0.888, 64: 0.929},
}


# ----------------------------------------------------------------------------- data records
@dataclass
class Domain:
    """One corpus file: its documents split into train and held-out token streams."""
    name: str
    path: str
    train_docs: int
    heldout_docs: int
    train_ids: list[int] = field(default_factory=list, repr=False)
    heldout_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    wall_s: float
    final_loss: float
    final_aux_loss: float
    log: list[dict]


@dataclass
class LayerRouting:
    """Routing statistics of one MoE layer over all held-out prompt streams."""
    layer: int
    load_entropy_bits: float
    overlap_mean: float
    lru_hit: dict[int, float]
    belady_hit: dict[int, float]


# ----------------------------------------------------------------------------- corpus
def read_documents(path: str) -> list[str]:
    """Split one corpus file into documents, in file order.

    .jsonl with question/answer -> one "Question: ...\\nAnswer: ..." document per line;
    wikitext (" = Title = " headings) -> one document per article; anything else -> blocks of
    about 40 lines (keeps plays and prose contiguous inside a block).
    """
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    lines = text.splitlines(keepends=True)
    if any(re.match(r"^ = [^=].* = \s*$", line) for line in lines[:50]):
        docs, cur = [], []
        for line in lines:
            if re.match(r"^ = [^=].* = \s*$", line) and cur:
                docs.append("".join(cur).strip() + "\n")
                cur = []
            cur.append(line)
        docs.append("".join(cur).strip() + "\n")
        return [d for d in docs if d.strip()]
    return ["".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]


def split_documents(docs: list[str], heldout_frac: float) -> tuple[list[str], list[str]]:
    """Hold out the last `heldout_frac` of a file's characters (whole documents, at least one)."""
    total = sum(len(d) for d in docs)
    cut, tail = len(docs), 0
    while cut > 1 and (tail < heldout_frac * total or cut == len(docs)):
        cut -= 1
        tail += len(docs[cut])
    return docs[:cut], docs[cut:]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over the training split only; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tokenizer, docs: list[str]) -> list[int]:
    """Concatenate documents into one token stream, each followed by eos."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return ids


def load_domains(paths: list[str], heldout_frac: float, vocab_size: int):
    docs = {p: split_documents(read_documents(p), heldout_frac) for p in paths}
    tokenizer = train_tokenizer([d for tr, _ in docs.values() for d in tr], vocab_size)
    domains = []
    for p, (train, held) in docs.items():
        d = Domain(Path(p).stem, p, len(train), len(held))
        d.train_ids, d.heldout_ids = encode_stream(tokenizer, train), encode_stream(tokenizer, held)
        domains.append(d)
    return tokenizer, domains


def chunk(ids: list[int], seq_len: int) -> torch.Tensor:
    """[N, T] non-overlapping full chunks of a stream (a final partial chunk is dropped)."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def mixed_order(domains: list[Domain], seq_len: int, epoch: int, seed: int) -> torch.Tensor:
    """[N, T] chunks of every domain, interleaved by a seeded shuffle (deterministic per epoch)."""
    chunks = torch.cat([chunk(d.train_ids, seq_len) for d in domains])
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return chunks[torch.randperm(len(chunks), generator=g)]


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


def make_optimizer(model, lr: float, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to peak / 10 at `total` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def planned_steps(args, step: int, started: float, timed_from: tuple[int, float]) -> int:
    """--steps if given; else, at step `args.calibrate`, the steps that fit --max-minutes, timed
    from step `timed_from[0]` (after the slow first steps) at wall time `timed_from[1]`."""
    if args.steps:
        return args.steps
    if step < args.calibrate:
        return 10**9
    per_step = (time.time() - timed_from[1]) / (step - timed_from[0])
    left_s = args.max_minutes * 60 * 0.98 - (time.time() - started)
    return max(step + 1, step + int(left_s / per_step))


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


# ----------------------------------------------------------------------------- routing stats
def routing_prompts(prompts_dir: str, tokenizer, per_source: int) -> list[tuple[str, str]]:
    """(source, text) held-out prompts: GSM8K test questions, MT-Bench first turns, WikiText-2 test lines."""
    d = Path(prompts_dir)
    out = []
    gsm = [json.loads(x) for x in (d / "gsm8k_test.jsonl").read_text().splitlines() if x.strip()]
    out += [("gsm8k_test", f"Question: {r['question']}\nAnswer:") for r in gsm[:per_source]]
    mt = [json.loads(x) for x in (d / "mt_bench_questions.jsonl").read_text().splitlines() if x.strip()]
    out += [("mt_bench", tokenizer.apply_chat_template(
        [{"role": "user", "content": r["turns"][0]}], tokenize=False, add_generation_prompt=True))
        for r in mt[:per_source]]
    wiki = [x.strip() for x in (d / "wikitext2_test.txt").read_text().splitlines()
            if len(x.strip()) > 300 and not x.strip().startswith("=")]
    out += [("wikitext2_test", x) for x in wiki[:per_source]]
    return out


@torch.no_grad()
def route_streams(model, tokenizer, prompts, max_tokens: int) -> list[list[list[tuple[int, ...]]]]:
    """Per prompt, per layer, the token stream of top-k expert sets: [P][L][T] tuples of k ids."""
    model.eval()
    k = model.config.num_experts_per_tok
    streams = []
    for _, text in prompts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :max_tokens]
        logits = model(input_ids=ids, output_router_logits=True).router_logits  # L x [T, E]
        streams.append([[tuple(sorted(r)) for r in lg.topk(k, dim=-1).indices.tolist()]
                        for lg in logits])
    return streams


def load_entropy_bits(sets: list[tuple[int, ...]]) -> float:
    counts = Counter(e for s in sets for e in s)
    n = sum(counts.values())
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def overlap_fractions(stream: list[tuple[int, ...]], k: int) -> list[float]:
    """|S_t ∩ S_{t+1}| / k for each adjacent token pair."""
    return [len(set(a) & set(b)) / k for a, b in zip(stream, stream[1:])]


def lru_hits(stream: list[tuple[int, ...]], slots: int) -> tuple[int, int]:
    """(hits, accesses) of LRU with `slots` resident experts, starting empty; one token per step."""
    resident: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for step in stream:
        misses = [e for e in step if e not in resident]
        hits += len(step) - len(misses)
        for e in step:
            if e in resident:
                resident.move_to_end(e)
        for e in misses:
            if len(resident) >= slots:
                victim = next(r for r in resident if r not in step)
                del resident[victim]
            resident[e] = None
    return hits, sum(len(s) for s in stream)


def belady_hits(stream: list[tuple[int, ...]], slots: int) -> tuple[int, int]:
    """(hits, accesses) of Belady's offline policy: evict the resident expert (not needed this
    step) whose next use is furthest in the future; starts empty; one token per step."""
    uses: dict[int, list[int]] = {}
    for t, step in enumerate(stream):
        for e in step:
            uses.setdefault(e, []).append(t)

    def next_use(e: int, t: int) -> float:
        i = bisect.bisect_right(uses[e], t)
        return uses[e][i] if i < len(uses[e]) else math.inf

    resident: set[int] = set()
    hits = 0
    for t, step in enumerate(stream):
        misses = [e for e in step if e not in resident]
        hits += len(step) - len(misses)
        for e in misses:
            if len(resident) >= slots:
                victim = max((r for r in resident if r not in step), key=lambda r: (next_use(r, t), r))
                resident.remove(victim)
            resident.add(e)
    return hits, sum(len(s) for s in stream)


def routing_stats(streams, num_layers: int, k: int) -> list[LayerRouting]:
    rows = []
    for layer in range(num_layers):
        per_prompt = [s[layer] for s in streams]
        overlaps = [o for s in per_prompt for o in overlap_fractions(s, k)]
        lru, bel = {}, {}
        for K in RESIDENT_SLOTS:
            lh = [lru_hits(s, K) for s in per_prompt]
            bh = [belady_hits(s, K) for s in per_prompt]
            lru[K] = sum(h for h, _ in lh) / sum(n for _, n in lh)
            bel[K] = sum(h for h, _ in bh) / sum(n for _, n in bh)
        rows.append(LayerRouting(layer, load_entropy_bits([x for s in per_prompt for x in s]),
                                 sum(overlaps) / len(overlaps), lru, bel))
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


# ----------------------------------------------------------------------------- model card
def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def routing_section(stats: list[LayerRouting], cfg, n_prompts: int, n_tokens: int) -> str:
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


def write_card(out: Path, args, model, domains, result: TrainResult, evals, stats, n_prompt_tokens,
               n_prompts, check, files) -> None:
    cfg = model.config
    pc = param_counts(model)
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


def budget_note(args, result: TrainResult) -> str:
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
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


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
    stats = routing_stats(streams, model.config.num_hidden_layers, model.config.num_experts_per_tok)
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
    write_card(out, args, model, domains, result, evals, stats, n_prompt_tokens, len(prompts),
               check, dir_files(out))
    print(f"wrote {out}: {json.dumps(dir_files(out))}", flush=True)


if __name__ == "__main__":
    main()
