"""The accuracy smoke test: paged vs unpaged logits and greedy tokens on a few prompts.

Owns: loading the reference (all experts resident, the same implementation and dtype, as
``tools.reference.choose_reference`` rules) and comparing prompts through both, one by one and
as a left-padded batch (``check_model``). Does not: load the paged model or print verdicts
(``tools.check_runs``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pagedexperts.generation.config import GREEDY

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "ROMEO:\nBut soft, what light",
    "Question: Natalia sold clips to 48 of her friends in April. How many clips did she sell?\nAnswer:",
    "The history of the city",
)


@dataclass
class PromptCheck:
    """Result of one run (a prompt, or the batch of all prompts): max |logit diff| over prefill
    and every greedy step, logits torch.equal at every step, greedy tokens equal."""

    prompt: str
    max_abs_diff: float
    tokens_equal: bool
    exact: bool


@dataclass
class CheckResult:
    """All runs at one K. ``passed``: every run's logits torch.equal and tokens equal."""

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
    """The unpaged model all experts resident, as ``load_reference_with_choice`` picks it."""
    return load_reference_with_choice(model_path, device=device, dtype=dtype,
                                      experts_implementation=experts_implementation)[0]


def load_reference_with_choice(model_path, *, device: str, dtype: str | None, experts_implementation: str):
    """The unpaged model (all experts resident, the same dtype and experts implementation) and the
    ``tools.reference.ReferenceChoice`` saying which it is and why (``choose_reference``).

    Raises:
        ValueError / ImportError: see ``choose_reference``; a format refused (``format_for_config``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedexperts.formats import quantization_config_of
    from pagedexperts.loading.checkpoint import format_for_checkpoint, shipped_conversion_table
    from pagedexperts.loading.config import resolve_dtype
    from pagedexperts.loading.linears import quantized_modules
    from pagedexperts.loading.bundled import bundled_model_path
    from pagedexperts.models.config import with_modelopt_quantization
    from pagedexperts.storage.safetensors_files import checkpoint_files
    from pagedexperts.tools.reference import (RESIDENT, ReferenceLoaders, choose_reference, compare_with_format,
                                              complete, with_experts_in)

    path = model_path or bundled_model_path()
    config = with_modelopt_quantization(AutoConfig.from_pretrained(path), path)
    files = checkpoint_files(path)
    fmt = format_for_checkpoint(config, files)
    torch_dtype = resolve_dtype(dtype, config)
    kwargs = dict(dtype=torch_dtype, experts_implementation=experts_implementation, output_loading_info=True)
    qc = quantization_config_of(config)
    held: dict[str, list[logging.LogRecord]] = {"transformers": [], "library": []}
    loaders = ReferenceLoaders(
        transformers=lambda p: _held(held["transformers"], _quiet_load, p, **kwargs, **fmt.reference_kwargs()),
        dense=lambda p: _held(held["library"], lambda: with_experts_in(
            complete(AutoModelForCausalLM.from_pretrained(p, **kwargs), p), fmt.experts_dtype(torch_dtype),
            lambda d: complete(AutoModelForCausalLM.from_pretrained(p, **{**kwargs, "dtype": d}), p))),
        resident=lambda: _resident_reference(path, device=device, dtype=dtype,
                                             experts_implementation=experts_implementation),
        sample=lambda model: compare_with_format(model, files, fmt),
        format_name=fmt.name,
    )
    with shipped_conversion_table(config.model_type):  # transformers as it ships, whatever else patched it
        model, choice = choose_reference(path, qc, loaders, list(quantized_modules(files, fmt, qc)))
    chosen = {"transformers": "transformers", RESIDENT: None}.get(choice.source, "library")
    for record in held.get(chosen, []) if chosen else ():  # the logs of the load that is the reference
        logging.getLogger(record.name).handle(record)
    return model.to(device).eval(), choice


TRANSFORMERS_LOGGER = "transformers"


def _held(into: list, load, *args, **kwargs):
    """``load(*args, **kwargs)`` with transformers' log records kept in ``into`` instead of written:
    a candidate reference that is refused (its load report, its conversion tracebacks) is said
    in one line by ``tools.reference.choose_reference``; the chosen one's records are written
    after the choice."""
    target = logging.getLogger(TRANSFORMERS_LOGGER)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record)

    saved = target.handlers[:], target.propagate
    target.handlers, target.propagate = [Keep()], False
    try:
        return load(*args, **kwargs)
    except Exception as exc:  # its message points at the report held back: it names the report's errors instead
        errors = _report_errors(into)
        if errors and len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0].split(' For details look at')[0]} ({'; '.join(errors)})",)
        raise
    finally:
        target.handlers, target.propagate = saved


_REPORT_ERROR = re.compile(r"^\s*((?:\w+)?Error: .+)$", re.M)


def _report_errors(records: list[logging.LogRecord], most: int = 2) -> list[str]:
    """The first distinct error lines of transformers' held load report (a conversion's exception,
    the tensor it was destined for)."""
    found = dict.fromkeys(m.group(1).strip() for r in records for m in _REPORT_ERROR.finditer(r.getMessage()))
    return list(found)[:most]


def reference_label(choice, *, quantized: bool) -> str:
    """The unpaged reference of ``choice`` (``tools.reference.ReferenceChoice``) as it computes:
    its source and what its grouped_mm runs over (its own experts, or experts dequantized by
    transformers, by the format's library, or by pagedexperts)."""
    from pagedexperts.tools.reference import RESIDENT

    if not quantized:
        return f"{choice.source} (grouped_mm over its experts)"
    by = "pagedexperts" if choice.source == RESIDENT else choice.source
    return f"{choice.source} (grouped_mm over experts dequantized by {by})"


def transformers_model(path, **kwargs):
    """transformers' ``from_pretrained(path, **kwargs)`` as pagedexperts compares with it (check's
    float32 source, bench's plain model, the tests' oracles): on its local path (the checkpoint
    format's ``reference_kwargs``: gpt-oss MXFP4 dequantized by transformers' own code, never its
    Triton kernels fetched from the Hub through the ``kernels`` package, so no network is needed;
    ``kwargs`` override them), and with its conversion table as it ships
    (``loading.checkpoint.shipped_conversion_table``): a model another library's patch does not change."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedexperts.loading.checkpoint import format_for_checkpoint, shipped_conversion_table
    from pagedexperts.storage.safetensors_files import checkpoint_files

    config = AutoConfig.from_pretrained(path)
    local = format_for_checkpoint(config, checkpoint_files(path)).reference_kwargs()
    with shipped_conversion_table(config.model_type):
        return AutoModelForCausalLM.from_pretrained(path, **{**local, **kwargs})


def _quiet_load(path, **kwargs):
    """transformers' ``from_pretrained`` of ``path`` with compressed-tensors' spurious "Could not
    match" WARNINGs for targets that name modules of the checkpoint dropped
    (``fused_expert_targets_quiet``)."""
    from transformers import AutoModelForCausalLM

    with fused_expert_targets_quiet(path):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


class _CheckpointModuleTargets(logging.Filter):
    """Drops compressed-tensors' "Could not match `T` in instance of ..." WARNING where the modules T
    names are there: per-expert modules transformers 5 fuses into stacked tensors
    (``expert_modules``), and modules a class target listed before T also matches
    (``claimed_after``: lm_head after ``Linear`` in ``quantize --scope model``'s config). Any other
    target still warns.
    """

    def __init__(self, expert_modules: list[str], modules: list[str], claimed_after: set[str]) -> None:
        super().__init__()
        self.expert_modules, self.modules, self.claimed_after = expert_modules, modules, claimed_after

    def filter(self, record: logging.LogRecord) -> bool:
        from compressed_tensors.utils.match import match_name

        found = re.match(r"Could not match `(.+)` in instance of ", record.getMessage())
        if found is None:
            return True
        target = found.group(1)
        if any(match_name(name, target) for name in self.expert_modules):
            return False
        return not (target in self.claimed_after and any(match_name(name, target) for name in self.modules))


@contextlib.contextmanager
def fused_expert_targets_quiet(path):
    """While transformers loads checkpoint ``path``: compressed-tensors' spurious "Could not match"
    WARNINGs (``_CheckpointModuleTargets``) are dropped, nothing else."""
    import json

    from pagedexperts.storage.safetensors_files import checkpoint_files, read_header_json

    modules = sorted({key.rpartition(".")[0] for f in checkpoint_files(path) for key in read_header_json(f)[0]})
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    targets = [t for group in (qc.get("config_groups") or {}).values() if isinstance(group, dict)
               for t in group.get("targets", [])]
    first_class = next((i for i, t in enumerate(targets) if not t.startswith("re:") and t not in modules), len(targets))
    quiet = _CheckpointModuleTargets([m for m in modules if _PER_EXPERT_MODULE.search(m)], modules,
                                     set(targets[first_class + 1:]))
    target = logging.getLogger("compressed_tensors.utils.match")
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


_PER_EXPERT_MODULE = re.compile(r"\.experts\.\d+\.[^.]+$")  # experts.{j}.{proj}


def _resident_reference(path, *, device: str, dtype, experts_implementation: str):
    """The resident model: every expert dequantized once by pagedexperts' format (tested against
    the published dequantizations in tests/formats/), contiguous as the paged model's kernel
    receives them (``paging.baselines.ResidentRunner``)."""
    from pagedexperts.loading.loader import load_model

    model, _ = load_model(path, mode="resident", device=device, dtype=dtype,
                          experts_implementation=experts_implementation, check_independence=False)
    return model.eval()


class _FirstTimeOnly(logging.Filter):
    """Passes a record only the first time its logger, level and message are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextlib.contextmanager
def each_message_once():
    """While ``check`` loads the same checkpoint several times (the reference, all E resident,
    each K): a log line identical to one already written is dropped (one fact, one line), at
    every handler of the root logger."""
    filters = {handler: _FirstTimeOnly() for handler in logging.getLogger().handlers}  # each handler its own
    for handler, once in filters.items():
        handler.addFilter(once)
    try:
        yield
    finally:
        for handler, once in filters.items():
            handler.removeFilter(once)


def greedy_logits(model, input_ids: torch.Tensor, max_new_tokens: int, attention_mask=None):
    """Greedy decode of ``input_ids`` [B, T]; returns (new token ids [B, N], per-step logits
    [B, V] for prefill and each step)."""
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        **GREEDY,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[:, input_ids.shape[1]:], list(out.logits)


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows [T_i] -> (input_ids, attention_mask) [B, max T_i], left-padded as batched
    ``generate`` expects."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        mask[i, width - r.numel():] = 1
    return ids, mask


def compare(paged, reference, input_ids, max_new_tokens: int, what: str, attention_mask=None) -> PromptCheck:
    """One greedy run of both models: max |logit diff| over every step, torch.equal, tokens."""
    tok_p, log_p = greedy_logits(paged, input_ids, max_new_tokens, attention_mask)
    tok_r, log_r = greedy_logits(reference, input_ids, max_new_tokens, attention_mask)
    return PromptCheck(
        prompt=what,
        max_abs_diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(log_p, log_r)),
        tokens_equal=torch.equal(tok_p, tok_r),
        exact=all(torch.equal(a, b) for a, b in zip(log_p, log_r)),
    )


