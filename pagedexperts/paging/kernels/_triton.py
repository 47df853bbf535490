"""The optional Triton import and the kernel backend choice: "torch" (any device) or "triton" (CUDA, or
CPU with ``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # the optional extra is not installed
    triton = None
    tl = None
    HAVE_TRITON = False

BACKENDS = ("torch", "triton")
# Triton reads TRITON_INTERPRET when a kernel is defined (at import of the kernel modules, which
# import this one first), so the value at this import is the one that counts.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_backend(backend: str, device) -> str:
    """``backend`` if it can run on ``device``; ValueError for an unknown backend, "triton" without
    triton (names the ``gpu`` extra) or on a CPU without ``TRITON_INTERPRET=1``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "torch":
        return backend
    if not HAVE_TRITON:
        raise ValueError("kernel backend 'triton' needs triton: pip install 'pagedexperts[gpu]'")
    import torch

    if torch.device(device).type == "cpu" and not INTERPRETED:
        raise ValueError(
            "kernel backend 'triton' on a CPU device runs only under TRITON_INTERPRET=1, set before "
            "pagedexperts.paging.kernels is imported (tests); use backend 'torch' on CPU")
    return backend
