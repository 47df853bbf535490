"""``SpeculativeDecoder``: the scheduler's decodes with proposals (docs/speculative-decoding.md):
``decode`` (one padded verification forward, eager), ``segments`` (decodes carrying proposals in a
chunked-prefill forward), ``verify`` (one request's acceptance; ``length`` cropped by the rejected
proposals).

Legend: B requests, W = max n_i + 1 query positions, V vocabulary.
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
    """The scheduler's decodes with speculation (``sched``: the BatchScheduler); ``stats`` counts them."""

    def __init__(self, model, tokenizer, config: SpeculativeConfig, *, pad_id: int) -> None:
        self.config = config
        self.stats = SpeculativeStats()
        if config.method == "ngram":
            self.proposer: Proposer = NgramProposer(config)
        else:
            draft = load_draft(config.draft_model_path, target=model, tokenizer=tokenizer)
            self.proposer = DraftProposer(draft, config, pad_id=pad_id)

    def propose(self, reqs: list) -> list[Proposal]:
        """Each decoding request's proposals, at most n and never past its max_tokens."""
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
        """Decode segments [last, d_1..d_n_i] with every row kept, and their proposals."""
        proposals = self.propose([s.request for s in decodes])
        self._count([[*s.token_ids, *p.tokens] for s, p in zip(decodes, proposals)], padded=False)
        return [Segment(s.request, (*s.token_ids, *p.tokens), "all") for s, p in zip(decodes, proposals)], proposals

    def verify(self, sched, req, logits: torch.Tensor, proposal: Proposal) -> None:
        """Verify one request over ``logits`` [1 + n_i, V]: keep m_i proposals, crop ``length``, emit
        m_i + 1 tokens."""
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
        """The acceptance rule over logits [n + 1, V]; row j's penalties count outputs and
        proposals[:j]."""
        params, d = req.sampling, proposal.tokens
        rows = [adjusted_logits(logits[j], params, req.output_ids + d[:j]) for j in range(len(d) + 1)]
        if params.greedy:
            return accept_greedy([int(torch.argmax(x)) for x in rows], d)
        p = torch.stack([sampling_probs(x, params) for x in rows])
        return accept_sampled(p, d, proposal.q, req.generator)
