"""Speculative decoding inside the engine's continuous batching.

- ``config``: the options and their flag checks, the counters;
- ``proposers``: the proposer contract and prompt lookup (n-gram);
- ``draft``: the draft model's proposer (its own KV cache, not paged);
- ``acceptance``: the acceptance rule (greedy and sampled) that keeps the target's distribution;
- ``decoder``: ``SpeculativeDecoder``, the scheduler's decodes with speculation (propose, verify
  in the step's forward, roll back).
"""
