"""Quantize an MoE checkpoint's routed experts with NVIDIA ModelOpt, as a user of the field would.

Run with ModelOpt's own venv (nvidia-modelopt 0.47 with transformers 5.24 and CPU torch; it
imports ``requests``, which that venv may need installed first)::

    /work/modelopt-venv/bin/python scripts/modelopt_quantize.py \
        --model-path pagedexperts/data/tiny-qwen3-moe --algo NVFP4 --output-dir /tmp/mo/nvfp4

What it does: ``modelopt.torch.quantization.quantize`` with ``NVFP4_EXPERTS_ONLY_CFG``
(``--algo NVFP4``: the routed experts' weights and inputs NVFP4, every other module left
alone) or ``FP8_DEFAULT_CFG`` with its weight and input quantizers restricted to the routed
experts the same way (``--algo FP8``: the patterns ``*.experts.*weight_quantizer`` /
``*.experts.*input_quantizer`` of ModelOpt's own experts-only NVFP4 config), calibrated
("max" algorithm: weight amax, and the per-tensor input amax of the static ``input_scale``) on
``--num-samples`` seeded random token sequences of ``--seq-len`` tokens; then
``modelopt.torch.export.export_hf_checkpoint`` writes ``--output-dir`` (config.json with
``quantization_config`` ``quant_method: modelopt``, ``hf_quant_config.json``, safetensors).
The tokenizer files of ``--model-path`` are copied beside it, and ``modelopt_quantize.json``
records the command line and versions.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

import torch

ALGOS = ("NVFP4", "FP8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="source checkpoint dir (unquantized)")
    p.add_argument("--output-dir", required=True, help="where the quantized checkpoint is written")
    p.add_argument("--algo", required=True, choices=ALGOS, help="ModelOpt quant_algo of the routed experts")
    p.add_argument("--num-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per calibration sequence (default 32)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random calibration tokens (default 1)")
    return p.parse_args(argv)


def experts_only_config(algo: str) -> dict:
    """The ModelOpt quantize config of ``algo`` with only the routed experts quantized."""
    import modelopt.torch.quantization as mtq

    if algo == "NVFP4":
        return copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    restrict = {"*weight_quantizer": "*.experts.*weight_quantizer", "*input_quantizer": "*.experts.*input_quantizer"}
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") in restrict and "cfg" in entry:
            entry["quantizer_name"] = restrict[entry["quantizer_name"]]
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    src, out = Path(args.model_path), Path(args.output_dir)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (args.num_samples, args.seq_len), generator=torch.Generator().manual_seed(args.seed))

    def forward_loop(m) -> None:
        with torch.no_grad():
            for row in ids:
                m(input_ids=row[None])

    model = mtq.quantize(model, experts_only_config(args.algo), forward_loop=forward_loop)
    shutil.rmtree(out, ignore_errors=True)
    export_hf_checkpoint(model, export_dir=out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    record = {"argv": sys.argv[1:] if argv is None else argv, "modelopt": modelopt.__version__,
              "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "modelopt_quantize.json").write_text(json.dumps(record, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
