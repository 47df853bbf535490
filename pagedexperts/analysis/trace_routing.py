"""Trace-driven routing: a synthetic model's top-k expert ids taken from a recorded trace.

Owns turning a routing trace (JSON-lines, ``--record-trace`` ``.npz``, or a directory of one
model's traces) into the top-k ids of any model's MoE layers, and the hooks that put them in
place of the router's choice, so a synthetic benchmark pages with real text's reuse at any E
and K. The router's weights stay; the model's output is then NOT the model's own.
Does not: judge routing (``simulate``).

Mapping (E_t, k_t the trace's experts and top_k; E, k the model's; c = E // E_t): the model's
experts form c groups of E_t ids (group j: j*E_t .. j*E_t + E_t - 1; the last E - c*E_t are
never routed to). A token takes k/c ids per group: the first k/c of one trace token's ids plus
j*E_t, each group from a different request stream. Model MoE layer i reads trace layer
``layers[i % L_t]``; reader q = i*c + b*c + j (sequence b, group j) reads stream q mod n from
q div n x ``READER_STRIDE`` tokens on. A forward of B sequences x S positions reads, per
sequence, the next S tokens of its streams (wrapping around); B comes from each model call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedexperts.analysis.trace import Trace, load_trace

logger = logging.getLogger(__name__)
READER_STRIDE = 997  # tokens between two readers of one stream (a prime: no common period)


@dataclass
class TraceRouting:
    """Top-k ids from ``trace`` for a model with E = ``num_experts`` and k = ``top_k``.
    Raises ValueError: E_t > E, k not a multiple of c = E // E_t, or k / c > k_t."""

    trace: Trace
    num_experts: int
    top_k: int
    batch_size: int = 1  # sequences of the current forward (set by the model hook)
    _cursor: dict[int, int] = field(default_factory=dict)  # model layer number -> position

    def __post_init__(self) -> None:
        from pagedexperts.analysis.simulate import request_streams

        e_t, k_t = self.trace.meta.num_experts, self.trace.meta.top_k
        if e_t > self.num_experts:
            raise ValueError(f"the routing trace has E={e_t} experts but the model only {self.num_experts}; "
                             "use a trace of a model with at most as many experts (--routing-trace)")
        self.groups = self.num_experts // e_t
        if self.top_k % self.groups or self.top_k // self.groups > k_t:
            raise ValueError(f"model top_k={self.top_k} cannot be taken as {self.groups} groups of equal size "
                             f"from trace tokens of top_k={k_t} (E={e_t}); use another trace (--routing-trace)")
        if self.num_experts % e_t:
            logger.warning("routing trace: E=%d of the model is not a multiple of the trace's E=%d: experts "
                           "%d..%d are never routed to", self.num_experts, e_t, self.groups * e_t, self.num_experts - 1)
        streams = request_streams(self.trace, min_streams=4 * self.groups)
        self._layers = self.trace.meta.layers
        # per trace layer: every stream's rows concatenated [N, k_t], each stream's start and length
        self._rows = {ly: np.concatenate([s[ly] for s in streams]).astype(np.int64) for ly in self._layers}
        lengths = np.array([len(s[self._layers[0]]) for s in streams])
        self._start, self._length = np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths

    def rewind(self) -> None:
        """Start every layer's streams again from the first token (to replay the same routing)."""
        self._cursor.clear()

    def topk_ids(self, layer_number: int, rows: int) -> np.ndarray:
        """The top-k ids [rows, k] (int64) of model MoE layer ``layer_number`` for a forward of ``rows`` =
        B x S rows; advances that layer by S.
        Raises ValueError: ``rows`` is not a multiple of the batch size."""
        b, c = self.batch_size, self.groups
        if rows % b:
            raise ValueError(f"{rows} rows are not {b} sequences of equal length")
        s, n = rows // b, self.top_k // c
        pos = self._cursor.get(layer_number, 0)
        self._cursor[layer_number] = pos + s
        reader = layer_number * c + np.arange(b * c).reshape(b, c)  # [B, c]
        stream, skip = reader % len(self._length), reader // len(self._length) * READER_STRIDE
        offset = (pos + skip[:, :, None] + np.arange(s)[None, None, :]) % self._length[stream][:, :, None]  # [B, c, S]
        ids = self._rows[self._layers[layer_number % len(self._layers)]][self._start[stream][:, :, None] + offset]
        ids = ids[..., :n] + (np.arange(c) * self.trace.meta.num_experts)[None, :, None, None]  # [B, c, S, n]
        return ids.transpose(0, 2, 1, 3).reshape(rows, self.top_k)


def install(model, trace: str | Path | Trace) -> TraceRouting:
    """Route ``model`` (``model.pagedexperts``) by ``trace`` from now on, in every mode: hooks replace
    the top-k ids each experts module receives and read B from each model call. Returns the driver
    (``.handles`` to remove the hooks).
    Raises ValueError: the trace does not fit the model (``TraceRouting``); FileNotFoundError: no such trace
    file."""
    import torch

    rt = model.pagedexperts
    driver = TraceRouting(trace if isinstance(trace, Trace) else load_trace(trace),
                          num_experts=rt.num_experts, top_k=rt.top_k)

    def on_model_call(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        driver.batch_size = int((ids if ids is not None else embeds).shape[0])

    def make_experts_hook(number: int):
        def on_experts_call(module, args, kwargs):
            # the experts interface: (hidden_states [T, H], top_k_index [T, k], top_k_weights), by
            # position (Qwen3-MoE, Mixtral) or by name
            hidden = args[0] if args else kwargs["hidden_states"]
            old = args[1] if len(args) > 1 else kwargs["top_k_index"]
            ids = torch.from_numpy(driver.topk_ids(number, int(hidden.shape[0])))
            ids = ids.to(device=old.device, dtype=old.dtype)
            if len(args) > 1:
                return (args[0], ids, *args[2:]), kwargs
            return args, {**kwargs, "top_k_index": ids}
        return on_experts_call

    driver.handles = [model.register_forward_pre_hook(on_model_call, with_kwargs=True)]
    for number, site in enumerate(sorted(rt.sites, key=lambda s: s.layer)):
        driver.handles.append(site.module.register_forward_pre_hook(make_experts_hook(number), with_kwargs=True))
    return driver
