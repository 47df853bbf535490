"""The draft model of ``--speculative draft``: ``load_draft`` (whole, unpaged, checked against the
target's vocabulary), ``DraftProposer`` (one batched draft forward per proposed token over its own
KV buffers per request) and ``save_truncated_draft`` (a crude draft: the target's first layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedexperts.engine.batching import forward_rows
from pagedexperts.engine.sampling import sampling_probs
from pagedexperts.engine.speculative.config import SpeculativeConfig
from pagedexperts.engine.speculative.proposers import Proposal, context_of

DRAFT_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclass
class DraftState:
    """The draft model's KV buffers of one request; ``length`` tokens of its context are cached."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0


def cache_kwarg(model) -> str:
    """The keyword ``model.forward`` takes its cache by: "cache", or "past_key_values" (older
    transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def model_forward(model) -> Callable:
    """``forward(cache=, **inputs)`` for ``batching.forward_rows``: ``model`` with ``use_cache``."""
    name = cache_kwarg(model)

    def forward(*, cache, **kwargs):
        return model(**kwargs, **{name: cache}, use_cache=True)

    return forward


class DraftProposer:
    """A draft model proposing n tokens per request, one batched forward per token, with its own KV per
    request (cropped to the kept tokens); samples with the request's temperature / top_p, or argmax
    when greedy."""

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
        q = sampling_probs(logits, params)
        return int(torch.multinomial(q, 1, generator=req.generator)), q

    def settle(self, req, kept: int) -> None:
        state = self.states.get(req.request_id)
        if state is not None:
            state.length = min(state.length, kept)


def check_draft_config(path: str, target_config) -> None:
    """Refuse (ValueError naming --draft-model-path and both sizes) a draft whose vocab_size differs;
    configs only, before the target loads."""
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
    if vocab != target_config.vocab_size:
        raise ValueError(f"--draft-model-path {path}: vocab_size {vocab} but the target's is "
                         f"{target_config.vocab_size}; the draft must share the target's tokenizer")


def load_draft(path: str, *, target, tokenizer):
    """The draft of ``path`` (``from_pretrained``, eval) on the target's device and dtype. ValueError
    (names --draft-model-path): another vocabulary size, no tokenizer, or another tokenizer
    vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_draft_config(path, target.config)
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


def save_truncated_draft(model_path, out_dir, *, num_layers: int):
    """The model of ``model_path`` with only its first ``num_layers`` decoder layers, and its
    tokenizer, written to ``out_dir`` (ValueError: ``num_layers`` not in [1, layers))."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    layers = AutoConfig.from_pretrained(model_path).num_hidden_layers
    if not 1 <= num_layers < layers:
        raise ValueError(f"a truncated draft keeps 1..{layers - 1} of the {layers} layers, got {num_layers}")
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
