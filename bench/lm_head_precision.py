"""Which precision for lm_head in a whole-model int4 checkpoint? Top-1 agreement with the float32 model.

Builds, from the bundled trained model (tied embeddings: lm_head untied into a copy of the
embedding matrix for the variants that quantize it), with ``quantize --format w4a16
--group-size 64``:

- ``experts``: ``--scope experts`` (attention and lm_head unquantized);
- ``model, lm_head kept``: ``--scope model`` on the tied model (lm_head is the embeddings, kept);
- ``model, lm_head int8``: ``--scope model`` on the untied copy (lm_head int8 per channel, the tool's choice);
- ``model, lm_head int4``: the same, lm_head rewritten int4 at the group size (compressed-tensors'
  own quantizer, the ``Linear`` group's scheme), as llama.cpp's Q4_0 would if it kept no 6-bit output.

Each runs paged with every expert resident (K = E), ``--experts-implementation packed`` (the
non-expert linears packed too), at ``--dtype``; teacher-forced over token windows of ``--text``
(bench/quant_agreement.py's), top-1 agreement with the float32 source (``from_pretrained``).

    .venv/bin/python bench/lm_head_precision.py --text ../shared/data/prompts/wikitext2_test.txt
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from quant_agreement import token_windows, top1  # this folder (python bench/lm_head_precision.py)

GROUP = 64  # the bundled model's down_proj takes 64 input columns


def untied_copy(src: Path, dst: Path) -> Path:
    """``src`` with lm_head.weight written as a copy of the embeddings and tie_word_embeddings off."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False), indent=2))
    return dst


def lm_head_int4(path: Path) -> Path:
    """Rewrite ``path``'s int8 lm_head in the ``Linear`` group's int4 scheme (in place)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    groups.pop("group_1")  # lm_head's own group: lm_head then falls under Linear
    scheme = QuantizationScheme(**groups["group_0"])
    tensors = load_file(path / "model.safetensors")
    weight = load_file(path.parent / "untied" / "model.safetensors")["lm_head.weight"]
    parts = weight.unflatten(-1, (weight.shape[-1] // GROUP, GROUP))
    scale, zero = calculate_qparams(parts.amin(-1), parts.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero},
                                                   scheme)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    tensors.update({f"lm_head.{k}": v.contiguous() for k, v in packed.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def variants(root: Path, source: Path) -> dict[str, Path]:
    from pagedexperts.tools.quantize import QuantizeOptions, quantize_checkpoint

    def quantize(src, name, scope):
        quantize_checkpoint(model_path=src, output=root / name, options=QuantizeOptions("w4a16", group_size=GROUP,
                                                                                         scope=scope))
        return root / name

    untied = untied_copy(source, root / "untied")
    out = {"experts": quantize(source, "experts", "experts"),
           "model, lm_head kept (tied)": quantize(source, "kept", "model"),
           "model, lm_head int8 per channel": quantize(untied, "int8", "model")}
    out["model, lm_head int4 g64"] = lm_head_int4(quantize(untied, "int4", "model"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True, help="held-out plain text")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedexperts.loading.bundled import bundled_model_path
    from pagedexperts.loading.loader import load_model

    source = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = token_windows(tokenizer, args.text, windows=args.windows, window_len=args.window_len)
    ref = top1(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), ids, args.batch)
    print(f"{ids.numel()} teacher-forced positions of {args.text}, --dtype {args.dtype}, K = E, packed")
    print(f"| checkpoint (w4a16 g{GROUP}) | top-1 agreement with float32 | positions differing |")
    print("| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in variants(Path(tmp), source).items():
            model, _ = load_model(path, num_resident=64, dtype=args.dtype, experts_implementation="packed")
            agree = top1(model.eval(), ids, args.batch) == ref
            print(f"| {name} | {agree.double().mean().item():.4f} | {int((~agree).sum())} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
