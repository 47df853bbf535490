"""The OpenAI-compatible server, split by concept (as vLLM's ``entrypoints/openai``):

- ``protocol``: request schemas, limits, parsing and validation (``ApiError``, ``prepare``);
- ``sampling``: per-sequence options, logit processing, the next token, logprobs, stop cut;
- ``batching``: packing sequences into one forward (left-padded prefill, decode masks);
- ``scheduler``: continuous batching (batched prefill, batched decode) on one thread;
- ``responses``: OpenAI response bodies and server-sent-event chunks;
- ``responses_api`` / ``responses_events``: the Responses API's request (translated to the chat
  path) and its answer (the Response object, its streamed events);
- ``metrics``: Prometheus metrics in the server's own registry;
- ``admission``: the API key and body limit before routing, OpenAI's error shape;
- ``handlers``: what a generation route does (queueing, streaming, disconnects, graceful shutdown);
- ``worker_info``: what a router reads when it registers a replica (/server_info, /model_info);
- ``api_server``: the FastAPI app, its error handlers and lifespan, ``run_server``.

Imports here are lazy: ``pagedexperts.serving.sampling`` and ``scheduler`` need torch only,
the rest the server extra (fastapi, pydantic, prometheus-client, uvicorn).
"""
