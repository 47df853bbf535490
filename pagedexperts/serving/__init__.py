"""The OpenAI-compatible server over HTTP, split by concept (as vLLM's ``entrypoints/openai``):
``protocol``, ``validation``, ``bodies``, ``responses_api``, ``metrics``, ``admission``,
``connections``, ``handlers``, ``worker_info``, ``api_server``. What an admitted request
becomes (scheduling, batching, sampling) is ``pagedexperts.engine``'s; nothing here runs the
model. Every module needs the server extra; importing without it raises ``MissingExtra``
naming it. Behaviour: docs/server.md.
"""

from pagedexperts.extras import require

require("server", "the server (pagedexperts.serving)")
