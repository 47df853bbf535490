"""OpenAI response bodies of completions and chat, whole and as server-sent-event chunks.

Owns: the JSON shape of choices, usage and logprobs, the ``data:`` framing, and ``Choice``
(what one sequence has produced so far). Pure data shaping: no tokenizer, no model, no HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedexperts.engine.sampling import TokenLogprob


@dataclass
class Choice:
    """One sequence of a response: index, text so far, logprob reports, finish."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters of text already described by logprobs (completions)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    completion_tokens: int = 0
    error: str | None = None
    echoed: bool = False  # the prompt was sent (completions with echo)


def sse(payload) -> str:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``) and a blank line.
    Raises ValueError for a NaN or infinity in ``payload`` (not JSON; never sent)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[TokenLogprob], first_offset: int) -> dict:
    """Completions' logprobs object; ``top_logprobs`` maps token text -> logprob and, as in
    vLLM, also holds the chosen token; ``text_offset`` counts characters from the response
    text's start."""
    offsets, off = [], first_offset
    for e in entries:
        offsets.append(off)
        off += len(e.token)
    tops = []
    for e in entries:
        if e.logprob is None:
            tops.append(None)
            continue
        top = {text: lp for text, _, lp in e.top}
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """Chat's logprobs object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def one(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, _, lp in e.top]}
                        for e in entries]}


def choice_body(c: Choice, *, chat: bool, logprobs: bool, prefix: str = "") -> dict:
    """A whole (non-streamed) choice; ``prefix``: the echoed prompt (completions). ``stop_reason``
    as vLLM gives it: the stop string or the stop token id that ended the choice, None for the
    end-of-sequence token, the length limit, or anything else."""
    text = prefix + "".join(c.text)
    if chat:
        return {"index": c.index, "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(c.logprobs) if logprobs else None, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
    return {"index": c.index, "text": text, "logprobs": completion_logprobs(c.logprobs, 0) if logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def chunk_choice(c: Choice, text: str, entries: list[TokenLogprob], finish: str | None, *, chat: bool,
                 logprobs: bool, first: bool = False) -> dict:
    """One streamed choice delta; the one that carries ``finish`` carries ``stop_reason`` too (vLLM's)."""
    end = {} if finish is None else {"stop_reason": c.stop_reason}
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": c.index, "delta": delta,
                "logprobs": chat_logprobs(entries) if logprobs and entries else None, "finish_reason": finish, **end}
    lp = None
    if logprobs:
        lp = completion_logprobs(entries, c.text_offset)
        c.text_offset += sum(len(e.token) for e in entries)
    return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish, **end}
