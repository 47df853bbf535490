"""``pagedexperts generate --speculative``: one request through a ``BatchScheduler`` with speculation
(chunked prefill off), timed like ``generate.generate_text``; sampling draws from a generator seeded
with ``--seed``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from pagedexperts.generation.config import SamplingConfig, check_context
from pagedexperts.generation.generate import GenerationResult, _difference, _totals, build_prompt
from pagedexperts.engine.sampling import SamplingParams
from pagedexperts.engine.scheduler import BatchScheduler
from pagedexperts.engine.scheduler_config import SchedulerConfig
from pagedexperts.engine.speculative.config import SpeculativeConfig


def speculative_generate_text(model, tokenizer, prompt: str, sampling: SamplingConfig,
                              speculative: SpeculativeConfig, *, chat: bool = False,
                              on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate from ``prompt`` with speculative decoding, streaming text to ``on_text``. TTFT: call to
    first new token (s); decode tok/s: (new tokens - 1) / first-to-last token time;
    ``result.speculative``: ``SpeculativeStats.as_dict()`` plus the decode phase's misses and bytes
    per generated token.

    Raises ValueError (bad sampling options, empty prompt, no tokenizer, --chat without a template,
    prompt + --max-new-tokens over the context) or RuntimeError (the model step failed)."""
    sampling.validate()
    if not prompt:
        raise ValueError("empty prompt; give --prompt TEXT or text on stdin")
    if tokenizer is None:
        raise ValueError("the model directory has no tokenizer (tokenizer.json / tokenizer_config.json); add one")
    ids = tokenizer(build_prompt(tokenizer, prompt, chat=chat))["input_ids"]
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    check_context(len(ids), sampling.max_new_tokens, limit)
    limit = limit or len(ids) + sampling.max_new_tokens
    runtime = model.pagedexperts
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(1, limit, chunked_prefill=False), speculative=speculative)
    if isinstance(sampling, SamplingParams):  # generate's serve-style options: what they count, as serve fills them
        sampling = dataclasses.replace(sampling, prompt_ids=tuple(ids) if sampling.repetition_penalty != 1.0 else (),
                                       eos_ids=tuple(sorted(sched.eos_ids)) if sampling.min_tokens else ())
    runtime.reset_stats()
    events = []

    def on_event(event) -> None:
        events.append(event)
        if on_text is not None and event.text:
            on_text(event.text)

    start = time.perf_counter()
    req = sched.submit(ids, sampling, on_event)
    sched.step()  # without chunked prefill: the prefill forward and the first token, no decode yet
    before = _totals(runtime.stats(), times=False)
    while sched.num_running:
        sched.step()
    end = time.perf_counter()
    if events[-1].finish_reason == "error":
        raise RuntimeError(events[-1].error)
    return _result(events, req, sched, runtime, before, start, end, len(ids))


def _result(events: list, req, sched, runtime, before: dict, start: float, end: float, prompt_tokens: int) -> GenerationResult:
    total = _totals(runtime.stats())
    decode = _difference(total, before)
    n = len(req.output_ids)
    first = req.first_token_s or end
    decode_s = req.finished_s - first if n > 1 else 0.0
    spec = sched.speculative.stats.as_dict()
    emitted = max(0, n - 1)  # tokens of the decode phase (the first came from prefill)
    spec.update(misses_per_generated_token=decode["misses"] / emitted if emitted else 0.0,
                bytes_per_generated_token=decode["bytes_paged"] / emitted if emitted else 0.0,
                method=sched.speculative.config.method,
                num_speculative_tokens=sched.speculative.config.num_speculative_tokens)
    return GenerationResult(
        text="".join(e.text for e in events),
        prompt_tokens=prompt_tokens,
        new_tokens=n,
        ttft_s=first - start,
        decode_tok_s=(n - 1) / decode_s if decode_s > 0 else 0.0,
        total_s=end - start,
        paging=runtime.stats().as_dict(),
        prefill=before,
        decode=decode,
        speculative=spec,
        finish_reason=events[-1].finish_reason,
    )
