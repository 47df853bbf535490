"""llama.cpp beside this project on the same weights: CPU ms per decode token and top-1 agreement.

Issue 45 item 5 (issue 38 before it). llama.cpp is npm's prebuilt release (``bench/llama_cpp_prebuilt.py``:
``npm pack`` of node-llama-cpp 3.22.1 = llama.cpp v0.5.0, nothing to build but a small driver);
no test of the quick suite needs it.

Subcommands:

  prepare DIR --workdir W [--types bf16,q4_0] [--cache C]
        DIR (a transformers checkpoint) -> W/model-bf16.gguf by the release's convert_hf_to_gguf.py,
        then W/model-q4_0.gguf (and any other of --types: q8_0, f16) by llama_model_quantize with
        llama-quantize's defaults (Q4_0: output.weight Q6_K where its rows allow); checks that the
        GGUF's vocabulary gives the HF tokenizer's ids on the text
  run DIR --paged LABEL=QDIR [--paged LABEL=QDIR ...] --workdir W [--rounds 3] [--tokens 32]
        one process: plain transformers bf16 on DIR; this project with DEFAULT settings (no experts
        flag unless ``--experts-implementation`` names one) on each QDIR (e.g. w4a16=DIR quantized by ``pagedexperts quantize --format w4a16
        --group-size 128``, model=the ``--scope model`` copy) at K = E and K = E/4
        (``--num-resident``); llama.cpp on each GGUF of ``--gguf`` in W; interleaved rounds (round r
        rotates the order by r); one table

Method. Every side is teacher-forced on the same token ids (``--text`` through DIR's tokenizer;
``prepare`` and ``run`` check that the GGUF's vocabulary gives the same ids): an untimed prefill
of ``--prefill-tokens`` ids, then ``--tokens`` decode steps of one token each, ``--threads``
threads (default 1):
- this project and plain transformers: ``time.process_time`` over the decode steps
  (``bench/real_shape.py``'s ``decode``), after a warm-up pass; every paged K's logits must equal
  the same checkpoint's at the first K (torch.equal), every round;
- llama.cpp: the driver (``bench/llama_cpp_driver.cpp``), one process per round and GGUF, one
  ``llama_decode`` per token: the sum of the decode steps' process CPU time (getrusage, user + sys)
  over the steps; load and prefill are outside the timing, as for ours. Its defaults are
  llama.cpp's (mmap, Q4_0 repacked at load).
Agreement: each side's argmax at every decode step against plain transformers at float32 on DIR
(computed first, then freed; cached in W), "n of N". Ratios are per round; every number is a
median with its [min-max] spread over rounds.

Memory: the float32 reference alone first, in a child process (4 bytes a weight, cached in W
after), then plain bf16 + each paged copy (its host store and K = E slots, dense where the
default dequantizes) + one llama.cpp process at a time (see docs/benchmarks.md for the peaks).
On a shared machine run it under ``flock /work/notes/bigmem.lock``.

Usage (the 4-layer Qwen3-30B-A3B-shaped checkpoint of bench/real_shape.py):
  python bench/real_shape.py make /work/ckpts/real4 --layers 4
  pagedexperts quantize --model-path /work/ckpts/real4 --format w4a16 --group-size 128 --output /work/ckpts/real4-w4a16
  python bench/llama_cpp_peer.py prepare /work/ckpts/real4 --workdir /work/ckpts/real4-gguf
  python bench/llama_cpp_peer.py run /work/ckpts/real4 --paged w4a16=/work/ckpts/real4-w4a16 --workdir /work/ckpts/real4-gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shape  # noqa: E402  (bench/ is not a package)
from llama_cpp_prebuilt import DEFAULT_CACHE, Prebuilt, setup  # noqa: E402
from real_shape_tables import med  # noqa: E402

SHARED_TEXT = Path("/work/shared/data/corpus/wikitext2_valid.txt")


@dataclass(frozen=True)
class Side:
    """One row of the table: ``kind`` "plain", "paged" (``label`` at ``num_resident``) or "llama"
    (the GGUF ``gguf``)."""

    name: str
    kind: str
    label: str = ""
    num_resident: int = 0
    gguf: Path | None = None


def read_text(path: Path | None) -> str:
    """The teacher-forced text: ``path``, else the shared corpus, else real_shape's built-in text."""
    for p in (path, real_shape.CORPUS, SHARED_TEXT):
        if p is not None and Path(p).exists():
            return Path(p).read_text()[:60000]
    return real_shape.FALLBACK_TEXT


