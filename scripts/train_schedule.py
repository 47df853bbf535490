"""The optimiser and step schedule that both training scripts use (``train_tiny_moe.py``,
``train_draft.py``): AdamW with weight decay on matrices only, linear warmup then cosine decay to
lr / 10, and the step count planned from a wall-clock budget (``--max-minutes``) by timing the
first steps. A helper module of the scripts, not part of the library.
"""

from __future__ import annotations

import math
import time

import torch

WARM_STEPS = 5  # first steps excluded from the --max-minutes step-time calibration


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
