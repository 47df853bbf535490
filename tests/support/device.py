"""Shared by several test modules (moved from paging/test_cuda.py)."""

from __future__ import annotations


def expert_tensors_on_device(model) -> list[str]:
    """Names of per-expert tensors that an experts module still holds ([E, ...] leading dim;
    the router and k/v projections may be [E, H] too, and are not expert tensors)."""
    held = []
    for site in model.pagedexperts.sites:
        own = dict(site.module.named_parameters(recurse=False)) | dict(site.module.named_buffers(recurse=False))
        held += [f"{site.name}.{n}" for n, t in own.items()
                 if n in {s.name for s in site.specs} or (t.dim() and t.shape[0] == site.num_experts)]
    return held
