"""Distil the draft model that pagedexperts ships for speculative decoding of its bundled model.

What it owns: the whole recipe for `pagedexperts/data/tiny-qwen3-draft` -- a small dense
`Qwen3ForCausalLM` with the bundled model's tokenizer (copied, so the vocabularies are equal by
construction), initialised from the teacher's embeddings (tied LM head), final norm and first
layers' attention, trained to the teacher's next-token distributions (forward KL(p_teacher ||
q_draft), every position) on the training split of the corpora the teacher was trained on
(the same documents and held-out split: `tiny_moe_corpus.read_documents` / `split_documents`
with the same --heldout-frac), then evaluated on the held-out split against the teacher
(teacher-forced top-1 agreement, KL, expected sampled acceptance sum_v min(p, q)) and through
pagedexperts' own speculative decoding (greedy acceptance on held-out prompts, output checked
equal to plain greedy), with the untrained early exit (`save_truncated_draft`) as the
baseline in the same run; then the Hugging Face directory and a generated model card
(`draft_card.py`).

What it deliberately does not do: it is not part of the library (nothing in the package imports
it) and it never downloads anything; corpora are local text files.

Example (the command the shipped draft was trained with is in its README.md):
    python scripts/train_draft.py \\
        --corpus /work/shared/data/corpus/tinyshakespeare.txt \\
                 /work/shared/data/corpus/gsm8k_train.jsonl \\
                 /work/shared/data/corpus/wikitext2_valid.txt --max-minutes 15

Dimension letters: B batch, T tokens, V vocabulary, L layers, n proposals per step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_card import write_card  # noqa: E402
from tiny_moe_card import result_command  # noqa: E402
from tiny_moe_corpus import Domain, encode_stream, mixed_order, read_documents, split_documents  # noqa: E402
from train_schedule import WARM_STEPS, lr_at, make_optimizer, planned_steps  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEACHER = REPO / "pagedexperts" / "data" / "tiny-qwen3-moe"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    wall_s: float
    final_loss: float  # KL(p || q) nats/token, EMA
    log: list[dict]


# ----------------------------------------------------------------------------- data and models
def load_domains(paths: list[str], heldout_frac: float, tokenizer) -> list[Domain]:
    """The teacher's documents and split, encoded with the teacher's tokenizer."""
    domains = []
    for p in paths:
        train, held = split_documents(read_documents(p), heldout_frac)
        d = Domain(Path(p).stem, p, len(train), len(held))
        d.train_ids, d.heldout_ids = encode_stream(tokenizer, train), encode_stream(tokenizer, held)
        domains.append(d)
    return domains


def build_draft(args, teacher):
    """A dense Qwen3 with the teacher's width, heads and RoPE; embeddings, final norm and the
    first --layers layers' attention (and their norms) copied from the teacher."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t = teacher.config
    config = Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        rope_parameters=t.rope_parameters, max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=True, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    draft = Qwen3ForCausalLM(config)
    if args.init_from_teacher:
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
            draft.model.norm.weight.copy_(teacher.model.norm.weight)
            for mine, theirs in zip(draft.model.layers, teacher.model.layers):
                mine.self_attn.load_state_dict(theirs.self_attn.state_dict())
                mine.input_layernorm.load_state_dict(theirs.input_layernorm.state_dict())
                mine.post_attention_layernorm.load_state_dict(theirs.post_attention_layernorm.state_dict())
    draft.generation_config = GenerationConfig(eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id,
                                               do_sample=False, max_new_tokens=128)
    return draft


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    """[B, T, V] float32 next-token logits."""
    return model(input_ids=x, use_cache=False).logits.float()


