"""Device bytes one decode token's routed experts move, per path and format (counted, not timed).

For a Qwen3-30B-A3B-shaped model (H 2048, I 768, top-8, 48 MoE layers; bfloat16) in each
format, ``analysis.fused_bytes.decode_bytes`` per layer x layers, at batch T (default 1):
the dequantizing path as it is (every one of the K packed slots dequantized each wave, counted
from its torch ops on the meta device) at K = 40 and 92, the dequantizing path once it
dequantizes only the routed slots (its least), and the fused kernels (the routed experts' packed
rows read once). Activations are left out of all (module docstring of ``fused_bytes``).

    python bench/decode_bytes.py [--tokens 1] [--layers 48] [--markdown]
"""

from __future__ import annotations

import argparse

import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
from pagedexperts.formats.compressed_tensors.fp4 import CompressedTensorsNvfp4Format
from pagedexperts.formats.compressed_tensors.fp8 import CompressedTensorsFp8Format
from pagedexperts.formats.compressed_tensors.packed import CompressedTensorsW8A16Format, PackedArgs
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
from pagedexperts.formats.gptq.gptq import GptqFormat
from pagedexperts.formats.fp8_fp4.mxfp4 import Mxfp4Format
from pagedexperts.analysis.fused_bytes import decode_bytes

H, I, TOP_K = 2048, 768, 8
bf16 = torch.bfloat16


def layouts() -> dict:
    """{name: (ExpertLayout, transposed)} at Qwen3-30B-A3B's expert shapes."""
    qwen = (TensorSpec("gate_up_proj", (2 * I, H), bf16), TensorSpec("down_proj", (H, I), bf16))
    gpt_oss = (TensorSpec("gate_up_proj", (H, 2 * I), bf16), TensorSpec("gate_up_proj_bias", (2 * I,), bf16),
               TensorSpec("down_proj", (I, H), bf16), TensorSpec("down_proj_bias", (H,), bf16))
    both = lambda a: {"gate_up_proj": a, "down_proj": a}  # noqa: E731
    formats = {
        "bf16 (dense)": DenseFormat(),
        "gptq int4 g128": GptqFormat(group_size=128, desc_act=False, zero_offset=1),
        "w4a16 int4 g128": CompressedTensorsW4A16Format(group_size=128, symmetric=True),
        "awq int4 g128": AwqFormat(group_size=128),
        "w8a16 int8 g128": CompressedTensorsW8A16Format(both(PackedArgs(8, 128, True, False))),
        "fp8-block 128x128": Fp8BlockFormat(block=(128, 128)),
        "ct-fp8 channel": CompressedTensorsFp8Format(both(("channel", None, torch.float32))),
        "nvfp4": CompressedTensorsNvfp4Format(),
    }
    out = {name: (fmt.layout(qwen, sources={"gate_up_proj": 2}), False) for name, fmt in formats.items()}
    out["mxfp4 (gpt-oss layout)"] = (Mxfp4Format().layout(gpt_oss, transposed=True), True)
    return out


def rows(tokens: int, layers: int) -> list[tuple]:
    """(format, dequantize all K=40, all K=92, routed only, fused) in bytes per token."""
    out = []
    for name, (layout, transposed) in layouts().items():
        at = {k: decode_bytes(layout, num_slots=k, top_k=TOP_K, num_tokens=tokens, transposed=transposed)
              for k in (40, 92)}
        per_token = lambda b: b * layers / tokens  # noqa: E731
        out.append((name, per_token(at[40].dequantize_ops), per_token(at[92].dequantize_ops),
                    per_token(at[40].dequantize_routed), per_token(at[40].fused)))
    return out


def human(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} KB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1, help="decode batch T (default 1)")
    p.add_argument("--layers", type=int, default=48, help="MoE layers (default 48)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    head = ("format", "dequantize all K, K=40", "K=92", "dequantize routed only", "fused")
    table = rows(a.tokens, a.layers)
    if a.markdown:
        print("| " + " | ".join(head) + " |\n| --- |" + " ---: |" * 4)
        for r in table:
            print(f"| {r[0]} | " + " | ".join(human(x) for x in r[1:]) + " |")
        return
    print(f"{head[0]:24s}" + "".join(f"{h:>26s}" for h in head[1:]))
    for r in table:
        print(f"{r[0]:24s}" + "".join(f"{human(x):>26s}" for x in r[1:]))


if __name__ == "__main__":
    main()
