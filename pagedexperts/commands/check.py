"""``pagedexperts check``: the accuracy smoke test to run before trusting paging on a checkpoint.

Owns: the flags and their checks that need no checkpoint. The work is ``pagedexperts.tools.check_runs``.
"""

from __future__ import annotations

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import add_model_arguments, apply_threads, print_host_memory, utf8_text
from pagedexperts.commands.flag_lists import comma_ints


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help=COMMANDS["check"],
        description="Runs a few prompts paged (at each K given) and unpaged (plain "
        "from_pretrained, all experts resident, same experts implementation and dtype), each "
        "prompt alone and all of them as one left-padded batch, and compares every step's logits "
        "(torch.equal) and the greedy tokens. Every K is checked against [top_k, E] first. Where experts "
        "run packed (torch's CPU int4 / int8 kernels: --experts-implementation packed, or auto on a CPU for "
        "an int format) two verdicts: paged == the same kernels with all E experts resident (torch.equal), "
        "and every sampled packed matmul within a bound (from the run dtype's unit roundoff and the "
        "reduction length) of the checkpoint's weights dequantized in float32; top-1 agreement with the "
        "float32 model (the reference, every weight in float32) is printed as a rate. With "
        "--experts-implementation fused (CUDA) two comparisons per K: paged == the same kernel with all E "
        "experts resident (torch.equal), and teacher-forced logits within a stated tolerance of "
        "transformers' model (grouped_mm over its dequantized experts) with top-1 agreement with the "
        "float32 source no lower than transformers'.",
    )
    add_model_arguments(p)
    p.set_defaults(num_resident=None)
    p.add_argument(
        "--check-resident",
        default=None,
        metavar="K[,K...]",
        help="comma-separated K values to check (default: top_k and E/2); overrides --num-resident",
    )
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: 3 built-in)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy steps per prompt (default 8)")
    p.add_argument(
        "--source-model-path",
        default=None,
        help="with experts fused or packed: the float32 model the checkpoint was quantized from, for "
        "the teacher-forced top-1 comparison (default: the bundled model for --model-path bundled:FORMAT; "
        "none otherwise)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """Check the flags that need no checkpoint, then ``tools.check_runs.check_checkpoint``; its exit code."""
    from pagedexperts.tools.check import DEFAULT_PROMPTS
    from pagedexperts.tools.check_runs import CheckRequest, check_checkpoint

    check_resident = None if args.check_resident is None else comma_ints(args.check_resident, "--check-resident",
                                                                          example="4,32")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    for prompt in args.prompt or ():
        if not utf8_text(prompt, "--prompt").strip():
            raise ValueError(f"--prompt {prompt!r} is empty: check compares the logits of a prompt's tokens; give text "
                             "(or leave --prompt out: 3 built-in prompts)")
    apply_threads(args)
    options = dict(device=args.device, dtype=args.dtype, experts_implementation=args.experts_implementation,
                   policy=args.policy, slot_format=args.slot_format, prefetch=args.prefetch,
                   prefetch_budget=args.prefetch_budget, read_ahead=args.read_ahead, host_memory_gb=args.host_memory_gb,
                   decide=args.decide, beyond_k=args.beyond_k, admit_per_step=args.admit_per_step)
    request = CheckRequest(args.model_path, options, check_resident=check_resident,
                           num_resident=args.num_resident, prompts=tuple(args.prompt or DEFAULT_PROMPTS),
                           max_new_tokens=args.max_new_tokens, source_model_path=args.source_model_path)
    return check_checkpoint(request, on_paged_load=print_host_memory)
