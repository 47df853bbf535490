"""Storage below the device slots: where expert bytes live and how they are read.

``host_store``: the ``ExpertStore`` contract and the full host store (all E experts, pinned at
exact size). ``host_tier``: the disk tier, a host cache of R experts per layer with the same
residency policies, the rest read from the checkpoint on demand (the same contract).
``host_memory``: the host-memory plan, counted before any allocation. ``safetensors_files``:
the shard listing and the header parse (standard library only). ``safetensors_index``: the
byte ranges of every tensor and positional reads (``os.preadv``) into tensor memory.
"""
