"""The OpenAI-compatible server, split by concept (as vLLM's ``entrypoints/openai``):

- ``protocol``: request schemas, limits, parsing and validation (``ApiError``, ``prepare``);
- ``sampling``: per-sequence options, logit processing, the next token, logprobs, stop cut;
- ``batching``: packing sequences into one forward (left-padded prefill, decode masks);
- ``scheduler``: continuous batching (batched prefill, batched decode) on one thread;
- ``responses``: OpenAI response bodies and server-sent-event chunks;
- ``metrics``: Prometheus metrics in the server's own registry;
- ``handlers``: what a route does (admission, streaming, disconnects, graceful shutdown);
- ``api_server``: the FastAPI app, its error handlers and lifespan, ``run_server``.

Imports here are lazy: ``pagedexperts.serving.sampling`` and ``scheduler`` need torch only,
the rest the server extra (fastapi, pydantic, prometheus-client, uvicorn).
"""
