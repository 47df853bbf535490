"""Write tests/data/synthetic_trace.npz: a small routing trace with token-to-token reuse.

E=16 routed experts, top_k=2, MoE layers [1, 3], 6 requests: one prefill step of 12 rows, then
30 decode steps of the 6 requests (one row each). Each token keeps each of its previous experts
with probability 0.6, else draws a fresh one, so LRU beats uniform routing. Seeded; run
``python tests/data/make_synthetic_trace.py`` to regenerate (the file is committed).
"""

from __future__ import annotations

import os

import numpy as np

from pagedexperts.analysis.trace import TraceWriter

E, K_TOP, LAYERS, REQUESTS, DECODE_STEPS = 16, 2, [1, 3], 6, 30
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic_trace.npz")


def _route(rng, prev):
    """[T, k] distinct expert ids: keep each previous expert with p=0.6, else draw fresh."""
    out = []
    for row in prev:
        keep = [int(e) for e in row if rng.random() < 0.6]
        while len(keep) < K_TOP:
            e = int(rng.integers(E))
            if e not in keep:
                keep.append(e)
        out.append(keep)
    return np.asarray(out, dtype=np.int32)


def main(path: str = PATH) -> None:
    rng = np.random.default_rng(1234)
    w = TraceWriter(num_experts=E, top_k=K_TOP, layers=LAYERS, model_id="synthetic/reuse-16x2")
    w.begin_step(phase="prefill", request_ids=[r for r in range(REQUESTS) for _ in range(2)])
    prev = {ly: np.argsort(rng.random((2 * REQUESTS, E)), axis=1)[:, :K_TOP] for ly in LAYERS}
    for ly in LAYERS:
        w.add(layer=ly, topk_ids=prev[ly], topk_weights=np.full(prev[ly].shape, 0.5))
    prev = {ly: ids[1::2] for ly, ids in prev.items()}
    for _ in range(DECODE_STEPS):
        w.begin_step(phase="decode", request_ids=list(range(REQUESTS)))
        for ly in LAYERS:
            prev[ly] = _route(rng, prev[ly])
            weights = rng.dirichlet(np.ones(K_TOP), size=REQUESTS)
            w.add(layer=ly, topk_ids=prev[ly], topk_weights=weights)
            w.add_extra(layer=ly, name="compute_s", values=[1e-3])
    w.save(path)


if __name__ == "__main__":
    main()
