"""Storage below the device slots: where expert bytes live and how they are read.

``safetensors_index``: the byte ranges of every tensor in a checkpoint's safetensors files
(from their headers, the published format) and positional reads (``os.preadv``) of those
ranges into tensor memory. ``reader``: the fast checkpoint fill (expert rows straight into the
host store, non-expert tensors copied out, no memory map kept). ``host_tier``: the disk tier,
a host cache of R experts per layer with the same residency policies, the rest read from the
checkpoint on demand. The full host store itself is still ``pagedexperts.storage.host_store``.
"""