# ----------------------------------------------------------------------------- training
def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over B*T positions of KL(p_teacher || q_student) in nats; both [B, T, V]."""
    v = student_logits.shape[-1]
    return F.kl_div(F.log_softmax(student_logits.reshape(-1, v), -1),
                    F.log_softmax(teacher_logits.reshape(-1, v), -1), log_target=True, reduction="batchmean")


def step_budget(args, step: int, total: int | None, started: float, timed_from: tuple[int, float]) -> int:
    """The planned step count: planned at step 0, re-planned every --replan-every steps from
    --calibrate on (the shared CPUs' speed varies), as train_tiny_moe does."""
    if total is None or (not args.steps and step >= args.calibrate
                         and (step - args.calibrate) % args.replan_every == 0 and step < total):
        return planned_steps(args, step, started, timed_from)
    return total


def train(draft, teacher, domains: list[Domain], args) -> TrainResult:
    opt = make_optimizer(draft, args.lr, args.weight_decay)
    draft.train()
    started, step, epoch, log = time.time(), 0, 0, []
    total, loss_ema, timed_from = None, None, (0, started)
    while True:
        for x in mixed_order(domains, args.seq_len, epoch, args.seed).split(args.batch_size):
            if len(x) < args.batch_size:
                continue
            if step == WARM_STEPS:
                timed_from = (step, time.time())
            total = step_budget(args, step, total, started, timed_from)
            elapsed = time.time() - started
            if step >= total or (args.max_minutes and elapsed > args.max_minutes * 60):
                return TrainResult(step, step * args.batch_size * args.seq_len, elapsed, loss_ema, log)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args.lr, args.warmup)
            with torch.no_grad():
                target = logits_of(teacher, x)
            loss = kl_loss(logits_of(draft, x), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
            step += 1
            if step % args.log_every == 0 or step == 1:
                row = {"step": step, "planned": total, "epoch": epoch, "kl": round(loss.item(), 4),
                       "kl_ema": round(loss_ema, 4), "lr": opt.param_groups[0]["lr"],
                       "elapsed_s": round(time.time() - started, 1)}
                log.append(row)
                print(json.dumps(row), flush=True)
        epoch += 1


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def agreement(draft, teacher, ids: list[int], seq_len: int) -> dict:
    """Teacher-forced, over chunks of a held-out stream: top-1 agreement (the greedy acceptance
    of one proposal), mean KL(p || q) nats, mean sum_v min(p, q) (the expected acceptance of
    one sampled proposal at temperature 1, Leviathan et al. 2023, Sec. 3.3), the draft's and the
    teacher's cross-entropy on the true next token (nats)."""
    draft.eval()
    sums = {"agree": 0.0, "kl": 0.0, "min_pq": 0.0, "draft_ce": 0.0, "teacher_ce": 0.0}
    n = 0
    for i in range(0, len(ids) - 1, seq_len):
        x = torch.tensor([ids[i:i + seq_len + 1]])
        if x.shape[1] < 2:
            continue
        q_logits, p_logits = logits_of(draft, x[:, :-1])[0], logits_of(teacher, x[:, :-1])[0]
        labels = x[0, 1:]
        p, q = p_logits.softmax(-1), q_logits.softmax(-1)
        sums["agree"] += (q_logits.argmax(-1) == p_logits.argmax(-1)).sum().item()
        sums["kl"] += kl_loss(q_logits[None], p_logits[None]).item() * len(labels)
        sums["min_pq"] += torch.minimum(p, q).sum(-1).sum().item()
        sums["draft_ce"] += F.cross_entropy(q_logits, labels, reduction="sum").item()
        sums["teacher_ce"] += F.cross_entropy(p_logits, labels, reduction="sum").item()
        n += len(labels)
    return {"tokens": n} | {k: v / n for k, v in sums.items()}


def evaluate(draft, teacher, domains: list[Domain], seq_len: int) -> dict:
    rows = {d.name: agreement(draft, teacher, d.heldout_ids, seq_len) for d in domains}
    n = sum(r["tokens"] for r in rows.values())
    rows["all"] = {"tokens": n} | {k: sum(r[k] * r["tokens"] for r in rows.values()) / n
                                   for k in next(iter(rows.values())) if k != "tokens"}
    return rows


def heldout_prompts(domains: list[Domain], per_domain: int, length: int) -> list[list[int]]:
    """`per_domain` prompts of `length` tokens from each held-out stream, at evenly spaced offsets."""
    out = []
    for d in domains:
        stride = max(1, (len(d.heldout_ids) - length) // per_domain)
        out += [d.heldout_ids[i * stride:i * stride + length] for i in range(per_domain)]
    return out


def speculative_acceptance(teacher_dir: Path, draft_dirs: dict[str, str], prompts: list[list[int]], args) -> dict:
    """Greedy speculative decoding through pagedexperts' scheduler (the paged teacher, K = E/4,
    batch --spec-batch, n = --num-speculative-tokens, --spec-tokens new tokens per prompt): per
    draft, acceptance (accepted / proposed), accepted per verification step, and whether every
    output equals plain greedy decoding's."""
    from pagedexperts import load_model
    from pagedexperts.generation.config import SamplingConfig
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from pagedexperts.engine.speculative.config import speculative_config

    model, tokenizer = load_model(teacher_dir)

    def run(spec):
        sched = BatchScheduler(model, tokenizer, SchedulerConfig(args.spec_batch, 512), speculative=spec)
        reqs = [sched.submit(p, SamplingConfig(max_new_tokens=args.spec_tokens), lambda e: None) for p in prompts]
        with torch.no_grad():
            while sched.num_running or sched.num_waiting:
                sched.step()
        return [r.output_ids for r in reqs], sched.speculative.stats.as_dict() if spec else {}

    plain, _ = run(None)
    out = {}
    for name, path in draft_dirs.items():
        spec = speculative_config("draft", draft_model_path=path, num_speculative_tokens=args.num_speculative_tokens)
        outputs, stats = run(spec)
        out[name] = stats | {"identical_to_plain_greedy": outputs == plain}
        print(name, json.dumps(out[name]), flush=True)
    return out


# ----------------------------------------------------------------------------- save and card
def save(draft, out: Path, teacher_dir: Path) -> dict[str, int]:
    draft.save_pretrained(out)
    for name in SIDE_FILES:
        if (teacher_dir / name).exists():
            shutil.copy(teacher_dir / name, out / name)
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def verify_reload(out: Path, draft, tokenizer) -> float:
    """Reload with the Auto classes (as `--draft-model-path` does); max |logit diff| to the trained draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if AutoTokenizer.from_pretrained(out).get_vocab() != tokenizer.get_vocab():
        raise RuntimeError(f"{out}: tokenizer vocabulary differs from the teacher's")
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.tensor([tokenizer("ROMEO:\nWhat light is this?")["input_ids"]])
    with torch.no_grad():
        diff = (logits_of(draft.eval(), x) - logits_of(again, x)).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"reloaded draft differs from the trained one: max |diff| {diff:.3g}")
    return diff


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--teacher", default=str(TEACHER), help="the target model directory (its tokenizer is copied)")
    p.add_argument("--corpus", nargs="+", required=True, help="the teacher's corpus files (.txt / .jsonl)")
    p.add_argument("--heldout-frac", type=float, default=0.02, help="tail of each file held out (the teacher's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--no-init-from-teacher", dest="init_from_teacher", action="store_false")
    p.add_argument("--steps", type=int, default=0, help="0: as many as fit in --max-minutes")
    p.add_argument("--max-minutes", type=float, default=15.0, help="wall-clock training budget; 0: none")
    p.add_argument("--calibrate", type=int, default=20, help="steps timed to plan the schedule")
    p.add_argument("--replan-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--spec-prompts", type=int, default=4, help="held-out prompts per domain for the acceptance run")
    p.add_argument("--spec-prompt-len", type=int, default=16)
    p.add_argument("--spec-tokens", type=int, default=48)
    p.add_argument("--spec-batch", type=int, default=4)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "pagedexperts" / "data" / "tiny-qwen3-draft"))
    args = p.parse_args(argv)
    if not args.steps and not args.max_minutes:
        p.error("give --steps or --max-minutes")
    return args


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedexperts.engine.speculative.draft import save_truncated_draft

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher_dir, out = Path(args.teacher), Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    teacher.requires_grad_(False)
    domains = load_domains(args.corpus, args.heldout_frac, tokenizer)
    for d in domains:
        print(f"{d.name}: train {len(d.train_ids)} tokens, held-out {len(d.heldout_ids)}", flush=True)
    draft = build_draft(args, teacher)
    result = train(draft, teacher, domains, args)
    print(f"trained {result.steps} steps, {result.tokens_seen} tokens, {result.wall_s:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    files = save(draft, out, teacher_dir)
    reload_diff = verify_reload(out, draft, tokenizer)
    baseline_dir = save_truncated_draft(teacher_dir, tempfile.mkdtemp(), num_layers=2)
    baseline = AutoModelForCausalLM.from_pretrained(baseline_dir, dtype=torch.float32).eval()
    evals = {"tiny-qwen3-draft": evaluate(draft, teacher, domains, args.seq_len),
             "early-exit": evaluate(baseline, teacher, domains, args.seq_len)}
    print(json.dumps(evals, indent=1), flush=True)
    prompts = heldout_prompts(domains, args.spec_prompts, args.spec_prompt_len)
    spec = speculative_acceptance(teacher_dir, {"tiny-qwen3-draft": str(out), "early-exit": str(baseline_dir)},
                                  prompts, args)
    stats = {"command": result_command(args), "train": asdict(result), "heldout": evals, "speculative": spec,
             "reload_max_abs_logit_diff": reload_diff}
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    write_card(out, args, draft, domains, result, evals, spec, files)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