def check_model(paged, reference, tokenizer, prompts, *, max_new_tokens: int = 8, batched: bool = True,
                progress: bool = False) -> CheckResult:
    """Compare ``paged`` against ``reference`` on each of ``prompts`` alone (batch 1) and, if
    ``batched`` and there are several, on all of them at once (left-padded, batch B > 1: another
    matmul path for the last-token slice), greedy for ``max_new_tokens`` steps. ``progress``: a
    tqdm bar of the runs on stderr when it is a terminal (as ``bench``)."""
    result = CheckResult(num_resident=paged.pagedexperts.num_resident)
    paged.pagedexperts.reset_stats()
    rows = [tokenizer(p, return_tensors="pt")["input_ids"][0].to(paged.device) for p in prompts]
    runs = len(rows) + (1 if batched and len(rows) > 1 else 0)
    bar = tqdm(total=runs, desc=f"check K={result.num_resident}", unit="run", leave=False,
               disable=None if progress else True)  # None: tqdm's rule, a bar only on a terminal
    with torch.no_grad(), bar:
        for prompt, ids in zip(prompts, rows):
            result.prompts.append(compare(paged, reference, ids.unsqueeze(0), max_new_tokens, prompt))
            bar.update()
        if batched and len(rows) > 1:
            ids, mask = left_padded(rows)
            what = f"all {len(rows)} prompts as one left-padded batch"
            result.prompts.append(compare(paged, reference, ids, max_new_tokens, what, mask))
            bar.update()
    result.misses = paged.pagedexperts.stats().total().misses
    return result
