"""Paging at a real model's expert shapes on a CPU: CPU time per decode token, paged vs plain.

Issue 32. A synthetic checkpoint with Qwen3-30B-A3B's expert shapes (hidden 2048, 128 routed
experts, top-8, moe intermediate 768, bf16; 9.4 MB per expert, 1.2 GB of experts per layer),
2-4 layers, random weights, per-expert keys as on the hub, and the bundled model's tokenizer.

Subcommands:

  make DIR [--layers 2]         write the checkpoint (one safetensors shard per layer, written
                                with the safetensors library; a few GB of disk)
  run DIR [--num-resident 128,64,32] [--rounds 5] [--tokens 8] [--threads 1]
                                one process: plain transformers and the paged model at each K,
                                interleaved rounds; prints a table and (``--json``) one JSON line
  compare DIR --before TREE [--runs 2] [run's flags]
                                ``run`` alternately from TREE (e.g. a worktree of main's commit:
                                its own PYTHONPATH, in a subprocess: two copies of the package
                                cannot share one process) and from this tree, ``--runs`` times
                                each, then one table with both
  quantized DIR QDIR [--num-resident 128,32] [--rounds 3] [--tokens 4] [--threads 1]
                                one process: plain transformers on DIR (bf16) and the paged model
                                on QDIR (DIR quantized by ``pagedexperts quantize --format w4a16
                                --group-size 128``) two ways: dequantizing (grouped_mm over dense
                                slots, the CPU default before issue 38) and packed (torch's int4
                                CPU kernel, ``--experts-implementation packed``), at each K,
                                interleaved rounds; plus the cost of converting one expert to the
                                kernel's layout (what a page-in of packed slots adds)
  (larger than RAM, the disk tier: bench/real_disk.py)

Method. CPU time (``time.process_time``) per decode token, teacher-forced: every mode decodes the
same token ids (text from ../shared/data/corpus through the bundled tokenizer, or a built-in
text), after an untimed prefill of ``--prefill-tokens`` tokens that also warms the mode up
(with 128 prefill tokens every one of 128 experts is routed to with probability 1 - 3e-4 per
layer, so K = E starts the timing with nothing left to page). The paged model is loaded once;
each round re-attaches fresh K slots over the same host store (``loading.runners.repage``) for
each K. Round r runs the modes in an order rotated by r. Ratios are per round (paged / plain of
the same round); every number is a median with its [min-max] spread over rounds. Every paged
decode's logits are compared with plain's of the same round (torch.equal): a faster path that
changed the output fails the bench.

Beside each K: misses per token and MB paged per token (the paged model's own counters over
the timed tokens), and ``bound``: MB paged per token at this machine's memcpy speed, measured
in the same process (``--threads`` threads copying one expert's 9.4 MB rows into a reused slot:
what a page-in on a CPU device is). Target: K = E within 1.10x of plain; below K = E, the extra
CPU time over plain no more than that bound.

Memory: plain's experts (1.2 GB per layer) + the paged host store (the same) + K slots per
layer (K = 128: the same again); ~7.3 GB at 2 layers. ``compare`` runs its processes one at a
time.

Usage: python bench/real_shape.py make /tmp/real2 --layers 2
       python bench/real_shape.py compare /tmp/real2 --before /tmp/base32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from real_shape_tables import quantized_table, table  # this folder (python bench/real_shape.py)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / ".." / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
# Qwen3-30B-A3B's expert shapes and attention (config.json on the hub); vocab: the bundled tokenizer's
SHAPES = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144)
WEIGHT_STD = 0.02
FALLBACK_TEXT = ("The paging overhead looks small on the bundled model only because the model is tiny. "
                 "Measured side by side with plain transformers at a real model's expert shapes, ") * 40


# -- the checkpoint --------------------------------------------------------------------------

def config_dict(layers: int, vocab_size: int) -> dict:
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=layers,
                dtype="bfloat16", tie_word_embeddings=False, norm_topk_prob=True, rms_norm_eps=1e-6,
                max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=vocab_size,
                rope_parameters=dict(rope_type="default", rope_theta=1e6), **SHAPES)


def layer_tensors(layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (attention, norms, router, 128 experts x gate/up/down), bf16."""
    h, i, e = SHAPES["hidden_size"], SHAPES["moe_intermediate_size"], SHAPES["num_experts"]
    q, kv, d = SHAPES["num_attention_heads"], SHAPES["num_key_value_heads"], SHAPES["head_dim"]
    p = f"model.layers.{layer}."
    shapes = {"self_attn.q_proj.weight": (q * d, h), "self_attn.k_proj.weight": (kv * d, h),
              "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, q * d),
              "mlp.gate.weight": (e, h)}
    for j in range(e):
        shapes.update({f"mlp.experts.{j}.gate_proj.weight": (i, h), f"mlp.experts.{j}.up_proj.weight": (i, h),
                       f"mlp.experts.{j}.down_proj.weight": (h, i)})
    out = {p + name: (torch.randn(shape, generator=gen) * WEIGHT_STD).to(torch.bfloat16) for name, shape in shapes.items()}
    for name, n in (("input_layernorm.weight", h), ("post_attention_layernorm.weight", h),
                    ("self_attn.q_norm.weight", d), ("self_attn.k_norm.weight", d)):
        out[p + name] = torch.ones(n, dtype=torch.bfloat16)
    return out


