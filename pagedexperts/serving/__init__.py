"""The OpenAI-compatible server, split by concept (as vLLM's ``entrypoints/openai``):

- ``schemas``: the request bodies (pydantic), ``ApiError``, parsing in OpenAI's error shape;
- ``protocol``: the limits and the one validation (``prepare``: token ids, per-sequence sampling);
- ``sampling``: per-sequence options, logit processing, the next token, logprobs, stop cut;
- ``sequence``: one sequence's state inside the scheduler (``Request``, ``Event``);
- ``batching``: padding sequences into one forward (left-padded prefill, decode cache and masks,
  ``forward_rows``);
- ``chunked_prefill``: prompt chunks and decodes packed into one forward (positions, 4D mask);
- ``isolation``: one bad request fails itself alone (``check_inputs``, ``each_isolated``);
- ``scheduler_config`` / ``scheduler``: continuous batching on one thread (its limits, counters);
- ``speculation`` / ``speculative`` / ``draft``: speculative decoding (the acceptance rule and
  prompt lookup; verification inside the scheduler's steps; the draft model);
  ``generate_one``: ``generate --speculative`` through the scheduler;
- ``responses``: OpenAI response bodies and server-sent-event chunks;
- ``responses_api`` / ``responses_events``: the Responses API's request (translated to the chat
  path) and its answer (the Response object, its streamed events);
- ``metrics``: Prometheus metrics in the server's own registry;
- ``admission``: the API key and body limit before routing, OpenAI's error shape;
- ``connections``: header timeout, connection cap, half-closed clients;
- ``handlers``: what a generation route does (queueing, streaming, disconnects, graceful shutdown);
- ``worker_info``: what a router reads when it registers a replica (/server_info, /model_info);
- ``api_server``: the FastAPI app, its error handlers and lifespan, ``run_server``.

Imports here are lazy: ``pagedexperts.serving.sampling``, ``scheduler`` and speculation need torch only,
the rest the server extra (fastapi, pydantic, prometheus-client, uvicorn).
"""
