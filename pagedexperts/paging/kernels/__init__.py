"""Triton kernels of the device-planned layer-step, each with a plain-torch backend.

``decide`` (residency decision of one step, and the remap of its entries: top-k ids -> slots
and waves, with the state it updates), ``page_in`` (store rows -> slot rows, count
read on the device), and the fused MoE kernels (``fused_align``, ``fused_moe``,
``fused_moe_kernel``). Every kernel has a torch function
of identical semantics (the ``*_torch`` functions) that runs anywhere; the Triton version
runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests). Triton is an
optional extra (``pip install pagedexperts[gpu]``): ``HAVE_TRITON`` says whether it imported.
"""

from pagedexperts.paging.kernels._triton import HAVE_TRITON, check_backend  # noqa: F401