def make(args) -> None:
    """config.json, the bundled tokenizer, one shard per layer + one for the rest, the index."""
    import shutil

    from safetensors.torch import save_file

    import pagedexperts

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    bundled = pagedexperts.bundled_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (bundled / name).exists():
            shutil.copy(bundled / name, out / name)
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    (out / "config.json").write_text(json.dumps(config_dict(args.layers, vocab), indent=1))
    gen = torch.Generator().manual_seed(args.seed)
    names = [f"model-{s + 1:05d}-of-{args.layers + 1:05d}.safetensors" for s in range(args.layers + 1)]
    weight_map = {}
    for layer in range(args.layers):
        tensors = layer_tensors(layer, gen)
        save_file(tensors, str(out / names[layer]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, names[layer]))
        print(f"wrote {names[layer]}", flush=True)
        del tensors
    h = SHAPES["hidden_size"]
    rest = {"model.embed_tokens.weight": (torch.randn(vocab, h, generator=gen) * WEIGHT_STD).to(torch.bfloat16),
            "lm_head.weight": (torch.randn(vocab, h, generator=gen) * WEIGHT_STD).to(torch.bfloat16),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(rest, str(out / names[-1]), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, names[-1]))
    (out / "model.safetensors.index.json").write_text(json.dumps(dict(metadata={}, weight_map=weight_map)))
    print(f"checkpoint at {out}: {sum(f.stat().st_size for f in out.glob('*.safetensors')) / 1e9:.2f} GB")


# -- measurement -----------------------------------------------------------------------------

