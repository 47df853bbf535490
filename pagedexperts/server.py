"""The OpenAI-compatible HTTP server (``pagedexperts serve``); now ``pagedexperts.serving``.

Kept so that old imports work: the app lives in ``serving.api_server``, the request
handling in ``serving.handlers``, validation in ``serving.protocol``, metrics in
``serving.metrics``.
"""

from pagedexperts.serving.api_server import create_app, run_server, single_wave_note  # noqa: F401
from pagedexperts.serving.handlers import OpenAIServing, ServeConfig  # noqa: F401
from pagedexperts.serving.metrics import Metrics, paging_time_histograms  # noqa: F401
from pagedexperts.serving.protocol import (  # noqa: F401
    PLAIN_CHAT_TEMPLATE, ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, Prepared, chat_prompt, prepare)
