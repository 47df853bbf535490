"""Quantize a checkpoint with AutoRound or GPTQModel themselves, on CPU, as a user would.

Run with the tool's OWN venv (each pins its own transformers / torch; ``scripts/tool_fixtures.py``
lists the venvs and the exact commands). Subcommands:

- ``source FAMILY OUT``: a tiny random bfloat16 model (``qwen3_moe`` or ``mixtral``: hidden 32,
  2 layers, 8 routed experts of intermediate 32, top-2, seed 0) with the bundled tokenizer.
- ``autoround --model SRC --out DST --format F [--scheme S] [--group-size G] [--asym]
  [--experts-only]``: ``AutoRound(SRC, scheme=S, iters=0)`` (RTN, the tool's ``--iters 0``
  recipe) then ``quantize_and_save(DST, format=F)``; F in auto_round, auto_gptq, auto_awq,
  llm_compressor. AutoRound's default: every nn.Linear of the decoder blocks (attention and
  experts), not the router or lm_head.
- ``gptqmodel --model SRC --out DST --method gptq|awq|fp8 [--bits B] [--group-size G] [--asym]
  [--dynamic JSON] [--experts-only]``: ``GPTQModel.load(SRC, QuantizeConfig(...)).quantize(...)``
  then ``save(DST)``. GPTQModel's default: every decoder nn.Linear (attention and experts).
- ``cast-scales --model SRC --out DST [--dtype bfloat16]``: SRC (a checkpoint the tool wrote)
  with every ``scales`` tensor cast to ``--dtype``, nothing else changed. Neither tool writes
  bfloat16 scales here (GPTQModel and AutoRound pack float16; a GPTQModel load + save at
  bfloat16 keeps float16): published GPTQ / AutoRound checkpoints carry them when a loaded model
  was cast (``model.to(torch.bfloat16)``, which casts every floating buffer) and saved again.
- ``tool-dequant DIR``: the tool's OWN dequantization of a sample of the checkpoint's quantized
  modules (layer 1's experts 0 and 5, and its q_proj where quantized), in float32 and in the
  checkpoint's dtype, into ``DIR/tool_dequant.safetensors`` (key ``{module}@{dtype}``): the
  oracle tests/formats/test_tool_checkpoints.py compares pagedexperts' dequantization with.

``--experts-only`` keeps attention unquantized (AutoRound ``layer_config``; GPTQModel a
``dynamic`` "-:" rule): the variant whose loading needs no quantized-attention support.
Calibration: 16 windows of 128 tokens of ``--calib`` (default WikiText-2 validation). Each
output dir keeps ``tool_quantize.json`` (argv, versions, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "pagedexperts" / "data" / "tiny-qwen3-moe"
CALIB = ROOT.parent / "shared" / "data" / "corpus" / "wikitext2_valid.txt"
SAMPLE_LAYER, SAMPLE_EXPERTS = 1, (0, 5)


def write_source(family: str, out: Path) -> None:
    """The tiny random bfloat16 source model of ``family`` with the bundled tokenizer."""
    import torch
    import transformers

    common = dict(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.05,
                  tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, intermediate_size=64,
                                             norm_topk_prob=True)
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=8)
    else:
        sys.exit(f"source: unknown family {family!r}; choose qwen3_moe or mixtral")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(BUNDLED).save_pretrained(out)


def calibration(model_path: str, calib: Path, *, windows: int = 16, length: int = 128):
    """``windows`` consecutive [1, length] token id tensors of the calibration text."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path)(calib.read_text(), return_tensors="pt").input_ids[0]
    return [ids[i * length:(i + 1) * length].unsqueeze(0) for i in range(windows)]


