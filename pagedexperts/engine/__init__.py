"""The engine: generation requests batched continuously on one thread, apart from HTTP.

- ``sampling``: per-sequence options, logit processing, the next token, logprobs, stop cut;
- ``sequence``: one sequence's state inside the scheduler (``Request``, ``Event``);
- ``batching``: padding sequences into one forward (left-padded prefill, decode cache and masks,
  ``forward_rows``);
- ``chunked_prefill``: prompt chunks and decodes packed into one forward (positions, 4D mask);
- ``forwards``: the contract of the scheduler's forwards (``StepForwards``, decode counts by how
  they ran) and the rebuilt-cache layout (``DynamicForwards``, the fallback);
- ``kv_rows`` / ``row_attention`` / ``row_forwards``: the running requests' KV held in place, a
  row each, attention over the rows, and decode steps of fixed shapes per batch bucket run
  through ``generation.graphs`` (captured on CUDA);
- ``isolation``: one bad request fails itself alone (``check_inputs``, ``each_isolated``);
- ``scheduler_config`` / ``scheduler``: continuous batching on one thread (its limits, counters);
- ``speculative``: speculative decoding (``config``, ``proposers``, ``acceptance``, ``draft``,
  ``decoder``: verification inside the scheduler's steps);
- ``generate_one``: ``generate --speculative``, one request through the scheduler.

Does not: speak HTTP, validate clients' requests or shape their answers (``pagedexperts.serving``),
or page experts (``pagedexperts.paging``, below the model). Needs torch only.
"""
