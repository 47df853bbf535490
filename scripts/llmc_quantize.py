"""Quantize an MoE checkpoint's routed experts with llm-compressor, as a user of the field would.

Run with llm-compressor's own venv (it pins its own transformers)::

    /work/llmc-venv/bin/python scripts/llmc_quantize.py \
        --model-path pagedexperts/data/tiny-qwen3-moe --scheme FP8_DYNAMIC --output-dir /tmp/q/fp8d

What it does: ``oneshot`` + ``QuantizationModifier`` (round-to-nearest: no GPTQ/AWQ) in one of
llm-compressor's preset schemes (``--scheme``: W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC,
FP8_BLOCK, NVFP4A16, NVFP4, MXFP4A16, ... any name in compressed-tensors' ``PRESET_SCHEMES``),
targeting only the routed experts' projections: attention, the router, lm_head and shared
experts stay unquantized. The loaded model's fused [E, ...] experts are linearized with
llm-compressor's ``linearize_moe`` (one nn.Linear per expert, so each expert gets its own
scales; its ``load_quantizable_moe`` needs torchvision to scan transformers' modules) and saved
compressed with ``save_pretrained(save_compressed=True)``.

Calibration: schemes with static activation scales (FP8's ``input_scale``, NVFP4's
``input_global_scale``) need data; ``--calib-text FILE`` (default: none -> a few fixed token
sequences drawn with ``--seed``) is tokenized into ``--num-samples`` sequences of ``--seq-len``
tokens. Weight-only schemes ignore the data (round-to-nearest).

``--group-size-override PROJ=N`` (repeatable, e.g. ``down_proj=64``): write that projection in a
config group of its own with ``group_size`` N (the recipes' answer when down_proj's input is
not a multiple of 128). The other projections keep the preset's group size, unless
``--group-size N`` sets it for all.

Writes ``--output-dir`` (config.json with ``quantization_config``, safetensors, tokenizer) and
``llmc_quantize.json`` there (the command line and versions: the record of how it was written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Module names (llm-compressor ``ignore`` syntax) that stay unquantized: everything but the
# routed experts' projections. The experts' own Linear modules are ``...mlp.experts.{j}.*``.
ROUTED_EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="source checkpoint dir (unquantized)")
    p.add_argument("--output-dir", required=True, help="where the quantized checkpoint is written")
    p.add_argument("--scheme", required=True, help="llm-compressor preset scheme name (W4A16, FP8_BLOCK, NVFP4, ...)")
    p.add_argument("--group-size", type=int, default=None,
                   help="group size for every routed-expert projection (default: the preset's)")
    p.add_argument("--group-size-override", action="append", default=[], metavar="PROJ=N",
                   help="a projection (gate_proj, up_proj, down_proj, w1, w2, w3) in its own config group with group size N")
    p.add_argument("--dtype", default=None, help="load dtype (default: the checkpoint's own)")
    p.add_argument("--calib-text", default=None, help="plain-text file for calibration (static activation scales)")
    p.add_argument("--num-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per calibration sequence (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random calibration tokens without --calib-text")
    return p.parse_args(argv)


def preset_args(scheme: str) -> dict:
    """The preset scheme as a dict of QuantizationArgs (weights, input_activations, ...).

    Raises:
        SystemExit: an unknown preset name (lists the known ones).
    """
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    name = scheme.upper()
    if name not in PRESET_SCHEMES:
        sys.exit(f"unknown --scheme {scheme!r}; llm-compressor presets: {sorted(PRESET_SCHEMES)}")
    return {k: v.model_copy(deep=True) for k, v in PRESET_SCHEMES[name].items()}


def with_group_size(args: dict, group_size: int | None) -> dict:
    """``args`` with the weights' group size replaced (group strategies only)."""
    if group_size is None:
        return args
    weights = args["weights"]
    if weights.group_size is None:
        sys.exit(f"--group-size {group_size}: the scheme's weights have strategy {weights.strategy!r}, no group size")
    out = dict(args)
    out["weights"] = weights.model_copy(update={"group_size": group_size})
    return out


def build_config_groups(scheme: str, group_size: int | None, overrides: list[str]) -> dict:
    """config_groups for QuantizationModifier: the routed experts' projections in the preset
    scheme, each ``--group-size-override`` projection in a group of its own.

    Raises:
        SystemExit: a malformed override or unknown projection name.
    """
    from compressed_tensors.quantization import QuantizationScheme

    base = with_group_size(preset_args(scheme), group_size)
    own: dict[str, int] = {}
    for item in overrides:
        proj, _, size = item.partition("=")
        if proj not in PROJECTIONS or not size.isdigit():
            sys.exit(f"--group-size-override {item!r}: want PROJ=N with PROJ in {PROJECTIONS}")
        own[proj] = int(size)
    rest = [p for p in PROJECTIONS if p not in own]
    groups = {"group_0": QuantizationScheme(
        targets=[rf"re:.*mlp\.experts\.\d+\.({'|'.join(rest)})$"], **base)}
    for i, (proj, size) in enumerate(sorted(own.items()), start=1):
        groups[f"group_{i}"] = QuantizationScheme(
            targets=[rf"re:.*mlp\.experts\.\d+\.{proj}$"], **with_group_size(preset_args(scheme), size))
    return groups


def calibration_dataset(tokenizer, *, text_path: str | None, num_samples: int, seq_len: int, seed: int, vocab: int):
    """A ``datasets.Dataset`` of ``num_samples`` sequences of ``seq_len`` token ids."""
    from datasets import Dataset

    if text_path:
        ids = tokenizer(Path(text_path).read_text(), return_tensors="pt").input_ids[0]
        if ids.numel() < num_samples * seq_len:
            sys.exit(f"--calib-text {text_path}: {ids.numel()} tokens < --num-samples x --seq-len")
        rows = ids[: num_samples * seq_len].view(num_samples, seq_len)
    else:
        rows = torch.randint(0, vocab, (num_samples, seq_len), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import compressed_tensors
    import llmcompressor
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    groups = build_config_groups(args.scheme, args.group_size, args.group_size_override)
    dtype = getattr(torch, args.dtype) if args.dtype else "auto"
    model = linearize_moe(AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    data = calibration_dataset(tokenizer, text_path=args.calib_text, num_samples=args.num_samples,
                               seq_len=args.seq_len, seed=args.seed, vocab=model.config.vocab_size)
    recipe = QuantizationModifier(config_groups=groups)
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=args.num_samples,
            max_seq_length=args.seq_len)
    out = Path(args.output_dir)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    record = {"argv": sys.argv[1:] if argv is None else argv, "llmcompressor": llmcompressor.__version__,
              "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__}
    (out / "llmc_quantize.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} ({args.scheme})")


if __name__ == "__main__":
    main()
