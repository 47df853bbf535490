"""Speculative decoding inside continuous batching: propose, verify in one forward, roll back.

Owns: the proposers (``NgramProposer``: prompt lookup; ``DraftProposer``: a smaller
checkpoint with the target's tokenizer, loaded whole with transformers, with its own KV
buffers per request), ``forward_rows`` (one forward of several requests' new tokens after
their cached ones: the caches left-padded, the new tokens right-padded, a 2D mask) and
``SpeculativeDecoder.decode``, the scheduler's decode step when ``--speculative`` is on.

One step for the B running requests: each proposes n_i <= n tokens (n =
``--num-speculative-tokens``, fewer near max_tokens); ONE forward of the target verifies
[last token, d_1..d_n_i] per request (B x (max n_i + 1) query positions); the acceptance rule
(``speculation``) keeps m_i proposals and adds one token; the request's KV length grows by
m_i + 1, so the keys and values of rejected proposals (written past it) are dropped: that is
the rollback, the buffers are overwritten at the next step. The emitted tokens go through
the scheduler's ``_accept`` one by one (stop strings, end of sequence, max_tokens, logprobs
of the target's raw logits, as in plain decoding).

Paging: the verification forward routes every query position of every request (rejected
proposals and padding too), so a step's union is larger and there are fewer steps; the
pager counts it as one step like any forward. The draft model is not paged.

Legend: B requests, W = max n_i + 1 query positions, S cached tokens (S_max the longest),
V vocabulary, D head dim. Does not: schedule requests, or decide acceptance (``speculation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from pagedexperts.serving.sampling import adjusted_logits
from pagedexperts.serving.speculation import (SpeculativeConfig, SpeculativeStats, Verdict, accept_greedy,
                                              accept_sampled, ngram_propose, warped_probs)

class CachedRow(Protocol):
    """A sequence with per-layer KV buffers [kv_heads, capacity, D] of which ``length`` are filled
    (the scheduler's ``Request`` and ``DraftState``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


@dataclass
class Proposal:
    """One request's proposals: ``tokens`` [n] and, from a draft that sampled them, ``q`` [n, V]
    (float32 probabilities they were drawn from; None = point masses, or greedy)."""

    tokens: list[int]
    q: torch.Tensor | None = None


@dataclass
class DraftState:
    """The draft model's KV buffers of one request; ``length`` tokens of its context are cached."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0


class Proposer(Protocol):
    """Proposes tokens for the running requests and hears what was kept."""

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        """At most ``budgets[i]`` tokens for request i."""

    def settle(self, req, kept: int) -> None:
        """The first ``kept`` tokens of the request's context (prompt + outputs + accepted
        proposals) are final; anything proposed past them is dropped."""


def cache_kwarg(model) -> str:
    """The name ``model.forward`` takes its KV cache by ("cache" in newer transformers,
    "past_key_values" before), as the scheduler asks."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def model_forward(model) -> Callable:
    """``forward(cache=, **inputs)`` for ``forward_rows``: ``model`` with ``use_cache``."""
    name = cache_kwarg(model)

    def forward(*, cache, **kwargs):
        return model(**kwargs, **{name: cache}, use_cache=True)

    return forward


def context_of(req) -> list[int]:
    return req.prompt_ids + req.output_ids


def _left_pad(rows: list[torch.Tensor], s_max: int) -> torch.Tensor:
    """[kv_heads, S_i, D] each -> [B, kv_heads, s_max, D], zeros on the left."""
    first = rows[0]
    out = first.new_zeros((len(rows), first.shape[0], s_max, first.shape[2]))
    for i, row in enumerate(rows):
        out[i, :, s_max - row.shape[1]:] = row
    return out


def forward_rows(forward: Callable, rows: list[CachedRow], tokens: list[list[int]], *, pad_id: int,
                 device) -> torch.Tensor:
    """One forward of ``tokens[i]`` after row i's ``length`` cached tokens; logits [B, W, V] (CPU).

    Caches are left-padded to S_max, new tokens right-padded to W with ``pad_id``; the 2D mask
    [B, S_max + W] hides both paddings; positions continue each row's own. A single row is not
    padded and gets no mask (as ``model.generate``). The new keys and values are written into
    each row's buffers at [length, length + len(tokens[i])); ``length`` is left to the caller.
    ``forward(input_ids=, position_ids=, cache=, logits_to_keep=, [attention_mask=])``.
    """
    from transformers import DynamicCache

    b, w = len(rows), max(len(t) for t in tokens)
    s_max = max(r.length for r in rows)
    cache = DynamicCache()
    for layer in range(len(rows[0].keys)):
        if b == 1:
            k, v = rows[0].keys[layer][None, :, :s_max], rows[0].values[layer][None, :, :s_max]
        else:
            k = _left_pad([r.keys[layer][:, : r.length] for r in rows], s_max)
            v = _left_pad([r.values[layer][:, : r.length] for r in rows], s_max)
        cache.update(k, v, layer)
    ids = torch.full((b, w), pad_id, dtype=torch.long)
    mask = torch.zeros((b, s_max + w), dtype=torch.long)
    positions = torch.zeros((b, w), dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, tokens)):
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, s_max - r.length: s_max + len(t)] = 1
        positions[i] = torch.arange(r.length, r.length + w)
    kwargs = dict(input_ids=ids.to(device), position_ids=positions.to(device), cache=cache, logits_to_keep=w)
    if b > 1:
        kwargs["attention_mask"] = mask.to(device)
    out = forward(**kwargs)
    for layer, cl in enumerate(cache.layers):
        for i, (r, t) in enumerate(zip(rows, tokens)):
            r.keys[layer][:, r.length: r.length + len(t)] = cl.keys[i, :, s_max: s_max + len(t)]
            r.values[layer][:, r.length: r.length + len(t)] = cl.values[i, :, s_max: s_max + len(t)]
    return out.logits.to("cpu")


