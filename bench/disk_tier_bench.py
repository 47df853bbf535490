"""Disk tier and loading benchmarks on synthetic Qwen3-MoE checkpoints (bf16, per-expert keys).

Subcommands (each measurement runs in its own process, so RSS and page cache are its own):

  make DIR --layers L           write a synthetic checkpoint (hidden 2048, expert intermediate 768,
                                E=128, top-8: Qwen3-30B-A3B's expert shapes; 9.4 MB per expert)
  load DIR [--cold]             load_model wall time vs a plain read + copy of the same bytes (warm
                                or cold page cache: posix_fadvise DONTNEED), RSS after load against
                                store + slots + non-expert + runtime, checkpoint mappings in smaps
  decode DIR --engine E         decode tok/s at batch 1 with routing driven by a real trace:
                                paged (--host-memory-gb G: disk tier) or accelerate (transformers
                                device_map with offload_folder, max_memory cpu=G)
  all BIG SMALL                 the side-by-side run of the issue (disk tier, accelerate, in-RAM)

Routing: the router's top-k ids are replaced by the OLMoE GSM8K trace's decode stream
(../shared/data/traces, E=64, top-8; layer l maps expert e to perm_l[e] of E=128), so the reuse is
that of real text, not of random weights. Weights are random.
Example: python bench/disk_tier_bench.py all /work/big /work/small --tokens 12 --host-memory-gb 10
  (--host-memory-gb of the paged runs budgets everything they hold on the host, slots included:
  the same RAM as accelerate's max_memory)
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "olmoe_1b7b_layer0_gsm8k.jsonl"
SHAPES = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
              vocab_size=8192)
SHARD_BYTES = 2 << 30


def config_dict(layers: int) -> dict:
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=layers,
                dtype="bfloat16", tie_word_embeddings=False, norm_topk_prob=True, rms_norm_eps=1e-6,
                max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[], **SHAPES)


def tensor_list(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, e = SHAPES["hidden_size"], SHAPES["moe_intermediate_size"], SHAPES["num_experts"]
    q, kv, d = SHAPES["num_attention_heads"], SHAPES["num_key_value_heads"], SHAPES["head_dim"]
    out = [("model.embed_tokens.weight", (SHAPES["vocab_size"], h))]
    for ly in range(layers):
        p = f"model.layers.{ly}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q * d, h)), (p + "self_attn.k_proj.weight", (kv * d, h)),
                (p + "self_attn.v_proj.weight", (kv * d, h)), (p + "self_attn.o_proj.weight", (h, q * d)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate.weight", (e, h))]
        for j in range(e):
            out += [(p + f"mlp.experts.{j}.gate_proj.weight", (i, h)), (p + f"mlp.experts.{j}.up_proj.weight", (i, h)),
                    (p + f"mlp.experts.{j}.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (SHAPES["vocab_size"], h))]


def make(args) -> None:
    """Write config.json, bf16 shards (safetensors layout written by hand, streamed) and the index."""
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_dict(args.layers), indent=1))
    gen = torch.Generator().manual_seed(0)
    pool = [(torch.randn(768 * 2048, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(97)]
    tensors, shards, cur, size = tensor_list(args.layers), [], [], 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    weight_map, counter = {}, 0
    for s, shard in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            n = int(np.prod(shape)) * 2
            header[name] = dict(dtype="BF16", shape=list(shape), data_offsets=[offset, offset + n])
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                n = int(np.prod(shape))
                if "norm" in name:
                    t = torch.ones(n, dtype=torch.bfloat16)
                elif n == 768 * 2048:
                    t = pool[counter % len(pool)]
                    counter += 1
                else:
                    t = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
                f.write(t.view(torch.uint8).numpy().tobytes())
        print(f"wrote {fname}", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(dict(metadata={}, weight_map=weight_map)))


def drop_cache(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def mapped_checkpoint_bytes(path: Path) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and len(line.split()) >= 5:
                inside = str(path) in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def plain_read_copy(path: Path) -> tuple[float, int]:
    files = sorted(path.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    buf = torch.empty(total, dtype=torch.uint8)
    t0, at = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            n = f.stat().st_size
            fh.readinto(memoryview(buf[at: at + n].numpy()))
            at += n
    return time.perf_counter() - t0, total


def load(args) -> dict:
    """Plain read + copy, then load_model, ``--repeats`` times alternating (the shared machine's
    load drifts); the minimum of each; RSS and mappings after the last load."""
    import gc

    import pagedexperts
    from transformers import Qwen3MoeForCausalLM  # noqa: F401  (imports are not loading)

    path = Path(args.dir)
    out = {"cold": args.cold, "repeats": args.repeats}
    plain, loads, model = [], [], None
    for _ in range(args.repeats):
        if args.cold:
            drop_cache(path)
        seconds, out["checkpoint_bytes"] = plain_read_copy(path)
        plain.append(seconds)
        del model
        gc.collect()
        if args.cold:
            drop_cache(path)
        runtime = rss_bytes()
        t0 = time.perf_counter()
        model, _ = pagedexperts.load_model(path, num_resident=args.num_resident)
        loads.append(time.perf_counter() - t0)
    out.update(plain_read_copy_s=min(plain), load_model_s=min(loads), all_plain_s=plain, all_load_s=loads)
    out["load_over_plain"] = out["load_model_s"] / out["plain_read_copy_s"]
    rt = model.pagedexperts
    out["rss_after_load"] = rss_bytes()
    non_expert = sum(p.numel() * p.element_size() for p in model.parameters())
    slots = sum(t.numel() * t.element_size() for p in rt.runners.values() for t in p.slots.values())
    expected = rt.host_memory.store_bytes + slots + non_expert + runtime
    out.update(store_bytes=rt.host_memory.store_bytes, slot_bytes=slots, non_expert_bytes=non_expert,
               runtime_rss=runtime, expected_rss=expected, rss_over_expected=out["rss_after_load"] / expected,
               checkpoint_mapped_rss=mapped_checkpoint_bytes(path))
    return out


def trace_rows(num_experts: int) -> np.ndarray:
    """The first requests' routed rows of the OLMoE trace (prefill + decode, in order): [n, 8]."""
    rows = [json.loads(line) for line in open(TRACE)]
    rows = [r for r in rows if r.get("type") == "route" and r["layer"] == 0]
    ids = np.array([r["topk_ids"] for r in rows[2048:]], dtype=np.int64)  # skip the profiling rows
    return ids


