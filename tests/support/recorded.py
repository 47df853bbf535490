"""Shared by several test modules (moved from analysis/test_runtime_vs_simulator.py)."""

from __future__ import annotations
import torch
from support.tiny import PAD_ID, prompt
from pagedexperts.loading.loader import load_model
from pagedexperts.analysis.recording import TraceRecorder


FIELDS = ("steps", "tokens", "padding_tokens", "hits", "misses", "page_ins", "bytes_paged", "waves",
          "multi_wave_steps", "union_sum", "union_max")


def generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int = 12) -> None:
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=PAD_ID)


def run_recorded(path, trace_path, *, policy: str, num_resident: int, **kw):
    """Generate with a recorder attached; return the model (its counters) after saving the trace."""
    model, _ = load_model(path, num_resident=num_resident, policy=policy, **kw)
    rec = TraceRecorder.attach(model)
    for n, seed in enumerate((1, 2)):
        rec.request_ids = [n]
        ids = prompt(7 + 4 * n, seed).unsqueeze(0)
        generate(model, ids, torch.ones_like(ids))
    rec.request_ids = [2, 3]
    a, b = prompt(9, 3), prompt(4, 4)
    ids = torch.stack([a, torch.cat([torch.full((5,), PAD_ID), b])])
    mask = torch.stack([torch.ones(9, dtype=torch.long), torch.cat([torch.zeros(5), torch.ones(4)]).long()])
    generate(model, ids, mask)
    rec.save(trace_path)
    return model
