"""Expert formats side by side: bytes per expert, bytes paged per decode token, decode time.

For each checkpoint (default: the bundled tiny Qwen3-MoE in bf16 and in block FP8, and a tiny
random gpt-oss in bf16 and in MXFP4, all written here in the published layouts), in ONE run:
- bytes of one expert as stored/paged (packed) and dequantized (dense), and their ratio to
  the bf16 expert of the same model;
- bytes paged per decode token at K = E/2 (page-in counters, decode steps only);
- decode seconds per token at K = E/2 with packed slots and with dense slots, with dense slots
  at the K that fits in the memory of K = E/2 packed slots (K x packed / dense bytes, at least
  top_k), and with every expert resident and dequantized (mode "resident": the dequantized
  resident model).
Decode time per token: CPU time of the one torch thread (``--threads 1``, the default; on a
busy shared machine wall time mostly measures waiting for a core) between consecutive steps'
logits (a logits processor stamps it), the median step of a run, and of ``--repeats`` rounds
the smallest; each round runs every configuration of a checkpoint once, in turn, after a
warm-up round. Bytes per decode token: page-ins of a run minus those of the prefill alone,
over N - 1. Slots emptied (``repage``) before each run.

Usage: PYTHONPATH=. python bench/formats_bench.py [--new-tokens 32] [--repeats 3] [--threads 1]
       [--model-path DIR ...] [--out bench/results/formats.md]
CPU timings on this machine; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the published-layout writers used by the tests

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and"


def build_inputs(workdir: Path) -> list[tuple[str, Path]]:
    """(label, directory) of the default checkpoints, written under ``workdir``."""
    from quantized_dirs import write_fp8_block, write_mxfp4
    from transformers import GptOssConfig, GptOssForCausalLM

    from pagedexperts.loading.bundled import bundled_model_path

    bundled = bundled_model_path()
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=32,
                       num_experts_per_tok=4, max_position_embeddings=512, sliding_window=64,
                       initializer_range=0.1, pad_token_id=0, eos_token_id=None, tie_word_embeddings=False)
    oss = workdir / "gpt-oss-tiny"
    GptOssForCausalLM(cfg).save_pretrained(oss)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (bundled / f).exists():
            (oss / f).write_bytes((bundled / f).read_bytes())
    return [
        ("qwen3 bf16", bundled),
        ("qwen3 fp8-block", write_fp8_block(bundled, workdir / "qwen3-fp8", (128, 128))),
        ("gpt-oss bf16", oss),
        ("gpt-oss mxfp4", write_mxfp4(oss, workdir / "gpt-oss-mxfp4")),
    ]


class _Clock:
    """A logits processor that only records the thread's CPU time when each step's logits are
    ready (CPU time, not wall time: on a shared machine waiting for a core is not counted)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.thread_time())
        return scores


def _decode_s(model, ids, new_tokens: int) -> list[float]:
    """Seconds of each decode step: between consecutive steps' logits (the first follows prefill)."""
    from transformers import LogitsProcessorList

    clock = _Clock()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                       logits_processor=LogitsProcessorList([clock]))
    return [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]


def one_run(model, ids, *, mode: str, k: int, new_tokens: int) -> tuple[float, float]:
    """(median decode seconds per step, bytes paged per decode token) of one run in ``mode`` at
    K = ``k``, from empty slots."""
    from pagedexperts.loading.runners import repage

    repage(model, mode=mode, num_resident=k)
    with torch.no_grad():
        model(ids)  # prefill alone, to separate its page-ins from the decode steps'
    prefill_bytes = model.pagedexperts.stats().total().bytes_paged
    repage(model, mode=mode, num_resident=k)
    step_s = statistics.median(_decode_s(model, ids, new_tokens))
    return step_s, (model.pagedexperts.stats().total().bytes_paged - prefill_bytes) / (new_tokens - 1)


def measure(label: str, path: Path, *, new_tokens: int, repeats: int) -> dict:
    """One checkpoint: both slot formats loaded side by side, every configuration run once per
    round, ``repeats`` rounds (so a busy spell of the machine hits all of them alike)."""
    from pagedexperts import load_model

    models = {sf: load_model(path, dtype="bfloat16", slot_format=sf) for sf in ("packed", "dense")}
    rt = models["packed"][0].pagedexperts
    k = rt.num_experts // 2
    k_same = max(rt.top_k, k * rt.expert_bytes // rt.dense_expert_bytes)  # dense slots in K=E/2 packed's memory
    configs = {"packed": ("packed", "paged", k), "dense": ("dense", "paged", k),
               "dense_same_memory": ("dense", "paged", k_same), "resident": ("packed", "resident", k)}
    ids = models["packed"][1](PROMPT, return_tensors="pt")["input_ids"]
    times = {name: [] for name in configs}
    paged = {}
    for round_ in range(repeats + 1):  # round 0 warms up (allocations, kernel selection)
        for name, (sf, mode, kk) in configs.items():
            step_s, paged[name] = one_run(models[sf][0], ids, mode=mode, k=kk, new_tokens=new_tokens)
            if round_:
                times[name].append(step_s)
    row = dict(label=label, format=rt.expert_format, k=k, k_same_memory=k_same, num_experts=rt.num_experts,
               top_k=rt.top_k, expert_bytes=rt.expert_bytes, dense_expert_bytes=rt.dense_expert_bytes)
    for name in configs:
        row[f"{name}_s"], row[f"{name}_bytes_per_token"] = min(times[name]), paged[name]
    return row


def table(rows: list[dict]) -> str:
    bf16 = {r["label"].split()[0]: r["dense_expert_bytes"] for r in rows}
    lines = [
        "| checkpoint | expert bytes (packed) | vs bf16 | paged/decode token, packed slots K=E/2 | dense slots "
        "| dense, same memory | decode CPU ms/token, packed K=E/2 | dense K=E/2 | dense, same memory "
        "| resident dequantized | packed / resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["expert_bytes"] / bf16[r["label"].split()[0]]
        lines.append(
            f"| {r['label']} (E={r['num_experts']}, k={r['top_k']}, K={r['k']}) | {r['expert_bytes']:,} | {ratio:.3f}x "
            f"| {r['packed_bytes_per_token'] / 1e3:,.1f} kB | {r['dense_bytes_per_token'] / 1e3:,.1f} kB "
            f"| {r['dense_same_memory_bytes_per_token'] / 1e3:,.1f} kB (K={r['k_same_memory']}) "
            f"| {r['packed_s'] * 1e3:.2f} | {r['dense_s'] * 1e3:.2f} | {r['dense_same_memory_s'] * 1e3:.2f} "
            f"| {r['resident_s'] * 1e3:.2f} "
            f"| {r['packed_s'] / r['resident_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", action="append", default=None, help="checkpoint dir (repeatable; default: built here)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode tokens per run (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement, the least disturbed one reported (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: step times are the CPU time of this one thread)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be >= 2, got {args.new_tokens}")
    with tempfile.TemporaryDirectory() as tmp:
        inputs = [(Path(m).name, Path(m)) for m in args.model_path] if args.model_path else build_inputs(Path(tmp))
        rows = [measure(label, path, new_tokens=args.new_tokens, repeats=args.repeats) for label, path in inputs]
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
