"""The subcommands of the ``pagedexperts`` command line: one module per command.

Owns ``COMMANDS``, the registry (command name = module name -> its one-line summary), so that
``cli`` can list every command without importing any (``--help`` stays free of torch). Each
module defines ``add_parser(subparsers)``, which registers its flags and ``func``, and imports
heavy libraries (torch, transformers) only where it needs them.
"""

COMMANDS: dict[str, str] = {
    "generate": "generate text from a prompt with paged experts (the main job)",
    "check": "compare paged and unpaged logits and greedy tokens; exit 1 on a mismatch",
    "preflight": "size K, slots, KV and miss-rate bounds from a model directory or explicit numbers",
    "linkbench": "measure host-to-device copy bandwidth (GB/s), pinned and pageable",
    "simulate": "replay a routing trace through the residency policies for several K",
    "serve": "OpenAI-compatible server (completions, chat, responses, streaming, /metrics)",
    "bench": "benchmark paging against plain transformers, resident, offload and cpu-experts",
    "quantize": "round-to-nearest quantize a checkpoint's routed experts (w4a16, fp8-block, mxfp4)",
}
