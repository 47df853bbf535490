"""The speculative-decoding flags of ``generate`` and ``serve`` (``--speculative`` and its options).

Owns the argparse group only; the checks are ``engine.speculative.config.speculative_config``'s.
"""

from __future__ import annotations

METHODS = ("ngram", "draft")  # = engine.speculative.config.METHODS (not imported here: torch)
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # = engine.speculative.config.DEFAULT_NUM_SPECULATIVE_TOKENS


def add_speculative_arguments(parser) -> None:
    """--speculative, --draft-model-path, --num-speculative-tokens."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=METHODS, default=None,
                   help="propose tokens and verify them in one forward of the paged model: ngram = prompt lookup "
                   "(the tokens that followed the latest earlier occurrence of the last 3..1 tokens; no extra model), "
                   "draft = a smaller checkpoint with the same tokenizer (--draft-model-path). Greedy output is "
                   "unchanged; sampling keeps the model's distribution. In serve every step's decodes verify, with "
                   "chunked prefill on or off (default: off)")
    g.add_argument("--draft-model-path", default=None, metavar="DIR",
                   help="the draft checkpoint of --speculative draft (loaded whole, unpaged, on --device)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                   help=f"tokens proposed per request per verification step, 1..32 (default "
                   f"{DEFAULT_NUM_SPECULATIVE_TOKENS}); a step routes N + 1 tokens per request")


def speculative_from_args(args):
    """The SpeculativeConfig of the flags, or None (ValueError naming the flag, before loading;
    a draft's vocabulary size is compared with --model-path's config.json here too)."""
    from pagedexperts.engine.speculative.config import speculative_config

    spec = speculative_config(args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                              draft_model_path=args.draft_model_path)
    if spec is not None and spec.draft_model_path is not None:
        from pagedexperts.loading.loader import read_checkpoint_config
        from pagedexperts.engine.speculative.draft import check_draft_config

        check_draft_config(spec.draft_model_path, read_checkpoint_config(args.model_path)[1])
    return spec
