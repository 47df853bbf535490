"""Timed generation for the benchmarks: one greedy generate, clocked at each new token.

Owns ``timed_generate`` (a batch greedy-generates exactly N new tokens; the wall and CPU time
each arrived, its ``Timeline``) and ``long_prompts`` (prompts of about N tokens, made by joining
short ones). Does not: choose modes, rounds or what to report from the clocks (``tools.bench``).

Units: seconds (wall from ``time.perf_counter``, CPU from ``time.process_time``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedexperts.generation.config import GREEDY


def long_prompts(tokenizer, prompts: list[str], tokens: int, count: int) -> list[str]:
    """``count`` prompts of about ``tokens`` tokens each, made by joining consecutive prompts."""
    out, i = [], 0
    pool = prompts * (1 + tokens)  # enough text to fill
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer(pool[i % len(pool)] + "\n")["input_ids"]
            i += 1
        out.append(tokenizer.decode(ids[:tokens]))
    return out


@dataclass
class Timeline:
    """Clock readings of one generate: ``start`` (wall, s) and, per new token, the wall
    (``perf_counter``) and CPU (``process_time``) time it arrived."""

    start: float
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def timed_generate(model, tokenizer, prompts: list[str], new_tokens: int, on_first_token=None) -> Timeline:
    """Greedy-generate exactly ``new_tokens`` for a batch; its ``Timeline``.

    ``on_first_token()`` runs when the first new token arrives (right after the prefill),
    before that token's clocks are read: its cost stays outside the decode interval.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    calls = []

    class _Clock:
        def put(self, value):
            calls.append(None)
            if len(calls) == 1:  # the first put() is the prompt
                return
            if len(calls) == 2 and on_first_token is not None:
                on_first_token()
            line.wall.append(time.perf_counter())
            line.cpu.append(time.process_time())

        def end(self):
            pass

    line = Timeline(start=time.perf_counter())
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **GREEDY,
                       pad_token_id=tokenizer.pad_token_id, streamer=_Clock())
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return line
