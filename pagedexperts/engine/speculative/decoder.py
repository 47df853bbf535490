"""Speculative decoding inside continuous batching: propose, verify in the step's forward, roll back.

Owns: ``SpeculativeDecoder``, which the scheduler asks for the decodes of every step when
``--speculative`` is on: ``decode`` (a step with no prompt chunk: ONE forward of the
B running requests, the scheduler's ``StepForwards.decodes``: over KV rows a fixed-shape step per
(bucket, width), run eagerly, never captured), ``segments`` (a chunked-prefill step: each
decode's segment carries its proposals, packed with the prompt chunks into the step's one
forward, ``chunked_prefill``) and ``verify`` (one request's acceptance, rollback and
tokens, run per request under ``isolation.each_isolated``: a fault in one request's
verification fails that request alone). Its counters reach /metrics through
``serving.metrics.speculative_metrics``.

One step: each decoding request proposes n_i <= n tokens (n = ``--num-speculative-tokens``,
fewer near max_tokens; ``proposers.NgramProposer`` or ``draft.DraftProposer``); the
step's forward computes [last token, d_1..d_n_i] per request and caches all 1 + n_i keys
and values; the acceptance rule (``acceptance``) keeps m_i proposals and adds one token;
the request's KV ``length`` is then cropped by the n_i - m_i rejected proposals (the
rollback: their keys and values past ``length`` are overwritten by the next step). The
emitted tokens go through the scheduler's ``_accept`` one by one (stop strings, end of
sequence, max_tokens, logprobs of the target's raw logits, as in plain decoding).

Paging: the forward routes every query position of every request (rejected proposals, and
in a padded step padding too), so a step's union is larger and there are fewer steps; the
pager counts it as one step like any forward. The draft model is not paged. With chunked
prefill, the proposals come on top of ``--max-prefill-tokens`` (the budget of prompt tokens).

Legend: B requests, W = max n_i + 1 query positions, S cached tokens (S_max the longest),
V vocabulary. Does not: schedule requests, or decide acceptance (``acceptance``).
"""

from __future__ import annotations

import torch

from pagedexperts.engine.chunked_prefill import Segment
from pagedexperts.engine.isolation import each_isolated
from pagedexperts.engine.sampling import adjusted_logits, sampling_probs
from pagedexperts.engine.speculative.acceptance import Verdict, accept_greedy, accept_sampled
from pagedexperts.engine.speculative.config import SpeculativeConfig, SpeculativeStats
from pagedexperts.engine.speculative.draft import DraftProposer, load_draft
from pagedexperts.engine.speculative.proposers import NgramProposer, Proposal, Proposer, context_of


class SpeculativeDecoder:
    """The decodes of the scheduler's steps with speculation (module docstring); ``stats`` counts them.

    ``sched`` below is the BatchScheduler: its ``forwards``, ``_accept``, ``_fail`` and
    ``SchedulerStats.count_decode`` are what a plain decode would call.
    """

    def __init__(self, model, tokenizer, config: SpeculativeConfig, *, pad_id: int) -> None:
        self.config = config
        self.stats = SpeculativeStats()
        if config.method == "ngram":
            self.proposer: Proposer = NgramProposer(config)
        else:
            draft = load_draft(config.draft_model_path, target=model, tokenizer=tokenizer)
            self.proposer = DraftProposer(draft, config, pad_id=pad_id)

    def propose(self, reqs: list) -> list[Proposal]:
        """Each decoding request's proposals, at most n and fewer near its max_tokens (the
        last token of a request is never proposed: its step has nothing after it to verify)."""
        n = self.config.num_speculative_tokens
        budgets = [max(0, min(n, r.sampling.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]
        return self.proposer.propose(reqs, budgets)

    def decode(self, sched, reqs: list) -> None:
        """A step with no prompt chunk: one padded verification forward for the running ``reqs``."""
        proposals = self.propose(reqs)
        tokens = [[r.output_ids[-1]] + p.tokens for r, p in zip(reqs, proposals)]
        logits = sched.forwards.decodes(reqs, tokens)  # [B, W, V]
        sched.stats.count_decode(len(reqs))
        self._count(tokens, padded=True)
        rows = {r.request_id: (logits[i, : len(t)], p) for i, (r, t, p) in enumerate(zip(reqs, tokens, proposals))}
        each_isolated(reqs, lambda r: self.verify(sched, r, *rows[r.request_id]), sched._fail, what="verification")

    def segments(self, decodes: list[Segment]) -> tuple[list[Segment], list[Proposal]]:
        """The decode segments of a chunked-prefill step with their proposals: tokens [last,
        d_1..d_n_i], every row's logits kept; and the proposals (verified after the forward
        with ``verify``, each request's rows of the packed logits)."""
        proposals = self.propose([s.request for s in decodes])
        self._count([[*s.token_ids, *p.tokens] for s, p in zip(decodes, proposals)], padded=False)
        return [Segment(s.request, (*s.token_ids, *p.tokens), "all") for s, p in zip(decodes, proposals)], proposals

    def verify(self, sched, req, logits: torch.Tensor, proposal: Proposal) -> None:
        """One request's verification: ``logits`` [1 + n_i, V] of its step's tokens, whose keys
        and values the step cached (``length`` counts them all); keeps m_i proposals, crops
        ``length`` by the rejected ones, emits the m_i + 1 tokens through ``sched._accept``."""
        verdict = self._verdict(req, logits, proposal)
        self.stats.accepted += verdict.accepted
        self.stats.emitted += len(verdict.tokens)
        req.length -= len(proposal.tokens) - verdict.accepted  # the rollback
        self.proposer.settle(req, len(context_of(req)) + verdict.accepted)
        for j, token in enumerate(verdict.tokens):
            if req.finished_s is not None:
                break
            sched._accept(req, logits[j], token=token)

    def _count(self, tokens: list[list[int]], *, padded: bool) -> None:
        w = max(len(t) for t in tokens)
        s = self.stats
        s.forwards += 1
        s.steps += len(tokens)
        s.proposed += sum(len(t) - 1 for t in tokens)
        s.padded += sum(w - len(t) for t in tokens) if padded else 0

    @staticmethod
    def _verdict(req, logits: torch.Tensor, proposal: Proposal) -> Verdict:
        """The acceptance rule over logits [n + 1, V]; row j's logit_bias / penalties count the
        outputs and proposals[:j], as plain decoding would have at that position."""
        params, d = req.sampling, proposal.tokens
        rows = [adjusted_logits(logits[j], params, req.output_ids + d[:j]) for j in range(len(d) + 1)]
        if params.greedy:
            return accept_greedy([int(torch.argmax(x)) for x in rows], d)
        p = torch.stack([sampling_probs(x, params) for x in rows])
        return accept_sampled(p, d, proposal.q, req.generator)
