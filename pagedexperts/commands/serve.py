"""``pagedexperts serve``: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import sys

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import (
    add_graph_arguments, add_model_arguments, apply_threads, check_paging_flags, load_from_args,
)
from pagedexperts.commands.speculative_flags import add_speculative_arguments, speculative_from_args

# not imported: building --help loads no engine or serving module
DEFAULT_MAX_PREFILL_TOKENS = 2048  # = engine.scheduler_config.DEFAULT_MAX_PREFILL_TOKENS
DEFAULT_HEADER_TIMEOUT_S = 5.0  # = serving.connections.DEFAULT_HEADER_TIMEOUT_S
DEFAULT_BODY_TIMEOUT_S = 30.0  # = serving.connections.DEFAULT_BODY_TIMEOUT_S
DEFAULT_BODY_DEADLINE_S = 300.0  # = serving.connections.DEFAULT_BODY_DEADLINE_S
DEFAULT_MAX_CONNECTIONS = 1024  # = serving.connections.DEFAULT_MAX_CONNECTIONS
MAX_PROMPT_BYTES_PER_TOKEN = 32  # = serving.validation.MAX_PROMPT_BYTES_PER_TOKEN


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help=COMMANDS["serve"],
        description="Serve the model over HTTP: POST /v1/completions, /v1/chat/completions "
        "and /v1/responses (stream: true for server-sent events), GET /v1/models, /v1/models/{id}, /health, "
        "/metrics (Prometheus), /server_info and /model_info (what sglang-router reads when it registers a "
        "replica). A request without max_tokens gets OpenAI's and vLLM's default: 16 tokens on /v1/completions, "
        "what the context leaves after the prompt on chat and responses (max_output_tokens reports the limit "
        "applied). Besides OpenAI's fields, requests take vLLM's top_k, min_p, repetition_penalty, min_tokens, "
        "stop_token_ids, ignore_eos, include_stop_str_in_output and skip_special_tokens, with vLLM's meaning. "
        "Running requests decode together in one forward per step, and prompts are prefilled in chunks "
        "that share those forwards (chunked prefill). "
        "Needs the server extra: pip install 'pagedexperts[server]'.",
    )
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients must send (default: the model directory's name)")
    b = p.add_argument_group("batching")
    b.add_argument("--max-running-requests", type=int, default=None, metavar="N",
                   help="requests decoded together; more wait in a queue (default: the single-wave cap "
                   "K // top_k, so that every decode step is one wave per layer)")
    b.add_argument("--context-length", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + completion (default: the model's max_position_embeddings)")
    b.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="sequences that may wait for a running place (those the free places of "
                   "--max-running-requests take at the next step do not count); beyond them requests get 429 + "
                   "Retry-After, and a request of more than N + --max-running-requests sequences 400 "
                   "(default: unbounded)")
    b.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS, metavar="TOKENS",
                   help="prompt tokens prefilled per step, in chunks packed with the running decodes; a longer "
                   "prompt takes several steps (default %(default)s; with --speculative the decodes' proposals come "
                   "on top). With --no-chunked-prefill: padded tokens "
                   "(prompts x longest prompt) of one prefill forward of its own (1 = one prompt per forward)")
    b.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill prompts in chunks inside the decode forwards (default on; --no-chunked-prefill "
                   "prefills admitted prompts in forwards of their own, before the step's decode)")
    add_graph_arguments(p.add_argument_group("CUDA graphs (decode)"),
                        max_batch_default="every decode bucket up to --max-running-requests")
    add_speculative_arguments(p)
    a = p.add_argument_group("admission")
    a.add_argument("--max-body-bytes", type=int, default=None, metavar="BYTES",
                   help="largest request body; larger ones get 413 before parsing (default: 1 MiB + 8 x the "
                   f"longest prompt text admitted, context length x {MAX_PROMPT_BYTES_PER_TOKEN} bytes)")
    a.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key; the server binds loopback)")
    a.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="close a connection whose request headers are not complete S seconds after it opened or "
                   "after its previous response (slow or idle clients; default %(default)s)")
    a.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="answer 408 and close a connection whose request body sends no byte for S seconds "
                   "(between two reads, as nginx's client_body_timeout; default %(default)s). See also --body-deadline")
    a.add_argument("--body-deadline", type=float, default=DEFAULT_BODY_DEADLINE_S, metavar="S",
                   help="answer 408 and close a connection whose request body is not complete S seconds after its "
                   "headers, however steadily it trickles in (the whole body, as Node.js's requestTimeout; "
                   "default %(default)s)")
    a.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at most; beyond them requests get 503 + Retry-After in OpenAI's error "
                   "shape, except GET /health and /metrics, which are answered while the server serves "
                   "(default %(default)s)")
    a.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM / SIGINT: new requests get 503 + Retry-After, running ones have S seconds to "
                   "finish, then each remaining stream gets a final error event and [DONE], and the process exits 0 "
                   "(a second signal ends every request at once; default 30)")
    o = p.add_argument_group("output")
    o.add_argument("--record-trace", metavar="PATH", help="record the routing trace (.npz, real request ids), saved at shutdown")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    # without the server extra this raises MissingExtra (a ValueError: one line, exit 2)
    from pagedexperts.serving.api_server import ServeConfig, run_server, single_wave_note, speculation_note
    from pagedexperts.loading.bundled import bundled_model_path

    _check_flags(args)
    speculative = speculative_from_args(args)
    check_paging_flags(args)
    apply_threads(args)
    _check_checkpoint(args)  # after every flag-only check: this is the first read of --model-path
    _check_address(args.host, args.port)  # the last check before the load
    model, tokenizer = load_from_args(args)
    if tokenizer is None:
        raise ValueError("the model directory has no tokenizer (tokenizer.json / tokenizer_config.json); add one")
    rt = model.pagedexperts
    max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    context = args.context_length if args.context_length is not None else max_positions
    if context <= 1 or (max_positions and context > max_positions):
        raise ValueError(f"--context-length must be in [2, {max_positions}] (max_position_embeddings), got {context}")
    running = args.max_running_requests if args.max_running_requests is not None else max(1, rt.num_resident // rt.top_k)
    model_dir = Path(args.model_path or bundled_model_path()).resolve()
    name = args.served_model_name or model_dir.name
    config = ServeConfig(served_model_name=name, max_running_requests=running, context_length=context,
                         model_path=str(model_dir),
                         record_trace=args.record_trace, max_queued_requests=args.max_queued_requests,
                         max_prefill_tokens=args.max_prefill_tokens, max_body_bytes=args.max_body_bytes,
                         api_key=args.api_key, shutdown_timeout_s=args.shutdown_timeout, speculative=speculative,
                         chunked_prefill=args.chunked_prefill, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, body_deadline_s=args.body_deadline,
                         max_connections=args.max_connections, cuda_graph_max_batch=args.cuda_graph_max_batch)
    print(f"pagedexperts serve: {name} on http://{args.host}:{args.port}, K={rt.num_resident} of "
          f"E={rt.num_experts}, context {context}; {single_wave_note(rt, running)}; {speculation_note(speculative)}",
          file=sys.stderr, flush=True)
    run_server(model, tokenizer, config, host=args.host, port=args.port)
    return 0


def _check_checkpoint(args) -> None:
    """What the checkpoint dir must give before it loads (ValueError naming the flag): a
    tokenizer, and --context-length within its max_position_embeddings."""
    from pagedexperts.loading.loader import has_tokenizer, read_checkpoint_config

    path, config, _ = read_checkpoint_config(args.model_path)
    if not has_tokenizer(path):
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model); "
                         "the server tokenizes prompts: add the source model's tokenizer files (--model-path)")
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if args.context_length is not None and max_positions and args.context_length > max_positions:
        raise ValueError(f"--context-length must be in [2, {max_positions}] (max_position_embeddings), "
                         f"got {args.context_length}")


def _check_address(host: str, port: int) -> None:
    """Bind ``host:port`` once, as uvicorn will (SO_REUSEADDR), so that an address in use or a
    host that is no address is refused before the model loads: uvicorn said so after the load,
    and exited 3.

    Raises:
        ValueError: names --host, --port and the system's reason.
    """
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:  # socket.gaierror too
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); choose another "
                         "--port (or stop what listens on it)") from None


def _check_flags(args) -> None:
    """Every serving flag in range before the model loads (ValueError naming the flag); 0 is a
    value to refuse, never "use the default"."""
    import os

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    if args.context_length is not None and args.context_length < 2:
        raise ValueError(f"--context-length must be >= 2, got {args.context_length}")
    for flag, value in (("--max-running-requests", args.max_running_requests),
                        ("--max-queued-requests", args.max_queued_requests),
                        ("--max-body-bytes", args.max_body_bytes), ("--max-prefill-tokens", args.max_prefill_tokens),
                        ("--max-connections", args.max_connections)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.api_key is not None and not args.api_key.strip():  # e.g. --api-key "$KEY" with KEY unset
        raise ValueError(f"--api-key {args.api_key!r} is empty: the server would run with no key; "
                         "give the key, or omit the flag for none")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError(f"--served-model-name {args.served_model_name!r} is empty; "
                         "omit the flag for the model directory's name")
    if not args.header_timeout > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {args.header_timeout}")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    if not args.body_deadline > 0:
        raise ValueError(f"--body-deadline must be > 0 seconds, got {args.body_deadline}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    parent = os.path.dirname(args.record_trace) if args.record_trace else ""
    if parent and not os.path.isdir(parent):
        raise ValueError(f"--record-trace {args.record_trace}: directory {parent} does not exist")
    if args.record_trace and os.path.isdir(args.record_trace):
        raise ValueError(f"--record-trace {args.record_trace} is a directory; give a file path")
