"""``pagedexperts check``: the accuracy smoke test to run before trusting paging on a checkpoint."""

from __future__ import annotations

from pagedexperts.commands.common import add_model_arguments


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="compare paged and unpaged logits and greedy tokens; exit 1 on a mismatch",
        description="Runs a few prompts paged (at each K given) and unpaged (plain "
        "from_pretrained, all experts resident, same experts implementation and dtype) and "
        "compares every step's logits (torch.equal) and the greedy tokens.",
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
    p.set_defaults(func=run)


def run(args) -> int:
    from pagedexperts.check import DEFAULT_PROMPTS, check_model, load_reference
    from pagedexperts.loader import load_model
    from pagedexperts.models.families import num_routed_experts

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    reference = load_reference(
        args.model_path, device=args.device, dtype=args.dtype, experts_implementation=args.experts_implementation
    )
    cfg = reference.config
    top_k, num_experts = int(cfg.num_experts_per_tok), num_routed_experts(cfg)
    if args.check_resident:
        ks = [int(x) for x in args.check_resident.split(",")]
    elif args.num_resident is not None:
        ks = [args.num_resident]
    else:
        ks = [top_k, max(top_k, num_experts // 2)]
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    ok = True
    for k in ks:
        paged, tokenizer = load_model(
            args.model_path, num_resident=k, device=args.device, dtype=args.dtype,
            experts_implementation=args.experts_implementation, policy=args.policy,
            slot_format=args.slot_format,
            prefetch=args.prefetch, prefetch_budget=args.prefetch_budget, host_memory_gb=args.host_memory_gb,
        )
        res = check_model(paged, reference, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
        verdict = "PASS (bit-identical)" if res.passed else "FAIL"
        print(
            f"K={k:>4} of E={num_experts}: {len(prompts)} prompts x {args.max_new_tokens} greedy steps, "
            f"misses {res.misses}, max |logit diff| {res.max_abs_diff:.3g}, "
            f"tokens {'equal' if all(p.tokens_equal for p in res.prompts) else 'DIFFER'}: {verdict}"
        )
        ok &= res.passed
    print("verdict:", "paging is exact on this checkpoint" if ok else "MISMATCH: do not trust paging here")
    return 0 if ok else 1
