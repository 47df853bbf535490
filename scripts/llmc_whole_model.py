"""Quantize a WHOLE MoE checkpoint with llm-compressor's default recipe, attention included, as
users do (``targets="Linear", ignore=["lm_head", "re:.*mlp.gate$"]``).

Run with llm-compressor's own venv (it pins its own transformers; see llmc_quantize.py)::

    /work/llmc-venv/bin/python scripts/llmc_whole_model.py --model-path pagedexperts/data/tiny-qwen3-moe \
        --scheme W4A16 --dtype bfloat16 --output-dir /tmp/q/w4a16

    /work/llmc-venv/bin/python scripts/llmc_whole_model.py --family mixtral --scheme W4A16_ASYM \
        --group-size 32 --group 're:.*w2$=16' --dtype bfloat16 --output-dir /tmp/q/mixtral

What it does: loads the source at ``--dtype`` (``--model-path``, or ``--family``: a tiny seeded
float32 model of that family, vocab 256, hidden 64, 8 routed experts of intermediate 32, top-2,
2 layers; DeepSeek-V3 with a shared expert and a dense first layer), linearizes the fused
experts (``linearize_moe``: one nn.Linear per expert), runs ``oneshot`` with
``QuantizationModifier`` (round-to-nearest) over every nn.Linear but ``lm_head`` and the routers
(attention projections, routed and shared experts, dense MLP layers), and saves compressed.

Scheme flags: ``--scheme`` (a compressed-tensors preset: W4A16, W4A16_ASYM, W8A16, W8A8, FP8,
FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, NVFP4, MXFP4A16, ...), ``--group-size N`` (every group),
``--asymmetric`` (W8A16 has no _ASYM preset), ``--group PATTERN=N`` (repeatable: modules whose
name matches the regex PATTERN in a config group of their own at group size N, written before the
``Linear`` group, as compressed-tensors gives a regex target precedence over a class name).
Calibration (static activation scales: FP8's ``input_scale``, NVFP4's ``input_global_scale``):
``--num-samples`` sequences of ``--seq-len`` random token ids drawn with ``--seed``.

After saving: ``--mixtral-names`` renames Mixtral's linearized expert keys
``gate_proj/up_proj/down_proj`` to the checkpoint names ``w1/w3/w2`` and the config's targets
with them (``gate_proj|up_proj`` -> ``w[13]``, as Mixtral recipes spell them);
``--config-dtype D`` writes D as config.json's ``dtype`` (AutoRound's exports keep float16
scales under a bfloat16 or float32 config dtype). Writes ``llmc_whole_model.json`` (argv and
versions) beside the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$"]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=128,
            initializer_range=0.1, tie_word_embeddings=False)
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="source checkpoint dir (unquantized)")
    src.add_argument("--family", choices=["qwen3_moe", "mixtral", "deepseek_v3"], help="a tiny seeded source model")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--scheme", required=True, help="compressed-tensors preset scheme (W4A16, FP8_BLOCK, NVFP4, ...)")
    p.add_argument("--group-size", type=int, default=None, help="group size of every group (default: the preset's)")
    p.add_argument("--asymmetric", action="store_true", help="asymmetric weights (zero points)")
    p.add_argument("--group", action="append", default=[], metavar="PATTERN=N",
                   help="modules matching regex PATTERN in a config group of their own at group size N")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--config-dtype", default=None, help="dtype written into config.json after saving")
    p.add_argument("--mixtral-names", action="store_true", help="rename Mixtral's linearized experts to w1/w3/w2")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def tiny_config(family: str):
    """The tiny ``family`` config (module docstring)."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    if family == "deepseek_v3":
        dims = {k: v for k, v in TINY.items() if k != "head_dim"} | {"num_key_value_heads": 4}
        return DeepseekV3Config(**dims, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**TINY, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
    return MixtralConfig(**dict(TINY, intermediate_size=32), num_local_experts=8)


def scheme_args(args) -> dict:
    """The preset's QuantizationArgs with --group-size / --asymmetric applied."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    name = args.scheme.upper()
    if name not in PRESET_SCHEMES:
        sys.exit(f"unknown --scheme {args.scheme!r}; presets: {sorted(PRESET_SCHEMES)}")
    out = {k: v.model_copy(deep=True) for k, v in PRESET_SCHEMES[name].items()}
    update = {}
    if args.group_size is not None:
        update["group_size"] = args.group_size
    if args.asymmetric:
        update["symmetric"] = False
    out["weights"] = out["weights"].model_copy(update=update)
    return out


def recipe(args):
    """QuantizationModifier: the --group regex groups first, then every other Linear."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = scheme_args(args)
    groups = {}
    for i, item in enumerate(args.group):
        pattern, _, size = item.rpartition("=")
        if not pattern or not size.isdigit():
            sys.exit(f"--group {item!r}: want PATTERN=N")
        own = dict(base, weights=base["weights"].model_copy(update={"group_size": int(size)}))
        groups[f"group_{i}"] = QuantizationScheme(targets=[f"re:{pattern}"], **own)
    groups[f"group_{len(groups)}"] = QuantizationScheme(targets=["Linear"], **base)
    return QuantizationModifier(config_groups=groups, ignore=IGNORE)


def source_model(args, tmp: Path):
    """(model at --dtype with experts linearized, its source dir)."""
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoModelForCausalLM

    src = args.model_path
    if src is None:
        torch.manual_seed(0)
        src = tmp / "src"
        AutoModelForCausalLM.from_config(tiny_config(args.family)).save_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, args.dtype))
    return linearize_moe(model), Path(src)


