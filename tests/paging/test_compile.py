"""torch.compile over a paged model: the paged experts step is one custom op in the graph.

``torch.ops.pagedexperts.experts_step`` has a fake implementation, so dynamo traces the whole
model around it: compiled paged at K < E equals compiled paged at K = E bit for bit (the same
compiled graph around the same experts outputs), and ``torch._dynamo.explain`` reports no
graph break but at the op (the step toward CUDA graphs, docs/device-side-decide.md).
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import E, TOP_K
from pagedexperts.loading.loader import load_model


def _inputs():
    ids = torch.randint(2, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return dict(input_ids=ids, attention_mask=mask)


def test_explain_shows_no_break_but_at_the_op(tiny_moe_dir):
    torch._dynamo.reset()
    model, _ = load_model(tiny_moe_dir, num_resident=TOP_K)
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(**_inputs())
    reasons = [str(r.reason) for r in ex.break_reasons]
    assert all("experts_step" in r for r in reasons), reasons
    calls = [n for g in ex.graphs for n in g.graph.nodes if "experts_step" in str(n.target)]
    assert len(calls) == len(model.pagedexperts.runners)  # one op per MoE layer, in the graph
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_paged_equals_compiled_resident_slots(tiny_moe_dir, backend):
    """K = top_k (multi-wave, evictions) against K = E, both compiled the same way."""
    outs = []
    for k_slots in (TOP_K, E):
        torch._dynamo.reset()
        model, _ = load_model(tiny_moe_dir, num_resident=k_slots)
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            outs.append([compiled(**_inputs()).logits for _ in range(2)])
        stats = model.pagedexperts.stats().total()
        assert stats.steps == 2 * len(model.pagedexperts.runners)  # the op ran eagerly each step
        if k_slots == TOP_K:
            assert stats.misses > 0 and stats.multi_wave_steps > 0
    torch._dynamo.reset()
    for got, want in zip(*outs):
        assert torch.equal(got, want), (got - want).abs().max()
