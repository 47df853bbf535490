"""Is a quantized checkpoint's PAGED output still the source model? Teacher-forced top-1 agreement.

For each quantized checkpoint dir: run it paged (``load_model``, K slots) and the float source
model (plain ``from_pretrained``, float32) over the same held-out token windows, teacher-forced,
and count the positions where both predict the same next token (argmax of the logits). A
dropped or misapplied scale shows here (about 0.3 on the bundled model) even when ``check``
passes against a reference that is wrong the same way.

    .venv/bin/python bench/quant_agreement.py --text ../shared/data/prompts/wikitext2_test.txt \
        /tmp/q/fp8 /tmp/q/fp8_dynamic [--source pagedexperts/data/tiny-qwen3-moe] [--min 0.8]

Prints one row per checkpoint (format, top-1 agreement, positions, seconds) and exits 1 when
any row is below ``--min``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", help="quantized checkpoint dirs (same tokenizer as --source)")
    p.add_argument("--source", default=None, help="the float source model dir (default: the bundled model)")
    p.add_argument("--text", required=True, help="held-out plain text (e.g. ../shared/data/prompts/wikitext2_test.txt)")
    p.add_argument("--windows", type=int, default=8, help="token windows (default 8)")
    p.add_argument("--window-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--num-resident", type=int, default=None, help="K slots of the paged model (default: load_model's)")
    p.add_argument("--min", type=float, default=0.8, help="exit 1 if any agreement is below this (default 0.8)")
    return p.parse_args(argv)


def token_windows(tokenizer, text_path: str, *, windows: int, window_len: int) -> torch.Tensor:
    """[windows, window_len] token ids: consecutive windows from the start of the text.

    Raises:
        SystemExit: the text has fewer than windows x window_len tokens.
    """
    ids = tokenizer(Path(text_path).read_text(), return_tensors="pt").input_ids[0]
    need = windows * window_len
    if ids.numel() < need:
        sys.exit(f"--text {text_path}: {ids.numel()} tokens < --windows x --window-len = {need}")
    return ids[:need].view(windows, window_len)


@torch.no_grad()
def top1(model, ids: torch.Tensor, batch: int) -> torch.Tensor:
    """Teacher-forced next-token argmax [windows, window_len]."""
    return torch.cat([model(input_ids=ids[i:i + batch]).logits.argmax(-1) for i in range(0, len(ids), batch)])


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedexperts.loading.bundled import bundled_model_path
    from pagedexperts.loading.loader import load_model

    source = args.source or str(bundled_model_path())
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = token_windows(tokenizer, args.text, windows=args.windows, window_len=args.window_len)
    ref = top1(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), ids, args.batch)
    print(f"source {source}: {ids.numel()} positions of {args.text}")
    print(f"{'checkpoint':<40} {'format':<14} {'top-1 agreement':>15} {'seconds':>8}")
    worst = 1.0
    for path in args.checkpoints:
        start = time.perf_counter()
        model, _ = load_model(path, num_resident=args.num_resident)
        got = top1(model.eval(), ids, args.batch)
        agreement = (got == ref).double().mean().item()
        worst = min(worst, agreement)
        fmt = model.pagedexperts.expert_format
        print(f"{path:<40} {fmt:<14} {agreement:>15.3f} {time.perf_counter() - start:>8.1f}")
    return 0 if worst >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