def install_trace_routing(model, *, layers: int, num_experts: int) -> dict:
    """Replace each router's top-k ids by the trace's next rows (layer l permutes the ids)."""
    ids = trace_rows(num_experts)
    rng = np.random.default_rng(0)
    perms = [torch.from_numpy(rng.permutation(num_experts)[: 64]) for _ in range(layers)]
    state = {"pos": 0}
    decoder = model.model.layers

    def hook(layer):
        def fn(module, inputs, output):
            logits, scores, idx = output
            t = idx.shape[0]
            rows = torch.from_numpy(ids[(state["pos"] + np.arange(t)) % len(ids)])
            if layer == layers - 1:
                state["pos"] += t
            return logits, scores, perms[layer][rows].to(idx.dtype)
        return fn

    for ly in range(layers):
        decoder[ly].mlp.gate.register_forward_hook(hook(ly))
    return state


@torch.no_grad()
def decode_tok_s(model, tokens: int) -> tuple[float, float]:
    from transformers import DynamicCache

    ids = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    prefill = time.perf_counter() - t0
    nxt = out.logits[:, -1:].argmax(-1)
    t1 = time.perf_counter()
    for _ in range(tokens):
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - t1), prefill


def decode(args) -> dict:
    path = Path(args.dir)
    cfg = json.loads((path / "config.json").read_text())
    t0 = time.perf_counter()
    if args.engine == "accelerate":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": int(args.host_memory_gb * 1e9)},
            offload_folder=str(args.offload_folder), experts_implementation="grouped_mm")
    else:
        import pagedexperts

        model, _ = pagedexperts.load_model(path, num_resident=args.num_resident, host_memory_gb=args.host_memory_gb,
                                           prefetch=args.prefetch)
    load_s = time.perf_counter() - t0
    install_trace_routing(model, layers=cfg["num_hidden_layers"], num_experts=cfg["num_experts"])
    if args.engine == "paged":
        model.pagedexperts.reset_stats()
    tok_s, prefill_s = decode_tok_s(model, args.tokens)
    out = dict(engine=args.engine, layers=cfg["num_hidden_layers"], load_s=load_s, decode_tok_s=tok_s,
               prefill_s=prefill_s, tokens=args.tokens, rss=rss_bytes(), host_memory_gb=args.host_memory_gb)
    if args.engine == "paged":
        d = model.pagedexperts.stats().as_dict()
        out.update({k: d[k] for k in ("hit_rate", "host_hit_rate", "disk_reads", "disk_bytes_read",
                                      "disk_read_p50_s", "disk_read_p99_s", "bytes_per_token", "disk_tier")})
        out["disk_bytes_per_token"] = d["disk_bytes_read"] / (args.tokens + 4)
        out["host_rows"] = model.pagedexperts.host_memory.host_rows
        out["num_resident"] = model.pagedexperts.num_resident
    return out