def rename_mixtral(dst: Path) -> None:
    """Expert keys gate_proj/up_proj/down_proj -> w1/w3/w2, and the config's targets with them."""
    from safetensors.torch import load_file, save_file

    pattern = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")
    for file in dst.glob("*.safetensors"):
        tensors = {pattern.sub(lambda m: m.group(1) + MIXTRAL_NAMES[m.group(2)] + ".", k): v
                   for k, v in load_file(file).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    text = (dst / "config.json").read_text()
    for old, new in (("(gate_proj|up_proj)", "w[13]"), ("gate_proj|up_proj", "w[13]"), ("down_proj", "w2")):
        text = text.replace(old, new)
    (dst / "config.json").write_text(text)


def _relative(arg: str) -> str:
    """A path argument relative to the repository (the record is committed beside fixtures)."""
    root = Path(__file__).resolve().parents[1]
    return str(Path(arg).relative_to(root)) if arg.startswith(str(root)) else arg


def main(argv=None) -> Path:
    args = parse_args(argv)
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot

    out = Path(args.output_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model, src = source_model(args, Path(tmp))
        kwargs = {}
        acts = scheme_args(args).get("input_activations")
        if acts is not None and acts.dynamic is not True:  # static activation scales: calibrate
            ids = torch.randint(2, model.config.vocab_size, (args.num_samples, args.seq_len),
                                generator=torch.Generator().manual_seed(args.seed))
            kwargs = dict(dataset=Dataset.from_dict({"input_ids": ids.tolist(),
                                                     "attention_mask": torch.ones_like(ids).tolist()}),
                          num_calibration_samples=args.num_samples, max_seq_length=args.seq_len)
        oneshot(model=model, recipe=recipe(args), **kwargs)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, save_compressed=True)
        for f in src.glob("tokenizer*"):
            shutil.copy(f, out / f.name)
    if args.mixtral_names:
        rename_mixtral(out)
    if args.config_dtype:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(dict(cfg, dtype=args.config_dtype), indent=2) + "\n")
    (out / "recipe.yaml").unlink(missing_ok=True)
    argv = [_relative(a) for a in (sys.argv[1:] if argv is None else argv)]
    record = {"argv": argv, "llmcompressor": llmcompressor.__version__,
              "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__}
    (out / "llmc_whole_model.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} ({args.scheme})")
    return out


if __name__ == "__main__":
    main()