def check_ids(pb: Prebuilt, gguf: Path, text: str, hf_ids: list[int], workdir: Path, n: int) -> None:
    """The GGUF vocabulary's first ``n`` ids of ``text`` equal the HF tokenizer's (SystemExit naming
    the first difference otherwise): the same ids mean the same rows of the same embedding."""
    text_file = workdir / "text.txt"
    text_file.write_text(text)
    ll = pb.tokenize(gguf, text_file)[:n]
    if ll != hf_ids[:n]:
        i = next((i for i, (a, b) in enumerate(zip(ll, hf_ids)) if a != b), min(len(ll), len(hf_ids)))
        raise SystemExit(f"{gguf}: its vocabulary tokenizes the text differently from the HF tokenizer at id {i} "
                         f"(llama.cpp {ll[i:i + 5]}, HF {hf_ids[i:i + 5]}): the sides would not see the same tokens")


def prepare(args) -> None:
    """DIR -> W/model-bf16.gguf (converter) -> W/model-{type}.gguf (llama_model_quantize)."""
    from transformers import AutoTokenizer

    pb = setup(args.cache)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "model-bf16.gguf"
    if not bf16.exists():
        t0 = time.perf_counter()
        pb.convert(Path(args.dir), bf16, "bf16", python=args.python)
        print(f"converted {args.dir} -> {bf16} in {time.perf_counter() - t0:.0f} s", flush=True)
    for kind in args.types:
        out = work / f"model-{kind}.gguf"
        if kind != "bf16" and not out.exists():
            pb.quantize(bf16, out, kind.upper(), threads=args.threads)
    text = read_text(args.text)
    ids = AutoTokenizer.from_pretrained(args.dir)(text)["input_ids"]
    check_ids(pb, bf16, text, ids, work, len(ids))
    print(f"llama.cpp {pb.release} ({pb.lib_dir}): the GGUF vocabulary gives the HF tokenizer's {len(ids)} ids of the text")
    for f in sorted(work.glob("*.gguf")):
        print(f"{f}: {f.stat().st_size / 1e9:.3f} GB; {tensor_types(pb, f)}")


def tensor_types(pb: Prebuilt, gguf: Path) -> str:
    """Which GGML type each kind of tensor of ``gguf`` has ("attn_q Q4_0, ..., output.weight Q6_K"),
    read with the release's gguf-py."""
    sys.path.insert(0, str(pb.src_dir / "gguf-py"))
    try:
        import gguf as gguf_py

        kinds = {}
        for t in gguf_py.GGUFReader(gguf).tensors:
            kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name
            kinds.setdefault(kind, set()).add(t.tensor_type.name)
    finally:
        sys.path.remove(str(pb.src_dir / "gguf-py"))
    return ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(kinds.items()))


def float32_reference(path: Path, ids: torch.Tensor, prefill: int, workdir: Path) -> dict:
    """Argmax of plain transformers at float32 on ``path`` at each decode step (teacher-forced
    ``ids``; step i feeds ids[prefill + i]), computed in a child process (its 4 bytes a weight are
    freed before the timed sides load) and cached in ``workdir`` by checkpoint and ids:
    {"argmax": [...], "peak_rss_gb": the child's}."""
    key = hashlib.sha256(f"{path.resolve()}:{ids.tolist()}:{prefill}".encode()).hexdigest()[:16]
    cache = workdir / f"float32-argmax-{key}.json"
    if not cache.exists():
        ids_file = workdir / f"float32-ids-{key}.txt"
        ids_file.write_text(" ".join(map(str, ids[0].tolist())))
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "reference", str(path), str(ids_file),
                        str(prefill), str(cache)], check=True)
    return json.loads(cache.read_text())