def run_child(argv: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, *argv, "--json"], capture_output=True, text=True)
    if res.returncode != 0:
        return {"argv": argv, "error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_all(args) -> None:
    common = ["--tokens", str(args.tokens), "--num-resident", str(args.num_resident)]
    g = str(args.paged_host_memory_gb or args.host_memory_gb)
    runs = [
        ("paged, disk tier", ["decode", args.big, "--engine", "paged", "--host-memory-gb", g, *common]),
        ("paged, disk tier + read-ahead", ["decode", args.big, "--engine", "paged", "--host-memory-gb", g, "--prefetch", *common]),
        ("paged, in RAM (small)", ["decode", args.small, "--engine", "paged", *common]),
        ("accelerate disk offload", ["decode", args.big, "--engine", "accelerate", "--host-memory-gb", str(args.host_memory_gb),
                                     "--offload-folder", args.offload_folder, "--tokens", str(args.accelerate_tokens)]),
    ]
    for label, argv in runs:
        r = run_child(argv)
        print(json.dumps({"run": label, **r}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, required=True)
    for name in ("load", "decode"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--num-resident", type=int, default=16)
        p.add_argument("--json", action="store_true")
    sub.choices["load"].add_argument("--cold", action="store_true")
    sub.choices["load"].add_argument("--repeats", type=int, default=2)
    d = sub.choices["decode"]
    d.add_argument("--engine", choices=["paged", "accelerate"], default="paged")
    d.add_argument("--host-memory-gb", type=float, default=None)
    d.add_argument("--tokens", type=int, default=12)
    d.add_argument("--prefetch", action="store_true")
    d.add_argument("--offload-folder", default="/work/offload")
    a = sub.add_parser("all")
    a.add_argument("big")
    a.add_argument("small")
    a.add_argument("--tokens", type=int, default=12)
    a.add_argument("--accelerate-tokens", type=int, default=3)
    a.add_argument("--num-resident", type=int, default=16)
    a.add_argument("--host-memory-gb", type=float, default=10.0,
                   help="accelerate's max_memory cpu (all its weights in RAM), and the paged G unless given")
    a.add_argument("--paged-host-memory-gb", type=float, default=None,
                   help="G of the paged runs (everything they hold on the host; default: --host-memory-gb)")
    a.add_argument("--offload-folder", default="/work/offload")
    args = ap.parse_args()
    if args.cmd == "make":
        make(args)
    elif args.cmd == "all":
        run_all(args)
    else:
        res = (load if args.cmd == "load" else decode)(args)
        print(json.dumps(res))


if __name__ == "__main__":
    main()
