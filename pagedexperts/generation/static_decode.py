"""The decode loop over a static KV cache: eager prefill, then each step by ``DecodeGraphs``.

Owns: ``static_generate``, the loop ``generation.generate`` runs with decode graphs on: prefill
eagerly into the batch size's static cache, then per new token choose it from the last logits
(greedy, or transformers' temperature / top-p warpers and ``torch.multinomial``; the caller's
logits processor first), stream it, stop at EOS or a stop string, and run the next step through
``DecodeGraphs.decode``; finished rows padded with the pad token. Greedy tokens equal
transformers' ``generate`` (docs/cuda-graphs.md). Does not: capture (``graphs``), load or page.

Legend: B batch, L prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeOptions:
    """max_new_tokens N >= 1; temperature 0 = greedy; top_p in (0, 1]; ignore_eos: always N
    tokens (benchmarks); stop_strings with their tokenizer, counted from the (min_tokens + 1)-th
    token on (serve's min_tokens); pad_token_id for finished rows;
    logits_processor: (ids [B, t], logits [B, V]) -> the scores to choose from, in place of the
    temperature and top-p warpers (``generate.generate_text``)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    tokenizer: object = None
    pad_token_id: int | None = None
    logits_processor: object = None
    min_tokens: int = 0


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _chooser(opts: DecodeOptions):
    """(ids [B, t], logits [B, V]) -> next ids [B] int64, as ``generate`` chooses them."""
    if opts.logits_processor is not None:
        def choose_processed(ids, logits):
            scores = opts.logits_processor(ids, logits.float())
            if opts.temperature <= 0:
                return torch.argmax(scores, dim=-1)
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)

        return choose_processed
    if opts.temperature <= 0:
        return lambda ids, logits: torch.argmax(logits.float(), dim=-1)
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(opts.temperature)]
    if opts.top_p < 1.0:
        warpers.append(TopPLogitsWarper(opts.top_p))

    def choose(ids, logits):
        scores = logits.float()
        for w in warpers:
            scores = w(ids, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    return choose


def static_generate(model, graphs, input_ids: torch.Tensor, attention_mask: torch.Tensor, opts: DecodeOptions,
                    *, streamer=None) -> torch.Tensor:
    """Generate up to N tokens after ``input_ids`` [B, L] (2-D ``attention_mask`` [B, L]) with
    decode steps through ``graphs`` (``graphs.DecodeGraphs``); returns ids [B, L + n], n <= N.

    Raises:
        ValueError: N < 1, or a ``--cuda-graphs`` step that cannot be captured (``graphs``).
    """
    if opts.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be > 0, got {opts.max_new_tokens}")
    b, length = input_ids.shape
    st = graphs.step_for(b, length + opts.max_new_tokens)
    choose, eos = _chooser(opts), _eos_ids(model)
    stop = None
    if opts.stop_strings:
        from transformers.generation.stopping_criteria import StopStringCriteria

        stop = StopStringCriteria(tokenizer=opts.tokenizer, stop_strings=list(opts.stop_strings))
    unfinished = torch.ones(b, dtype=torch.bool, device=input_ids.device)
    ids = input_ids
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with torch.no_grad():
        logits = st.prefill(input_ids, attention_mask)  # eager, before the decode switch (as generate)
    with torch.no_grad(), _decode_switch(model):
        for i in range(opts.max_new_tokens):
            nxt = choose(ids, logits)
            if opts.pad_token_id is not None:
                nxt = torch.where(unfinished, nxt, opts.pad_token_id)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if streamer is not None:
                streamer.put(nxt.cpu())
            if not opts.ignore_eos:
                unfinished &= ~_finished(nxt, eos, ids, logits, stop if i + 1 > opts.min_tokens else None)
                if not bool(unfinished.any()):
                    break
            if i + 1 < opts.max_new_tokens:
                logits = graphs.decode(st, nxt, length + i)
    if streamer is not None:
        streamer.end()
    return ids


def _finished(nxt, eos: list[int], ids, logits, stop) -> torch.Tensor:
    done = torch.zeros_like(nxt, dtype=torch.bool)
    for e in eos:
        done |= nxt == e
    if stop is not None:
        done |= stop(ids, logits).to(done.device)
    return done


def _decode_switch(model):
    """transformers' own decode-time experts switch (grouped_mm -> batched_mm off CPU, 5.17+),
    so the static decode runs the kernel ``generate``'s decode runs; nothing where absent."""
    import contextlib

    switch = getattr(model, "_optimize_model_for_decode", None)
    return switch() if switch is not None else contextlib.nullcontext()
