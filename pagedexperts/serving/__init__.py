"""The OpenAI-compatible server over HTTP, split by concept (as vLLM's ``entrypoints/openai``).
What a request becomes once admitted (scheduling, batching, sampling, speculative decoding) is
``pagedexperts.engine``'s; nothing here runs the model.

- ``protocol``: the request bodies (pydantic), ``ApiError``, parsing in OpenAI's error shape;
- ``validation``: the limits and the one validation (``prepare``: token ids, per-sequence sampling);
- ``bodies``: completion and chat response bodies and server-sent-event chunks;
- ``responses_api``: the Responses API, its request (translated to the chat path) and its answer
  (the Response object, its streamed events);
- ``metrics``: Prometheus metrics in the server's own registry;
- ``admission``: the API key and body limit before routing, OpenAI's error shape;
- ``connections``: header timeout, connection cap, half-closed clients;
- ``handlers``: what a generation route does (queueing, streaming, disconnects, graceful shutdown);
- ``worker_info``: what a router reads when it registers a replica (/server_info, /model_info);
- ``api_server``: the FastAPI app, its error handlers and lifespan, ``run_server``.

Every module needs the server extra (fastapi, pydantic, prometheus-client, uvicorn), and those
that reach the engine torch as well: importing the package without the extra raises
``MissingExtra`` naming it (``pagedexperts serve`` answers it in one line, exit 2).
"""

from pagedexperts.extras import require

require("server", "the server (pagedexperts.serving)")
