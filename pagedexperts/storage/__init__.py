"""Storage below the device slots: the ``ExpertStore`` contract and the full host store
(``host_store``), the disk tier (``host_tier``), the host-memory plan (``host_memory``), safetensors
headers, byte ranges and positional reads, and stored kernel layouts. docs/disk-tier.md.
"""
