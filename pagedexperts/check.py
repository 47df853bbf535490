"""The accuracy smoke test: paged vs unpaged logits and greedy tokens on a few prompts.

Owns: loading the reference (plain ``AutoModelForCausalLM.from_pretrained``, all experts
resident, the same experts implementation and dtype), running prompts through both, and the
verdict. Does not: page or load the paged model itself (``loader``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedexperts.generate import GREEDY

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "ROMEO:\nBut soft, what light",
    "Question: Natalia sold clips to 48 of her friends in April. How many clips did she sell?\nAnswer:",
    "The history of the city",
)


@dataclass
class PromptCheck:
    """Result of one prompt: max |logit diff| over prefill and every greedy step, tokens equal."""

    prompt: str
    max_abs_diff: float
    tokens_equal: bool
    exact: bool


@dataclass
class CheckResult:
    """All prompts at one K. ``passed``: every prompt's logits torch.equal and tokens equal."""

    num_resident: int
    prompts: list[PromptCheck] = field(default_factory=list)
    misses: int = 0

    @property
    def passed(self) -> bool:
        return all(p.exact and p.tokens_equal for p in self.prompts)

    @property
    def max_abs_diff(self) -> float:
        return max((p.max_abs_diff for p in self.prompts), default=0.0)


def load_reference(model_path, *, device: str, dtype: str | None, experts_implementation: str):
    """The unpaged model: plain from_pretrained, all experts resident (a quantized checkpoint:
    transformers' own dequantized build, the same on CPU and GPU, ``ExpertFormat.reference_kwargs``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedexperts.formats import format_for_config
    from pagedexperts.loader import bundled_model_path, resolve_dtype

    path = model_path or bundled_model_path()
    config = AutoConfig.from_pretrained(path)
    torch_dtype = resolve_dtype(dtype, config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, experts_implementation=experts_implementation,
            **format_for_config(config).reference_kwargs(),  # quantized: transformers' dequantized build
        )
    except ImportError as exc:
        return _resident_reference(path, config, exc, device=device, dtype=dtype,
                                   experts_implementation=experts_implementation)
    return model.to(device).eval()


# Formats whose transformers loader needs GPU kernel packages (gptqmodel + optimum) absent here.
KERNEL_ONLY_FORMATS = ("gptq", "awq")


def _resident_reference(path, config, exc: ImportError, *, device: str, dtype, experts_implementation: str):
    """For GPTQ/AWQ where transformers cannot load (``exc``): the resident model, every expert
    dequantized once by pagedexperts' format (itself tested against the published
    dequantization in tests/test_format_gptq_awq.py). Logs a WARNING: this checks paging, not
    the dequantization. Any other format re-raises ``exc``."""
    from pagedexperts.formats import format_for_config
    from pagedexperts.loader import load_model

    fmt = format_for_config(config)
    if fmt.name not in KERNEL_ONLY_FORMATS:
        raise exc
    logger.warning(
        "transformers cannot load this %s checkpoint here (%s); the unpaged reference is the "
        "resident model with every expert dequantized by pagedexperts' %s format", fmt.name, exc, fmt.name)
    model, _ = load_model(path, mode="resident", device=device, dtype=dtype,
                          experts_implementation=experts_implementation, check_independence=False)
    return model.eval()


def greedy_logits(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decode; returns (new token ids [N], per-step logits [V] for prefill and each step)."""
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        **GREEDY,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, input_ids.shape[1]:], [l[0] for l in out.logits]


def check_model(paged, reference, tokenizer, prompts, *, max_new_tokens: int = 8) -> CheckResult:
    """Compare ``paged`` against ``reference`` on ``prompts`` (greedy, ``max_new_tokens``)."""
    result = CheckResult(num_resident=paged.pagedexperts.num_resident)
    paged.pagedexperts.reset_stats()
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(paged.device)
            tok_p, log_p = greedy_logits(paged, ids, max_new_tokens)
            tok_r, log_r = greedy_logits(reference, ids, max_new_tokens)
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(log_p, log_r)]
            result.prompts.append(
                PromptCheck(
                    prompt=prompt,
                    max_abs_diff=max(diffs),
                    tokens_equal=torch.equal(tok_p, tok_r),
                    exact=all(torch.equal(a, b) for a, b in zip(log_p, log_r)),
                )
            )
    result.misses = paged.pagedexperts.stats().total().misses
    return result