def run_autoround(args) -> None:
    from auto_round import AutoRound

    kwargs = dict(scheme=args.scheme, iters=0, dataset=calibration(args.model, args.calib), seqlen=128, nsamples=16)
    if args.group_size is not None:
        kwargs["group_size"] = args.group_size
    if args.asym:
        kwargs["sym"] = False
    if args.experts_only:
        # act_bits 16 too: an FP8 / NVFP4 / MXFP4 scheme quantizes activations, and a 16-bit layer
        # keeping the scheme's act_bits fails ("No quantization function found for dtype=float, bits=16")
        kwargs["layer_config"] = {"self_attn": {"bits": 16, "data_type": "float", "act_bits": 16}}
    tmp = Path(str(args.out) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoRound(args.model, **kwargs).quantize_and_save(str(tmp), format=args.format)
    written = [p.parent for p in tmp.rglob("config.json")]  # AutoRound nests DST/<model>-w4g128/
    if len(written) != 1:
        sys.exit(f"autoround wrote {len(written)} checkpoints under {tmp}, expected 1")
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.move(str(written[0]), args.out)
    shutil.rmtree(tmp, ignore_errors=True)


def run_gptqmodel(args) -> None:
    os.cpu_count = lambda: 4  # GPTQModel 7.7 asks 2 CPU loader workers; a 2-core machine gives it 1 (ValueError)
    from gptqmodel import GPTQModel, QuantizeConfig

    dynamic = json.loads(args.dynamic) if args.dynamic else {}
    if args.experts_only:
        dynamic = {r"-:.*\.self_attn\..*": {}, **dynamic}
    kwargs = dict(quant_method=args.method)
    if args.bits is not None:
        kwargs["bits"] = args.bits
    if args.group_size is not None:
        kwargs["group_size"] = args.group_size
    if dynamic:
        kwargs["dynamic"] = dynamic
    if args.asym:
        kwargs["sym"] = False
    if args.method == "fp8":
        kwargs.pop("group_size", None)
    data = [{"input_ids": t[0].tolist(), "attention_mask": [1] * t.shape[1]} for t in calibration(args.model, args.calib)]
    model = GPTQModel.load(args.model, QuantizeConfig(**kwargs), device="cpu")
    model.quantize(data, batch_size=1)
    shutil.rmtree(args.out, ignore_errors=True)
    model.save(str(args.out))
    (Path(args.out) / "quant_log.csv").unlink(missing_ok=True)


def cast_scales(args) -> None:
    """Copy ``args.model`` to ``args.out`` with every ``*.scales`` tensor cast to ``args.dtype``."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(args.model, args.out, ignore=shutil.ignore_patterns("tool_dequant.safetensors"))
    dtype = getattr(torch, args.dtype)
    for path in Path(args.out).glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({k: v.to(dtype) if k.endswith(".scales") else v for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})
    record = json.loads((Path(args.model) / "tool_quantize.json").read_text())
    record["argv"] += ["+", "scripts/tool_quantize.py", *sys.argv[1:]]
    (Path(args.out) / "tool_quantize.json").write_text(json.dumps(record, indent=1) + "\n")


def record(args, tool: str, seconds: float) -> None:
    from importlib.metadata import version

    versions = {p: version(p) for p in (tool, "torch", "transformers")}
    (Path(args.out) / "tool_quantize.json").write_text(json.dumps(
        {"argv": [Path(sys.executable).parent.parent.name, "scripts/tool_quantize.py", *sys.argv[1:]],
         "versions": versions, "seconds": round(seconds, 1)}, indent=1) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("source")
    s.add_argument("family")
    s.add_argument("out", type=Path)
    for name in ("autoround", "gptqmodel"):
        q = sub.add_parser(name)
        q.add_argument("--model", required=True)
        q.add_argument("--out", required=True, type=Path)
        q.add_argument("--calib", type=Path, default=CALIB)
        q.add_argument("--group-size", type=int, default=None)
        q.add_argument("--experts-only", action="store_true")
    ar = sub.choices["autoround"]
    ar.add_argument("--format", default="auto_round")
    ar.add_argument("--scheme", default="W4A16")
    ar.add_argument("--asym", action="store_true")
    gm = sub.choices["gptqmodel"]
    gm.add_argument("--method", default="gptq", choices=("gptq", "awq", "fp8"))
    gm.add_argument("--bits", type=int, default=None)
    gm.add_argument("--asym", action="store_true", help="asymmetric zero points (QuantizeConfig sym=False)")
    gm.add_argument("--dynamic", default=None, help="GPTQModel per-module overrides, JSON {regex: {field: value}}")
    c = sub.add_parser("cast-scales")
    c.add_argument("--model", required=True, type=Path)
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--dtype", default="bfloat16")
    d = sub.add_parser("tool-dequant")
    d.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "source":
        write_source(args.family, args.out)
        return
    if args.cmd == "cast-scales":
        cast_scales(args)
        return
    if args.cmd == "tool-dequant":
        sys.path.insert(0, str(ROOT / "scripts"))
        from tool_dequant import write_tool_dequant

        write_tool_dequant(args.dir)
        return
    start = time.time()
    (run_autoround if args.cmd == "autoround" else run_gptqmodel)(args)
    record(args, "auto-round" if args.cmd == "autoround" else "gptqmodel", time.time() - start)


if __name__ == "__main__":
    main()
