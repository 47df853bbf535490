"""``pagedexperts generate``: stream text from a paged model, then print the paging report."""

from __future__ import annotations

import json
import math
import os
import sys

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import (add_graph_arguments, add_model_arguments, apply_threads, check_paging_flags,
                                          experts_why, given, load_from_args, utf8_text)
from pagedexperts.commands.streamed_text import StreamedText
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
    g.add_argument("--prompt", help="prompt text (default: read stdin to its end; on a terminal, end it with Ctrl-D)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens, 0 = all (default 0)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least MIN_P x the most likely one's probability, 0..1 (default 0: all)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: divide the positive and multiply the negative logits of every token of the prompt and "
                   "the text so far (1 = none, default; greedy too)")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="hold end-of-sequence back until this many tokens are generated, and count a --stop string only "
                   "where it ends after their text (default 0). All sampling options mean what serve's request fields "
                   "of the same names mean")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_speculative_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--stats-json", metavar="PATH", help="write the paging report as JSON here")
    o.add_argument("--record-trace", metavar="PATH", help="record the routing trace (.npz) here")
    o.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.set_defaults(func=run)


def _check_tokenizer(model_path, max_new_tokens: int) -> None:
    """Refuse a model dir without a tokenizer before it loads (was found after the load, with the
    prompt already printed), and a --max-new-tokens that leaves the prompt no position (the exact
    check, with the prompt's tokens, is ``generation.config.check_context``'s)."""
    from pagedexperts.loading.loader import has_tokenizer, read_checkpoint_config

    path, config, _ = read_checkpoint_config(model_path)
    if not has_tokenizer(path):
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model); "
                         "generate tokenizes the prompt: add the source model's tokenizer files (--model-path)")
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if limit and max_new_tokens >= limit:  # transformers warned and generated on past the model's positions
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no position for the prompt: prompt + new tokens "
                         f"must fit the model's max_position_embeddings {limit}; lower --max-new-tokens")


def sampling_from_args(args):
    """``engine.sampling.SamplingParams`` of the sampling flags, each checked naming its flag (the
    ranges of serve's fields of the same names; ``SamplingConfig.validate`` for the shared ones).

    Raises:
        ValueError: a value out of range.
    """
    from pagedexperts.engine.sampling import SamplingParams

    if args.top_k < 0:
        raise ValueError(f"--top-k {args.top_k} must be >= 0 (0: all tokens)")
    if not 0.0 <= args.min_p <= 1.0:
        raise ValueError(f"--min-p {args.min_p} must be in [0, 1] (0: all tokens)")
    if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
        raise ValueError(f"--repetition-penalty {args.repetition_penalty} must be > 0 (1: none)")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop), top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens)
    params.validate()  # --max-new-tokens first: the --min-tokens range below is stated in it
    if not 0 <= args.min_tokens <= args.max_new_tokens:
        raise ValueError(f"--min-tokens {args.min_tokens} must be in [0, --max-new-tokens {args.max_new_tokens}]")
    return params


def read_stdin_prompt() -> str:
    """The prompt from stdin, to its end; on a terminal, first a line on stderr saying so (it
    waited silently)."""
    if sys.stdin.isatty():
        print("generate: reading the prompt from stdin; end it with Ctrl-D (or give --prompt TEXT)",
              file=sys.stderr, flush=True)
    return sys.stdin.read()


def run(args) -> int:
    from dataclasses import asdict

    from pagedexperts.generation.generate import format_report, prompt_inputs

    sampling = sampling_from_args(args)
    speculative = speculative_from_args(args)
    if speculative is not None and args.cuda_graphs == "on":
        raise ValueError("--speculative verifies through the scheduler, which has no CUDA graphs; drop --cuda-graphs")
    _check_outputs(args)
    check_paging_flags(args)  # flag-only problems before the first read of --model-path
    threads = apply_threads(args)
    _check_tokenizer(args.model_path, args.max_new_tokens)
    prompt = utf8_text(args.prompt, "--prompt") if args.prompt is not None else utf8_text(read_stdin_prompt(),
                                                                                         "the prompt on stdin")
    if not prompt.strip():
        raise ValueError("empty prompt; give --prompt TEXT or text on stdin")
    model, tokenizer = load_from_args(args)
    prompt_inputs(model, tokenizer, prompt, sampling.max_new_tokens, chat=args.chat)  # refused before it is echoed
    recorder = None
    if args.record_trace:
        from pagedexperts.analysis.recording import TraceRecorder

        name = str(model.config.name_or_path)  # a local directory by its name, a Hub id as it is
        recorder = TraceRecorder.attach(model, model_id=os.path.basename(os.path.normpath(name)) if os.path.isdir(name)
                                        else name)
        if args.prefetch:
            from pagedexperts.analysis.recording import record_predictions

            record_predictions(model, recorder)  # predictions go into the trace as an extra
    text = StreamedText()
    with text.logs_on_their_own_lines():  # a WARNING while the text is mid-line starts a line of its own
        if not args.quiet:  # --quiet: the generated text only
            text.write(prompt)
        result = _stream(model, tokenizer, prompt, sampling, speculative, chat=args.chat, on_text=text.write)
        text.write("\n")
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
        report.update(num_resident=rt.num_resident, num_experts=rt.num_experts, top_k=rt.top_k, decide=rt.decide,
                      experts_implementation=rt.resolved.experts_implementation,
                      experts_implementation_why=experts_why(rt, given(args, "experts_implementation")), beyond_k=rt.resolved.beyond_k,
                      threads=threads, resolved=rt.resolved.as_dict())
        with open(args.stats_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _stream(model, tokenizer, prompt: str, sampling, speculative, *, chat: bool, on_text):
    """The generation, its text streamed to ``on_text``: serve's sampling rule (``engine.sampling``)
    through transformers' generate, or with ``speculative`` one request through the scheduler's
    speculative decode. Returns the ``GenerationResult``."""
    import dataclasses

    from pagedexperts.engine.logits_processor import SamplingProcessor
    from pagedexperts.engine.sequence import eos_ids
    from pagedexperts.generation.generate import generate_text

    if speculative is None:
        eos = tuple(sorted(eos_ids(model, tokenizer))) if sampling.min_tokens else ()
        processor = SamplingProcessor(dataclasses.replace(sampling, eos_ids=eos))
        return generate_text(model, tokenizer, prompt, sampling, chat=chat, on_text=on_text,
                             logits_processor=processor, min_tokens=sampling.min_tokens)
    from pagedexperts.engine.generate_one import speculative_generate_text

    return speculative_generate_text(model, tokenizer, prompt, sampling, speculative, chat=chat, on_text=on_text)


def _check_outputs(args) -> None:
    """--stop strings non-empty, and --stats-json / --record-trace files in directories that exist,
    before the model loads (ValueError naming the flag)."""
    for stop in args.stop:
        utf8_text(stop, "--stop")
        if not stop:
            raise ValueError("--stop '' is empty: an empty stop string would end generation at once; drop it")
    for flag, path in (("--stats-json", args.stats_json), ("--record-trace", args.record_trace)):
        parent = os.path.dirname(path) if path else ""
        if parent and not os.path.isdir(parent):
            raise ValueError(f"{flag} {path}: directory {parent} does not exist")
        if path and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory; give a file path")
