"""Triton kernels of the device-planned layer-step (``decide``, ``page_in``, the fused MoE kernels),
each with a torch function of identical semantics (``*_torch``). Triton runs on CUDA tensors, or on
CPU ones under ``TRITON_INTERPRET=1``; it is the optional ``gpu`` extra (``HAVE_TRITON``).
"""

from pagedexperts.paging.kernels._triton import HAVE_TRITON, check_backend  # noqa: F401