class NgramProposer:
    """Prompt lookup over each request's own prompt + output (no model, no state)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        c = self.config
        return [Proposal(ngram_propose(context_of(r), n, ngram_max=c.ngram_max, ngram_min=c.ngram_min) if n > 0 else [])
                for r, n in zip(reqs, budgets)]

    def settle(self, req, kept: int) -> None:
        pass


class DraftProposer:
    """A draft model proposing n tokens per request, one batched draft forward per token.

    Each request's draft KV buffers (``DraftState``) are made at its first step (its context
    but the last token prefilled alone) and cropped to the kept tokens after each verification.
    The draft samples with the request's temperature / top_p (its ``q`` goes to the
    acceptance rule) or, for greedy requests, takes its argmax.
    """

    def __init__(self, draft, config: SpeculativeConfig, *, pad_id: int) -> None:
        self.draft, self.config, self.pad_id = draft, config, pad_id
        self.states: dict[int, DraftState] = {}
        self._forward = model_forward(draft)

    def _state(self, req) -> DraftState:
        state = self.states.get(req.request_id)
        if state is None:
            state = self.states[req.request_id] = DraftState()
            context = context_of(req)[:-1]
            capacity = len(req.prompt_ids) + req.sampling.max_new_tokens + 1
            cfg = self.draft.config
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            for _ in range(cfg.num_hidden_layers):
                for buffers in (state.keys, state.values):
                    buffers.append(torch.empty((heads, capacity, head_dim), dtype=self.draft.dtype, device=self.draft.device))
            forward_rows(self._forward, [state], [context], pad_id=self.pad_id, device=self.draft.device)
            state.length = len(context)
        return state

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        live = {r.request_id for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]  # finished or cancelled
        out = [Proposal([]) for _ in reqs]
        rows = [i for i, n in enumerate(budgets) if n > 0]
        states = {i: self._state(reqs[i]) for i in rows}
        feeds = {i: context_of(reqs[i])[states[i].length:] for i in rows}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        for j in range(max(budgets, default=0)):
            active = [i for i in rows if budgets[i] > j]
            logits = forward_rows(self._forward, [states[i] for i in active], [feeds[i] for i in active],
                                  pad_id=self.pad_id, device=self.draft.device)
            for row, i in enumerate(active):
                states[i].length += len(feeds[i])
                token, q = self._pick(reqs[i], logits[row, len(feeds[i]) - 1])
                out[i].tokens.append(token)
                if q is not None:
                    qs[i].append(q)
                feeds[i] = [token]
        for i in rows:
            if qs[i]:
                out[i].q = torch.stack(qs[i])
        return out

    @staticmethod
    def _pick(req, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        params = req.sampling
        if params.greedy:
            return int(torch.argmax(logits)), None
        q = warped_probs(logits, params.temperature, params.top_p)
        return int(torch.multinomial(q, 1, generator=req.generator)), q

    def settle(self, req, kept: int) -> None:
        state = self.states.get(req.request_id)
        if state is not None:
            state.length = min(state.length, kept)


def load_draft(path: str, *, target, tokenizer):
    """The draft model of ``path`` (transformers ``from_pretrained``, whole, eval) on the
    target's device and dtype.

    Raises:
        ValueError: naming --draft-model-path: its vocabulary size differs from the target's,
            it has no tokenizer, or its tokenizer's vocabulary differs from the target's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    vocab = getattr(config, "vocab_size", None)
    if vocab != target.config.vocab_size:
        raise ValueError(f"--draft-model-path {path}: vocab_size {vocab} but the target's is "
                         f"{target.config.vocab_size}; the draft must share the target's tokenizer")
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--draft-model-path {path}: no tokenizer to compare with the target's ({exc}); "
                         "copy the target's tokenizer files there") from exc
    if tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--draft-model-path {path}: its tokenizer's vocabulary differs from the target's; "
                         "the draft must share the target's tokenizer")
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
    return draft.to(target.device).eval()


