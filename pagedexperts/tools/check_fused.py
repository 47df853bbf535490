"""``check``'s comparison within a tolerance: a paged model whose kernels are exact only to
themselves (fused, packed) against transformers' own model.

Owns: teacher-forced logits of both models over the same tokens (each prompt, then the float32
source's greedy continuation), max |diff| against a bound per dtype (``LOGIT_TOLERANCE``), and
top-1 agreement with the float32 source (the fused path must agree no less often than
transformers' dequantizing path). Does not: load models (``tools.check_runs``).

Legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.tools.check import greedy_logits

# max |fused - transformers| logits <= this x max |transformers logit|, by the model's dtype:
# float32 accumulation on both sides, one rounding per layer of the dequantized weights'
# products (measured on the bundled model and its w4a16 / fp8-block variants, 6 layers: at most
# 2e-6 in float32; see docs/exactness.md).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class ToleranceCheck:
    """``max_abs_diff`` of the fused logits from transformers', its ``bound``, and the top-1
    agreement with the float32 source of the fused model and of transformers' (fractions of
    positions; None without a source)."""

    max_abs_diff: float
    bound: float
    positions: int
    top1_fused: float | None = None
    top1_reference: float | None = None

    @property
    def passed(self) -> bool:
        top1 = self.top1_fused is None or self.top1_fused >= self.top1_reference
        return self.max_abs_diff <= self.bound and top1


def teacher_forced_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] float32 logits of ``model`` over ``ids`` [B, T] (one forward, no cache)."""
    with torch.no_grad():
        return model(ids.to(model.device), use_cache=False).logits.float().cpu()


def tolerance_check(fused, reference, source, tokenizer, prompts, *, max_new_tokens: int) -> ToleranceCheck:
    """Compare ``fused`` with ``reference`` (transformers' model) on each prompt followed by
    ``max_new_tokens`` greedy tokens of ``source`` (the float32 model; None: of ``reference``),
    teacher-forced; top-1 agreement of each with ``source`` when given."""
    diff, peak, positions, agree_fused, agree_ref = 0.0, 0.0, 0, 0, 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        leader = source if source is not None else reference
        with torch.no_grad():
            new, _ = greedy_logits(leader, ids.to(leader.device), max_new_tokens)
        seq = torch.cat([ids, new.cpu()], dim=1)
        lf, lr = teacher_forced_logits(fused, seq), teacher_forced_logits(reference, seq)
        diff, peak = max(diff, (lf - lr).abs().max().item()), max(peak, lr.abs().max().item())
        positions += seq.shape[1]
        if source is not None:
            top1 = teacher_forced_logits(source, seq).argmax(-1)
            agree_fused += int((lf.argmax(-1) == top1).sum())
            agree_ref += int((lr.argmax(-1) == top1).sum())
    dtype = next(reference.parameters()).dtype
    result = ToleranceCheck(diff, LOGIT_TOLERANCE.get(dtype, 1e-2) * peak, positions)
    if source is not None:
        result.top1_fused, result.top1_reference = agree_fused / positions, agree_ref / positions
    return result


def tolerance_line(k: int, res: ToleranceCheck, *, reference: str, source: str | None, name: str = "fused",
                   reference_name: str = "transformers") -> str:
    """One line per K naming both references: the unpaged model (``reference``, described; its
    short name ``reference_name`` beside its top-1) and the float32 source (``name``: the kernels
    checked, as they ran: fused, packed, or grouped_mm where packed ran nowhere)."""
    line = (f"K={k} vs {reference} (teacher-forced, {res.positions} positions): max |logit diff| "
            f"{res.max_abs_diff:.3g} <= {res.bound:.3g}: {'yes' if res.max_abs_diff <= res.bound else 'NO'}")
    if res.top1_fused is None:
        line += "; top-1 vs a float32 source: not run (no --source-model-path)"
    else:
        line += (f"; top-1 agreement with the float32 source {source}: {name} {res.top1_fused:.1%}, "
                 f"{reference_name} {res.top1_reference:.1%} ({name} no lower: "
                 f"{'yes' if res.top1_fused >= res.top1_reference else 'NO'})")
    return line + f" -> {'PASS (within tolerance)' if res.passed else 'FAIL'}"


@dataclass
class Agreement:
    """Top-1 agreement of a model with a float32 model over ``positions`` teacher-forced positions
    (each prompt, then the float32 model's greedy continuation): ``agree`` of them, and the max
    |logit diff| (reported, not bounded: a routed model's logits move by a flipped expert choice)."""

    agree: int
    positions: int
    max_abs_diff: float

    def rate(self) -> str:
        return f"{self.agree}/{self.positions} ({self.agree / max(self.positions, 1):.1%})"


def top1_agreement(model, float32, tokenizer, prompts, *, max_new_tokens: int) -> Agreement:
    """``Agreement`` of ``model`` with ``float32`` on each prompt followed by ``max_new_tokens``
    greedy tokens of ``float32``, teacher-forced (both see the same tokens at every position)."""
    agree, positions, diff = 0, 0, 0.0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            new, _ = greedy_logits(float32, ids.to(float32.device), max_new_tokens)
        seq = torch.cat([ids, new.cpu()], dim=1)
        ours, theirs = teacher_forced_logits(model, seq), teacher_forced_logits(float32, seq)
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += seq.shape[1]
        diff = max(diff, (ours - theirs).abs().max().item())
    return Agreement(agree, positions, diff)
