"""Print the quantized-checkpoints table of issue 29 for the whole-model llm-compressor fixtures
(tests/data/llmc_whole, written by ``scripts/llmc_whole_model.py`` with llm-compressor's default
recipes): tool, recipe, export format, ``check``'s verdict and its reference, and the top-1
agreement of the paged model with the float32 source model.

    .venv/bin/python scripts/checkpoints_table.py [--out docs/checkpoints-table-llmc.md]

Columns:
- tool / recipe: ``llmc_whole_model.json`` beside each fixture (the writer's versions and argv).
- export format: config.json's compressed-tensors ``format`` and the pagedexperts format read.
- check: ``pagedexperts check --check-resident K --max-new-tokens 4`` (one prompt) at the
  checkpoint's own dtype: the verdict and the reference it compared against.
- top-1: the fraction of positions whose argmax of the paged model's logits (K resident slots,
  the checkpoint's dtype) equals the float32 source's, teacher-forced on ``--sequences``
  sequences of ``--length`` seeded random token ids. The source is rebuilt as the writer built
  it (``llmc_whole_model.tiny_config``, seed 0) and verified: its unquantized tensors (embeddings,
  norms, routers), cast to the checkpoint's dtype, must equal the checkpoint's, else "n/a".

``check`` needs a tokenizer; the fixtures have none, so each is linked into a temporary
directory beside tests/data/llmc's 128-token tokenizer (the fixtures' vocab is 256).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "llmc_whole"
TOKENIZER = ROOT / "tests" / "data" / "llmc" / "qwen3_moe-w4a16_mixed"
HEADER = ("| checkpoint | tool | recipe | export format | check (K={k}) | reference | top-1 vs float32 source |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def recipe_of(record: dict) -> str:
    """The writer's argv without its family and output directory: ``--scheme W4A16 ...``."""
    argv, out, skip = record["argv"], [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--family", "--output-dir"):
            skip = True
        else:
            out.append(arg)
    return " ".join(out)


def source_model(path: Path, family: str):
    """The float32 source model of fixture ``path`` (seed 0, ``tiny_config(family)``), or None
    when its unquantized tensors cast to the checkpoint's dtype differ from the checkpoint's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from llmc_whole_model import tiny_config

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    state = source.state_dict()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if k in state and (k.endswith(("embed_tokens.weight", "mlp.gate.weight")) or "norm" in k)]
        stored = {k: f.get_tensor(k) for k in keys}
    same = bool(keys) and all(torch.equal(t, state[k].to(t.dtype)) for k, t in stored.items())
    return source if same else None


@torch.no_grad()
def top1_agreement(model, source, *, sequences: int, length: int, seed: int = 0) -> float:
    """Fraction of teacher-forced positions where argmax(model) == argmax(source)."""
    ids = torch.randint(2, source.config.vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed))
    got = model(input_ids=ids).logits.argmax(-1)
    want = source(input_ids=ids).logits.argmax(-1)
    return (got == want).float().mean().item()


def check_verdict(path: Path, k: int) -> tuple[str, str]:
    """(verdict word, reference source) of ``pagedexperts check`` on ``path`` at its own dtype."""
    from pagedexperts.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        linked = Path(tmp) / path.name
        linked.mkdir()
        for f in [*path.iterdir(), *TOKENIZER.glob("tokenizer*")]:
            (linked / f.name).symlink_to(f)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["check", "--model-path", str(linked), "--check-resident", str(k), "--max-new-tokens", "4",
                       "--prompt", "The city"])
    text = out.getvalue()
    verdict = re.search(r"^verdict: (\w+)", text, re.M)
    reference = re.search(r"^reference: ([\w-]+)", text, re.M)
    return (verdict.group(1) if verdict else f"exit {rc}"), (reference.group(1) if reference else "?")


def row(path: Path, *, k: int, sequences: int, length: int) -> str:
    from pagedexperts import load_model
    from pagedexperts.loading.runtime import runtime_of

    record = json.loads((path / "llmc_whole_model.json").read_text())
    config = json.loads((path / "config.json").read_text())
    family = record["argv"][record["argv"].index("--family") + 1]
    model, _ = load_model(path, num_resident=k)
    fmt = f"{config['quantization_config'].get('format')} ({runtime_of(model).expert_format})"
    verdict, reference = check_verdict(path, k)
    source = source_model(path, family)
    top1 = "n/a" if source is None else f"{top1_agreement(model, source, sequences=sequences, length=length):.3f}"
    tool = f"llm-compressor {record['llmcompressor']} (compressed-tensors {record['compressed_tensors']})"
    recipe = recipe_of(record).replace("|", "\\|")  # a pipe inside a markdown table cell
    return f"| {path.name} | {tool} | `{recipe}` | {fmt} | {verdict} ({config.get('dtype')}) | {reference} | {top1} |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=FIXTURES, help="directory of fixtures (default tests/data/llmc_whole)")
    p.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    p.add_argument("--num-resident", type=int, default=4, help="K for check and the top-1 run (default 4)")
    p.add_argument("--sequences", type=int, default=8, help="random sequences for top-1 (default 8)")
    p.add_argument("--length", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    names = sorted(d.name for d in args.fixtures.iterdir() if (d / "llmc_whole_model.json").exists())
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        p.error(f"--only {unknown}: not a fixture under {args.fixtures}; choose from {names}")
    lines = [HEADER.format(k=args.num_resident)]
    for name in args.only or names:
        lines.append(row(args.fixtures / name, k=args.num_resident, sequences=args.sequences, length=args.length))
        print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