DRAFT_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def save_truncated_draft(model_path, out_dir, *, num_layers: int):
    """Write a draft checkpoint to ``out_dir``: the model of ``model_path`` with only its first
    ``num_layers`` decoder layers (embeddings, final norm and LM head kept), and its tokenizer
    files. A crude draft (an early exit, not trained as one) that shares the tokenizer by
    construction; returns ``out_dir``.

    Raises:
        ValueError: ``num_layers`` not in [1, the model's layers).
    """
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    layers = AutoConfig.from_pretrained(model_path).num_hidden_layers
    if not 1 <= num_layers < layers:
        raise ValueError(f"a truncated draft keeps 1..{layers - 1} of the {layers} layers, got {num_layers}")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped layers' weights are "unexpected" by design
    try:
        draft = AutoModelForCausalLM.from_pretrained(model_path, num_hidden_layers=num_layers)
    finally:
        hf_logging.set_verbosity(verbosity)
    draft.save_pretrained(out_dir)
    for name in DRAFT_SIDE_FILES:
        if (Path(model_path) / name).exists():
            shutil.copy(Path(model_path) / name, Path(out_dir) / name)
    return out_dir


class SpeculativeDecoder:
    """The scheduler's decode step with speculation (module docstring); ``stats`` counts it."""

    def __init__(self, model, tokenizer, config: SpeculativeConfig, *, pad_id: int) -> None:
        self.config = config
        self.stats = SpeculativeStats()
        if config.method == "ngram":
            self.proposer: Proposer = NgramProposer(config)
        else:
            draft = load_draft(config.draft_model_path, target=model, tokenizer=tokenizer)
            self.proposer = DraftProposer(draft, config, pad_id=pad_id)

    def decode(self, sched, reqs: list) -> None:
        """One verification forward for ``reqs`` (running requests of ``sched``, a BatchScheduler)."""
        n = self.config.num_speculative_tokens
        budgets = [max(0, min(n, r.sampling.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]
        proposals = self.proposer.propose(reqs, budgets)
        tokens = [[r.output_ids[-1]] + p.tokens for r, p in zip(reqs, proposals)]
        ids = [r.request_id for r in reqs]
        logits = forward_rows(lambda **kw: sched._forward(ids, **kw), reqs, tokens, pad_id=sched.pad_id,
                              device=sched.model.device)
        self._count(sched, tokens)
        for i, (r, p) in enumerate(zip(reqs, proposals)):
            verdict = self._verify(r, logits[i, : len(tokens[i])], p)
            self.stats.accepted += verdict.accepted
            self.stats.emitted += len(verdict.tokens)
            r.length += verdict.accepted + 1
            self.proposer.settle(r, len(context_of(r)) + verdict.accepted)
            for j, token in enumerate(verdict.tokens):
                if r.finished_s is not None:
                    break
                sched._accept(r, logits[i, j], token=token)

    def _count(self, sched, tokens: list[list[int]]) -> None:
        w = max(len(t) for t in tokens)
        s = self.stats
        s.forwards += 1
        s.steps += len(tokens)
        s.proposed += sum(len(t) - 1 for t in tokens)
        s.padded += sum(w - len(t) for t in tokens)
        sched.stats.decode_steps += 1
        sched.stats.decode_rows += len(tokens)
        sched.stats.max_decode_batch = max(sched.stats.max_decode_batch, len(tokens))

    @staticmethod
    def _verify(req, logits: torch.Tensor, proposal: Proposal) -> Verdict:
        """The acceptance rule over logits [n + 1, V]; row j's logit_bias / penalties count the
        outputs and proposals[:j], as plain decoding would have at that position."""
        params, d = req.sampling, proposal.tokens
        rows = [adjusted_logits(logits[j], params, req.output_ids + d[:j]) for j in range(len(d) + 1)]
        if params.greedy:
            return accept_greedy([int(torch.argmax(x)) for x in rows], d)
        p = torch.stack([warped_probs(x, params.temperature, params.top_p) for x in rows])
        return accept_sampled(p, d, proposal.q, req.generator)


def speculative_metrics(stats: SpeculativeStats, prefix: str):
    """Prometheus families of ``stats`` (names after vLLM's ``spec_decode_*``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily(prefix + "spec_decode_num_drafts", "Verification steps (one per request per forward)",
                              value=stats.steps)
    yield CounterMetricFamily(prefix + "spec_decode_num_draft_tokens", "Tokens proposed", value=stats.proposed)
    yield CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens", "Proposals accepted", value=stats.accepted)
    yield CounterMetricFamily(prefix + "spec_decode_num_emitted_tokens", "Tokens produced by verification steps",
                              value=stats.emitted)
    yield CounterMetricFamily(prefix + "spec_decode_num_padded_tokens", "Query positions padding a verification batch",
                              value=stats.padded)
    yield GaugeMetricFamily(prefix + "spec_decode_acceptance_rate", "Accepted / proposed since the start",
                            value=stats.acceptance_rate)
    yield GaugeMetricFamily(prefix + "spec_decode_mean_accepted_per_step", "Accepted proposals per verification step",
                            value=stats.mean_accepted_per_step)
