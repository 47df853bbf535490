"""What a router asks of a replica beyond the OpenAI routes: the bodies of GET /server_info and
/model_info (also /get_server_info and /get_model_info), in SGLang's field names where the
concept is the same (``served_model_name``, ``model_path``, ``tokenizer_path``). What the
routers read: docs/server.md, "Replicas behind a router". Does not: route or decide anything.
"""

from __future__ import annotations

import pagedexperts


def model_info(config, model) -> dict:
    """GET /model_info: the served model (SGLang's ``model_path``, ``tokenizer_path``, ``is_generation``)."""
    paths = {"model_path": config.model_path, "tokenizer_path": config.model_path} if config.model_path else {}
    return {**paths, "served_model_name": config.served_model_name, "is_generation": True,
            "model_type": getattr(model.config, "model_type", None),
            "architectures": list(getattr(model.config, "architectures", None) or [])}


def server_info(config, model, scheduler) -> dict:
    """GET /server_info: the model info plus this replica's limits, paging shape and every choice
    its load resolved, with the reason for each (``loading.resolved.Resolved.as_dict``)."""
    runtime = model.pagedexperts
    return {**model_info(config, model), "version": pagedexperts.__version__,
            "context_length": config.context_length, "max_running_requests": config.max_running_requests,
            "max_queued_requests": config.max_queued_requests, "max_prefill_tokens": config.max_prefill_tokens,
            "num_resident": runtime.num_resident, "num_experts": runtime.num_experts, "top_k": runtime.top_k,
            "resolved": runtime.resolved.as_dict(),
            "running_requests": scheduler.num_running, "waiting_requests": scheduler.num_waiting,
            "decode": scheduler.forwards.summary()}
