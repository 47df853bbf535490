"""``pagedexperts generate``: stream text from a paged model, then print the paging report."""

from __future__ import annotations

import json
import os
import sys

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import (add_graph_arguments, add_model_arguments, apply_threads, check_paging_flags,
                                          load_from_args)
from pagedexperts.commands.speculative_flags import add_speculative_arguments, speculative_from_args


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help=COMMANDS["generate"],
        description="Generate text with K of E experts per MoE layer resident; streams the text, "
        "then prints a paging report (hit rate, misses and bytes per token, waves, TTFT, tok/s).",
    )
    add_model_arguments(p)
    add_graph_arguments(p.add_argument_group("CUDA graphs (decode)"))
    g = p.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_speculative_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--stats-json", metavar="PATH", help="write the paging report as JSON here")
    o.add_argument("--record-trace", metavar="PATH", help="record the routing trace (.npz) here")
    o.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.set_defaults(func=run)


def _check_tokenizer(model_path) -> None:
    """Refuse a model dir without a tokenizer before it loads (was found after the load, with the
    prompt already printed)."""
    from pagedexperts.loading.loader import has_tokenizer, read_checkpoint_config

    path, _, _ = read_checkpoint_config(model_path)
    if not has_tokenizer(path):
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model); "
                         "generate tokenizes the prompt: add the source model's tokenizer files (--model-path)")


def run(args) -> int:
    from dataclasses import asdict

    from pagedexperts.generation.config import SamplingConfig
    from pagedexperts.generation.generate import format_report, generate_text

    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    sampling.validate()
    speculative = speculative_from_args(args)
    if speculative is not None and args.cuda_graphs == "on":
        raise ValueError("--speculative verifies through the scheduler, which has no CUDA graphs; drop --cuda-graphs")
    _check_outputs(args)
    check_paging_flags(args)  # flag-only problems before the first read of --model-path
    apply_threads(args)
    _check_tokenizer(args.model_path)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt; give --prompt TEXT or text on stdin")
    model, tokenizer = load_from_args(args)
    recorder = None
    if args.record_trace:
        from pagedexperts.analysis.recording import TraceRecorder

        recorder = TraceRecorder.attach(model)
        if args.prefetch:
            from pagedexperts.analysis.recording import record_predictions

            record_predictions(model, recorder)  # predictions go into the trace as an extra
    print(prompt, end="", flush=True)
    def on_text(text: str) -> None:
        print(text, end="", flush=True)

    if speculative is None:
        result = generate_text(model, tokenizer, prompt, sampling, chat=args.chat, on_text=on_text)
    else:  # one request through the scheduler's speculative decode
        from pagedexperts.engine.generate_one import speculative_generate_text

        result = speculative_generate_text(model, tokenizer, prompt, sampling, speculative, chat=args.chat,
                                           on_text=on_text)
    print(flush=True)
    rt = model.pagedexperts
    if recorder is not None:
        recorder.save(args.record_trace)
    if not args.quiet:
        print(format_report(result, num_resident=rt.num_resident, num_experts=rt.num_experts, top_k=rt.top_k,
                            decide=rt.decide), file=sys.stderr)
        if args.prefetch:
            t = rt.prefetch_stats()["total"]
            print(f"  prefetch: issued {t['issued']}, used {t['used']}, wasted {t['wasted']}", file=sys.stderr)
    if args.stats_json:
        report = asdict(result)
        report.update(num_resident=rt.num_resident, num_experts=rt.num_experts, top_k=rt.top_k, decide=rt.decide)
        with open(args.stats_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _check_outputs(args) -> None:
    """--stop strings non-empty, and --stats-json / --record-trace files in directories that exist,
    before the model loads (ValueError naming the flag)."""
    for stop in args.stop:
        if not stop:
            raise ValueError("--stop '' is empty: an empty stop string would end generation at once; drop it")
    for flag, path in (("--stats-json", args.stats_json), ("--record-trace", args.record_trace)):
        parent = os.path.dirname(path) if path else ""
        if parent and not os.path.isdir(parent):
            raise ValueError(f"{flag} {path}: directory {parent} does not exist")
        if path and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory; give a file path")