@torch.inference_mode()
def reference_child(args) -> None:
    """``reference``: the float32 argmax of ``float32_reference``, written to ``args.out``."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    ids = torch.tensor([[int(x) for x in Path(args.ids_file).read_text().split()]])
    # the checkpoint's own dtype, then upcast tensor by tensor (exact): loading at float32 directly
    # peaked at 2x the float32 model (20 GB for the 4-layer real-shape checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype="auto", experts_implementation="grouped_mm").eval().float()
    top = real_shape.decode(model, ids, args.prefill)[1].argmax(-1).tolist()
    Path(args.out).write_text(json.dumps(dict(argmax=top, peak_rss_gb=peak_rss_gb())))


def peak_rss_gb() -> float:
    """This process image's peak RSS (VmHWM; ru_maxrss of a child carries its parent's peak)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1e6


def stream_gbps(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """GB/s (1e9) of one thread copying ``n_bytes`` (past the caches), median of ``repeats``: a
    shared machine's memory bandwidth at the time, which a memory-bound decode (llama.cpp's Q4_0)
    follows more than a compute-bound one."""
    src, dst = torch.ones(n_bytes // 2, dtype=torch.bfloat16), torch.empty(n_bytes // 2, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return n_bytes / statistics.median(times) / 1e9


def parse_paged(values: list[str]) -> dict[str, Path]:
    """``LABEL=DIR`` flags -> {label: dir}; SystemExit naming a malformed one or a missing dir."""
    out = {}
    for v in values:
        label, sep, d = v.partition("=")
        if not sep or not label or not Path(d).is_dir():
            raise SystemExit(f"--paged {v}: expected LABEL=DIR with DIR a checkpoint directory")
        out[label] = Path(d)
    return out


def sides_of(args, num_experts: int, paged: dict[str, Path], work: Path) -> list[Side]:
    """The table's rows, in order: plain, each paged label at each K, each GGUF."""
    ks = args.num_resident or [num_experts, num_experts // 4]
    sides = [Side("plain transformers, bf16", "plain")]
    settings = f"--experts-implementation {args.experts_implementation}" if args.experts_implementation else "default"
    sides += [Side(f"pagedexperts {label}, {settings}, K={k}", "paged", label, k) for label in paged for k in ks]
    for kind in args.gguf:
        gguf = work / f"model-{kind}.gguf"
        if not gguf.exists():
            raise SystemExit(f"{gguf} not found: run `prepare` with --types including {kind}, or leave it out of --gguf")
        sides.append(Side(f"llama.cpp {kind.upper()}", "llama", gguf=gguf))
    return sides


@torch.inference_mode()
def run(args) -> dict:
    """Per side the CPU seconds per decode token of each round and its argmax per step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pagedexperts
    from pagedexperts.loading.runners import repage

    torch.set_num_threads(args.threads)
    pb, work, paged_dirs = setup(args.cache), Path(args.workdir), parse_paged(args.paged)
    text = read_text(args.text)
    n = args.prefill_tokens + args.tokens
    all_ids = AutoTokenizer.from_pretrained(args.dir)(text)["input_ids"]
    if len(all_ids) < n:
        raise SystemExit(f"the text gives {len(all_ids)} tokens, fewer than --prefill-tokens + --tokens = {n}")
    ids = torch.tensor([all_ids[:n]])
    reference = float32_reference(Path(args.dir), ids, args.prefill_tokens, work)
    ref = reference["argmax"]
    machine = dict(load_average_start=os.getloadavg()[0], stream_gbps_start=stream_gbps())
    plain = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    sides = sides_of(args, plain.config.num_experts, paged_dirs, work)
    k_max = max((s.num_resident for s in sides), default=0)  # loaded at the largest K, repaged to each
    options = dict(experts_implementation=args.experts_implementation) if args.experts_implementation else {}
    models = {label: pagedexperts.load_model(d, num_resident=k_max, **options)[0] for label, d in paged_dirs.items()}
    for s in sides:
        if s.kind == "llama":
            check_ids(pb, s.gguf, text, all_ids, work, n)
    implementations = {label: dict(experts_implementation=m.pagedexperts.resolved.experts_implementation,
                                   slot_format=m.pagedexperts.resolved.slot_format, expert_format=m.pagedexperts.expert_format)
                       for label, m in models.items()}
    first_k = {}  # label -> logits at its first K, the exactness reference of the others
    times = {s.name: [] for s in sides}
    top1 = {}
    llama_info = {}
    for s in sides:  # warm-up: each side once, untimed (page cache, slots, allocator)
        measure(s, plain, models, ids, args, pb, repage, first_k, top1, llama_info)
    for r in range(args.rounds):
        for s in sides[r % len(sides):] + sides[: r % len(sides)]:
            times[s.name].append(measure(s, plain, models, ids, args, pb, repage, first_k, top1, llama_info))
            print(f"round {r + 1} {s.name}: {times[s.name][-1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    agree = {name: sum(a == b for a, b in zip(t, ref)) for name, t in top1.items()}
    machine.update(load_average_end=os.getloadavg()[0], stream_gbps_end=stream_gbps(), peak_rss_gb=peak_rss_gb(),
                   float32_reference_peak_rss_gb=reference.get("peak_rss_gb"))
    return dict(times=times, agree=agree, n_steps=len(ref), implementations=implementations, llama=llama_info, machine=machine,
                threads=args.threads, rounds=args.rounds, tokens=args.tokens, prefill=args.prefill_tokens,
                layers=plain.config.num_hidden_layers, num_experts=plain.config.num_experts, release=pb.release,
                gguf_gb={s.name: s.gguf.stat().st_size / 1e9 for s in sides if s.gguf})


def measure(s: Side, plain, models, ids, args, pb: Prebuilt, repage, first_k, top1, llama_info) -> float:
    """One side once: CPU s per decode token; its argmax per step into ``top1`` (a side whose
    argmax changes between passes fails the bench: not deterministic)."""
    if s.kind == "llama":
        res = pb.run(s.gguf, ids[0].tolist(), args.prefill_tokens, args.tokens, threads=args.threads)
        llama_info[s.name] = {k: res[k] for k in ("cpu_backend", "buffers", "peak_rss_kb", "decode_read_bytes", "llama_version")}
        t, top = sum(res["cpu_s"]) / args.tokens, res["argmax"]
    elif s.kind == "plain":
        t, logits = real_shape.decode(plain, ids, args.prefill_tokens)
        top = logits.argmax(-1).tolist()
    else:
        model = models[s.label]
        repage(model, num_resident=s.num_resident)
        t, logits = real_shape.decode(model, ids, args.prefill_tokens)
        ref = first_k.setdefault(s.label, logits)
        if not torch.equal(logits, ref):
            raise SystemExit(f"{s.name}: logits differ from {s.label} at its first K (paged != all-resident: not exact)")
        top = logits.argmax(-1).tolist()
    if top1.setdefault(s.name, top) != top:
        raise SystemExit(f"{s.name}: argmax differs between passes on the same ids")
    return t


def table(res: dict) -> str:
    """Markdown: per side CPU ms / token, ratios to llama.cpp Q4_0 and to plain bf16 (per round),
    top-1 agreement with float32."""
    times, n = res["times"], res["n_steps"]
    base, plain = times.get("llama.cpp Q4_0"), times["plain transformers, bf16"]
    impl = "; ".join(f"{label}: {d['expert_format']} experts, {d['experts_implementation']}, "
                     + ("slots in torch's CPU kernel layout" if d["experts_implementation"] == "packed"
                        else f"{d['slot_format']} slots")
                     for label, d in res["implementations"].items())
    backend = next((Path(d["cpu_backend"]).name for d in res["llama"].values()), "")
    lines = [f"{res['layers']} layers, {res['num_experts']} experts, {res['threads']} thread(s), {res['rounds']} interleaved rounds, "
             f"{res['tokens']} teacher-forced decode tokens after a {res['prefill']}-token prefill; llama.cpp {res['release']} "
             f"({backend}); this project's defaults resolved to: {impl}",
             f"| side | CPU ms / token | ratio to llama.cpp Q4_0 | ratio to plain bf16 | top-1 = float32, of {n} |",
             "|---|---|---|---|---|"]
    for name, ts in times.items():
        vs_q4 = med([t / b for t, b in zip(ts, base)]) if base else ""
        vs_plain = med([t / p for t, p in zip(ts, plain)])
        lines.append(f"| {name} | {med([t * 1e3 for t in ts])} | {vs_q4} | {vs_plain} | {res['agree'][name]} of {n} |")
    m = res["machine"]
    lines.append(f"load average {m['load_average_start']:.1f} -> {m['load_average_end']:.1f}, one thread's copy bandwidth "
                 f"{m['stream_gbps_start']:.1f} -> {m['stream_gbps_end']:.1f} GB/s; peak RSS: this process {m['peak_rss_gb']:.1f} GB, "
                 f"the float32 reference's {m['float32_reference_peak_rss_gb'] or 0:.1f} GB")
    for name, d in res["llama"].items():
        weights = "; ".join(b.split(":", 1)[1].strip() for b in d["buffers"] if "model buffer" in b)
        lines.append(f"{name} ({res['gguf_gb'][name]:.2f} GB): {weights}; peak RSS {d['peak_rss_kb'] / 1e6:.2f} GB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    csv = lambda s: s.split(",")  # noqa: E731
    p = sub.add_parser("prepare", help="convert to BF16 GGUF, quantize to Q4_0 (llama.cpp's own tools, prebuilt)")
    p.add_argument("dir")
    p.add_argument("--workdir", required=True, help="where the GGUF files go")
    p.add_argument("--types", type=csv, default=["bf16", "q4_0"], help="GGUF types (bf16 always; q4_0, q8_0, f16)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the converter (torch, numpy, safetensors)")
    r = sub.add_parser("run", help="interleaved rounds: plain bf16, ours by default, llama.cpp")
    r.add_argument("dir", help="the unquantized checkpoint (plain transformers, the float32 reference, the GGUFs' source)")
    r.add_argument("--paged", action="append", default=[], metavar="LABEL=QDIR",
                   help="a checkpoint this project loads with default settings (repeatable), e.g. w4a16=DIR-w4a16")
    r.add_argument("--workdir", required=True, help="holds model-{bf16,q4_0}.gguf (prepare)")
    r.add_argument("--experts-implementation", default=None,
                   help="passed to load_model for every --paged checkpoint (default: none, load_model's own default)")
    r.add_argument("--num-resident", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="K values (default: E and E/4)")
    r.add_argument("--gguf", type=csv, default=["q4_0", "bf16"], help="GGUF types in W to run (default q4_0,bf16)")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--tokens", type=int, default=32, help="timed decode tokens per round and side")
    r.add_argument("--prefill-tokens", type=int, default=128)
    r.add_argument("--json", action="store_true")
    for q in (p, r):
        q.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"the prebuilt llama.cpp (default {DEFAULT_CACHE})")
        q.add_argument("--threads", type=int, default=1)
        q.add_argument("--text", type=Path, default=None,
                       help="text file (default: ../shared/data/corpus/tinyshakespeare.txt, else wikitext2_valid.txt, else a built-in text)")
    c = sub.add_parser("reference", help=argparse.SUPPRESS)  # run's float32 child (float32_reference)
    for name in ("dir", "ids_file", "prefill", "out"):
        c.add_argument(name, type=int if name == "prefill" else str)
    c.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cmd == "reference":
        reference_child(args)
        return
    if args.cmd == "prepare":
        prepare(args)
        return
    res = run(args)
    print(json.dumps(res) if args.json else table(res))


if __name__ == "__main__":
    main()
