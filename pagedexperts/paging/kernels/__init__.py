"""Triton kernels of the device-planned layer-step, each with a plain-torch reference.

``decide`` (residency decision of one step), ``page_in`` (store rows -> slot rows, count read
on the device) and ``remap`` (top-k ids -> slots and waves). Every kernel has a torch function
of identical semantics (the ``*_reference`` functions) that runs anywhere; the Triton version
runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests). Triton is an
optional extra (``pip install pagedexperts[gpu]``): ``HAVE_TRITON`` says whether it imported.
"""

from pagedexperts.paging.kernels._triton import HAVE_TRITON, check_backend  # noqa: F401
