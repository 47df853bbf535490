"""Whole-model int4 on a CPU: CPU time per decode token, and where a whole-model token's time goes.

One process, interleaved rounds (round r runs the modes in an order rotated by r), CPU time
(``time.process_time``) per decode token, teacher-forced over the same real-text token ids after
an untimed prefill (bench/real_shape.py's ``decode``), every expert resident (K = E):

- ``plain bf16``: transformers' own model of DIR (``from_pretrained``, bf16, grouped_mm);
- ``experts packed``: EXPERTS_DIR (DIR through ``quantize --format w4a16 --scope experts``),
  ``--experts-implementation packed`` (attention and lm_head stay bf16);
- ``whole model packed``: MODEL_DIR (``--scope model``), the same (attention int4, lm_head int8:
  ``PackedLinear``).

Each paged mode's logits equal its own first round's (torch.equal: exact to itself every round);
top-1 agreement with plain over the timed tokens is printed (random weights: indicative only).
Then ``--profile-tokens`` more whole-model tokens with forward hooks (thread CPU time per module
kind: attention projections, attention core, router, routed experts, lm_head, norms) and, in a
second pass under torch.profiler, the self time of torch's int4 / int8 kernels called inside the
routed experts module (the experts' matmuls; the rest of that module is its glue).

    python bench/real_shape.py make /work/ckpts/real4 --layers 4
    pagedexperts quantize --model-path /work/ckpts/real4 --format w4a16 --output /work/ckpts/real4-w4a16
    pagedexperts quantize --model-path /work/ckpts/real4 --format w4a16 --scope model \\
        --output /work/ckpts/real4-w4a16-model
    python bench/whole_model_cpu.py /work/ckpts/real4 /work/ckpts/real4-w4a16 /work/ckpts/real4-w4a16-model --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from real_shape import decode, text_ids  # this folder (python bench/whole_model_cpu.py)

KERNELS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def load(args):
    """{mode: model}, every expert resident."""
    from transformers import AutoModelForCausalLM

    import pagedexperts

    plain = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    models = {"plain bf16": plain.eval()}
    for name, path in (("experts packed", args.experts_dir), ("whole model packed", args.model_dir)):
        model, _ = pagedexperts.load_model(path, num_resident=plain.config.num_experts, experts_implementation="packed",
                                           check_independence=False)
        models[name] = model.eval()
    return models


KINDS = {"q_proj": "attention projections", "k_proj": "attention projections", "v_proj": "attention projections",
         "o_proj": "attention projections", "self_attn": "attention (all)", "lm_head": "lm_head",
         "experts": "routed experts", "gate": "router", "input_layernorm": "norms",
         "post_attention_layernorm": "norms", "norm": "norms"}  # module name's last part -> kind (q/k_norm: attention)


def hooked_times(model, ids, prefill: int) -> tuple[dict[str, float], float]:
    """({kind: thread CPU seconds per decode token}, total per token) with forward hooks on
    every module of ``kind_of`` (one thread: thread time is the process's CPU time)."""
    spent: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():
        kind = KINDS.get(name.rpartition(".")[2])
        if kind is None:
            continue
        start = {}
        handles.append(module.register_forward_pre_hook(lambda m, a, s=start: s.__setitem__("t", time.thread_time())))
        handles.append(module.register_forward_hook(
            lambda m, a, o, s=start, k=kind: spent.__setitem__(k, spent.get(k, 0.0) + time.thread_time() - s["t"])))
    total, _ = decode(model, ids, prefill, on_prefilled=spent.clear)
    for h in handles:
        h.remove()
    tokens = ids.shape[1] - prefill
    return {k: v / tokens for k, v in spent.items()}, total


def experts_kernel_seconds(model, ids, prefill: int) -> float:
    """Self CPU seconds per decode token of torch's int4 / int8 kernels called inside the routed
    experts modules (profiler events of the decode tokens whose parent chain holds an
    ``experts`` range)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    handles, ranges = [], []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            handles.append(module.register_forward_pre_hook(lambda m, a: ranges.append(record_function("experts").__enter__())))
            handles.append(module.register_forward_hook(lambda m, a, o: ranges.pop().__exit__(None, None, None)))
    prof = profile(activities=[ProfilerActivity.CPU])
    decode(model, ids, prefill, on_prefilled=prof.start)  # the decode tokens only
    prof.stop()
    for h in handles:
        h.remove()
    seconds = 0.0
    for event in prof.events():
        if event.name not in KERNELS:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != "experts":
            parent = parent.cpu_parent
        if parent is not None:
            seconds += event.self_cpu_time_total / 1e6
    return seconds / (ids.shape[1] - prefill)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="the bf16 checkpoint (bench/real_shape.py make)")
    p.add_argument("experts_dir", help="DIR quantized --scope experts")
    p.add_argument("model_dir", help="DIR quantized --scope model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="timed decode tokens per round and mode")
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--profile-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = load(args)
    names = list(models)
    ids = text_ids(Path(args.dir), args.prefill_tokens + args.tokens)
    refs = {n: decode(m, ids, args.prefill_tokens)[1] for n, m in models.items()}  # warm-up, and each one's own logits
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t, logits = decode(models[name], ids, args.prefill_tokens)
            if not torch.equal(logits, refs[name]):
                raise SystemExit(f"{name}: round {r} logits differ from its first run (not exact to itself)")
            times[name].append(t)
    plain = times["plain bf16"]
    print(f"{args.tokens} teacher-forced decode tokens after {args.prefill_tokens} prefill, {args.threads} thread(s), "
          f"K = E, median [min-max] of {args.rounds} interleaved rounds, CPU time")
    print("| configuration | ms / token | vs plain bf16 | top-1 equal to plain |")
    print("| --- | --- | --- | --- |")
    for name in names:
        ratio = [t / q for t, q in zip(times[name], plain)]
        agree = int((refs[name].argmax(-1) == refs["plain bf16"].argmax(-1)).sum())
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.1f} [{min(times[name]) * 1e3:.1f}-"
              f"{max(times[name]) * 1e3:.1f}] | {statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}] | "
              f"{agree} of {args.tokens} |")
    model = models["whole model packed"]
    prof_ids = ids[:, : args.prefill_tokens + args.profile_tokens]
    kinds, total = hooked_times(model, prof_ids, args.prefill_tokens)
    kernel = experts_kernel_seconds(model, prof_ids, args.prefill_tokens)
    print(f"\nwhole model packed, where a decode token's {total * 1e3:.1f} ms go (hooks, thread CPU time, "
          f"{args.profile_tokens} tokens; the experts' int4 matmuls from a second pass under torch.profiler):")
    lm_head = model.get_output_embeddings()
    return report(kinds, total, kernel, getattr(lm_head, "kind", "bf16"))


def report(kinds: dict[str, float], total: float, kernel: float, lm_head: str) -> int:
    """The breakdown table: attention projections, core, router, experts matmuls and glue, lm_head, norms, rest."""
    rows = {"attention projections (int4, PackedLinear)": kinds.get("attention projections", 0.0),
            "attention core (rope, norms, sdpa)": kinds.get("attention (all)", 0.0) - kinds.get("attention projections", 0.0),
            "router": kinds.get("router", 0.0),
            "routed experts: int4 matmuls": kernel,
            "routed experts: glue": kinds.get("routed experts", 0.0) - kernel,
            f"lm_head ({lm_head})": kinds.get("lm_head", 0.0),
            "norms (decoder layers, final)": kinds.get("norms", 0.0)}
    rows["rest"] = total - sum(rows.values())
    print("| part | ms / token | share |")
    print("| --- | --- | --- |")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / total:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