def text_ids(model_dir: Path, n: int) -> torch.Tensor:
    """[1, n] token ids of real text (the corpus, else a built-in text) through the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    text = CORPUS.read_text()[:20000] if CORPUS.exists() else FALLBACK_TEXT
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than the {n} needed")
    return torch.tensor([ids[:n]])


@torch.inference_mode()
def decode(model, ids: torch.Tensor, prefill: int, on_prefilled=None) -> tuple[float, torch.Tensor]:
    """(CPU seconds per decode token, logits [n - prefill, V]): prefill ``ids[:, :prefill]``
    untimed, then feed the rest one token at a time (teacher-forced)."""
    mask = torch.ones_like(ids[:, :prefill])
    out = model(input_ids=ids[:, :prefill], attention_mask=mask, use_cache=True)
    cache, logits = out.past_key_values, []
    if on_prefilled is not None:
        on_prefilled()
    t0 = time.process_time()
    for t in range(prefill, ids.shape[1]):
        mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
        out = model(input_ids=ids[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
    return (time.process_time() - t0) / (ids.shape[1] - prefill), torch.cat(logits)


def memcpy_gbps(expert_bytes: int, repeats: int = 30) -> float:
    """GB/s (1e9) of copying one expert's bytes into a reused buffer (a page-in on a CPU
    device), median over ``repeats`` copies from rotating sources (not all in cache)."""
    n = expert_bytes // 2
    srcs = [torch.randn(n).to(torch.bfloat16) for _ in range(4)]
    dst = torch.empty(n, dtype=torch.bfloat16)
    dst.copy_(srcs[0])
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(srcs[r % len(srcs)])
        times.append(time.perf_counter() - t0)
    return expert_bytes / statistics.median(times) / 1e9


def measure(args) -> dict:
    """Per mode the CPU seconds per decode token of each round, the paged counters, memcpy GB/s."""
    from transformers import AutoModelForCausalLM

    import pagedexperts
    from pagedexperts.loading.runners import repage

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.dir)
    ids = text_ids(path, args.prefill_tokens + args.tokens)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 experts_implementation=args.experts_implementation).eval()
    paged, _ = pagedexperts.load_model(path, num_resident=max(args.num_resident),
                                       experts_implementation=args.experts_implementation)
    rt = paged.pagedexperts
    expert_bytes = rt.host_memory.expert_bytes
    names = ["plain"] + [f"K={k}" for k in args.num_resident]
    ref = decode(plain, ids, args.prefill_tokens)[1]  # warm-up, and the reference logits
    decode(paged, ids, args.prefill_tokens)
    times = {n: [] for n in names}
    counters = {n: [] for n in names[1:]}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name == "plain":
                t, logits = decode(plain, ids, args.prefill_tokens)
            else:
                repage(paged, num_resident=int(name[2:]))
                t, logits = decode(paged, ids, args.prefill_tokens, on_prefilled=rt.reset_stats)
                s = rt.stats().as_dict(times=False)
                counters[name].append((s["misses_per_token"], s["bytes_per_token"]))
            if not torch.equal(logits, ref):
                raise SystemExit(f"{name}: logits differ from plain transformers' (not exact)")
            times[name].append(t)
    return dict(times=times, counters={n: [list(c) for c in cs] for n, cs in counters.items()},
                memcpy_gbps=memcpy_gbps(expert_bytes), expert_bytes=expert_bytes,
                threads=torch.get_num_threads(), pagedexperts=str(Path(pagedexperts.__file__).parent),
                rounds=args.rounds, tokens=args.tokens, layers=paged.config.num_hidden_layers)


def measure_quantized(args) -> dict:
    """``quantized``: per mode the CPU seconds per decode token of each round, MB paged per
    token, and one expert's conversion to the int4 kernel's layout (ms, median of 5) against a
    memcpy of its packed bytes. Each paged mode's logits at every K equal its own at the first
    K (torch.equal), every round."""
    from transformers import AutoModelForCausalLM

    import pagedexperts
    from pagedexperts.loading.runners import repage

    if args.threads:
        torch.set_num_threads(args.threads)
    ids = text_ids(Path(args.dir), args.prefill_tokens + args.tokens)
    plain = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    models = {impl: pagedexperts.load_model(args.qdir, num_resident=max(args.num_resident), experts_implementation=impl,
                                            check_independence=False)[0] for impl in ("grouped_mm", "packed")}
    names = ["plain"] + [f"{impl} K={k}" for impl in models for k in args.num_resident]
    refs = {impl: decode(m, ids, args.prefill_tokens)[1] for impl, m in models.items()}
    decode(plain, ids, args.prefill_tokens)
    times, counters = {n: [] for n in names}, {n: [] for n in names[1:]}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name == "plain":
                times[name].append(decode(plain, ids, args.prefill_tokens)[0])
                continue
            impl, k = name.split(" K=")
            model = models[impl]
            repage(model, num_resident=int(k))
            t, logits = decode(model, ids, args.prefill_tokens, on_prefilled=model.pagedexperts.reset_stats)
            if not torch.equal(logits, refs[impl]):
                raise SystemExit(f"{name}: logits differ from {impl} at K={max(args.num_resident)} (not exact)")
            s = model.pagedexperts.stats().as_dict(times=False)
            counters[name].append((s["misses_per_token"], s["bytes_per_token"]))
            times[name].append(t)
    rt = models["packed"].pagedexperts
    return dict(times=times, counters={n: [list(c) for c in cs] for n, cs in counters.items()},
                memcpy_gbps=memcpy_gbps(rt.host_memory.expert_bytes), expert_bytes=rt.host_memory.expert_bytes,
                convert_ms=convert_ms(models["grouped_mm"].pagedexperts, rt), threads=torch.get_num_threads(),
                pagedexperts=str(Path(pagedexperts.__file__).parent), rounds=args.rounds, tokens=args.tokens,
                layers=plain.config.num_hidden_layers)


def convert_ms(dequantizing, packed, repeats: int = 5) -> float:
    """CPU ms to convert one expert's packed rows (the ``dequantizing`` runtime's store: the
    checkpoint's layout) to the CPU kernel's layout (``packed``'s slot table, ``formats.cpu_pack``:
    what loading does once per expert, and a page-in from the disk tier), median of ``repeats``."""
    store = next(iter(dequantizing.runners.values())).store
    slots = next(iter(packed.runners.values())).slots
    times = []
    for e in range(repeats):
        rows = {name: t[e] for name, t in store.tensors.items()}
        t0 = time.process_time()
        slots.convert(rows)
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def run(args) -> None:
    if args.cmd == "quantized":
        res = measure_quantized(args)
        print(json.dumps(res) if args.json else quantized_table(res))
        return
    res = measure(args)
    if args.json:
        print(json.dumps(res))
    else:
        print(table(res, args.label))


def compare(args, argv: list[str]) -> None:
    """``run`` from ``args.before`` and from this tree, alternately, ``args.runs`` times each."""
    inner = strip_flags(argv, {"--before": 2, "--runs": 2})
    inner[0] = "run"
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    results = {label: [] for label in trees}
    for run_no in range(args.runs):
        for label, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            if args.threads:
                env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
            cmd = [sys.executable, str(Path(__file__).resolve()), *inner, "--json"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            results[label].append(res)
            print(table(res, f"{label} ({tree}), run {run_no + 1}"), flush=True)


def strip_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without each flag of ``flags`` and its values (flag -> tokens it takes)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += flags[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the synthetic checkpoint")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, default=2, help="decoder layers, each one MoE layer (default 2)")
    m.add_argument("--seed", type=int, default=0)
    for name in ("run", "compare", "quantized"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        if name == "quantized":
            p.add_argument("qdir", help="DIR quantized: pagedexperts quantize --format w4a16 --group-size 128")
        p.add_argument("--num-resident", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64, 32],
                       help="K values (default 128,64,32; the first is loaded, the others repaged)")
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--tokens", type=int, default=8, help="timed decode tokens per round and mode")
        p.add_argument("--prefill-tokens", type=int, default=128, help="untimed prefill (warms the slots up)")
        p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's default)")
        p.add_argument("--experts-implementation", default="grouped_mm")
        p.add_argument("--json", action="store_true")
        p.add_argument("--label", default=f"this tree ({ROOT})")
    sub.choices["compare"].add_argument("--before", required=True, help="tree of the 'before' code")
    sub.choices["compare"].add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        make(args)
    elif args.cmd in ("run", "quantized"):
        run(args)
    else:
        compare(args, argv)


if __name__ == "__main__":
    main()
