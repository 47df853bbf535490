"""Bytes of one routed expert in each expert format, from the formats' own layouts.

Pure arithmetic over ``ExpertFormat.layout`` (the specs the store and the slots hold, so the
bytes a page-in moves), for a Qwen3-MoE expert of hidden H and expert intermediate I: bf16,
block FP8, W4A16 (compressed-tensors, symmetric and asymmetric), GPTQ (with g_idx) and AWQ,
compressed-tensors FP8 (per tensor, channel, block), W8A16 and per-projection / g_idx int4, at
group size 128 (block 128 x 128). Default shape: Qwen3-30B-A3B (H 2048, I 768).

    python bench/expert_bytes.py [--hidden 2048] [--intermediate 768] [--group-size 128]
"""

from __future__ import annotations

import argparse

import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
from pagedexperts.formats.compressed_tensors.fp8 import CompressedTensorsFp8Format
from pagedexperts.formats.compressed_tensors.packed import CompressedTensorsMixedPackedFormat, CompressedTensorsW8A16Format, PackedArgs
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
from pagedexperts.formats.gptq.gptq import GptqFormat


def formats(group_size: int) -> dict:
    return {
        "bf16": DenseFormat(),
        "fp8-block 128x128": Fp8BlockFormat(block=(128, 128)),
        f"w4a16 g{group_size} symmetric": CompressedTensorsW4A16Format(group_size=group_size, symmetric=True),
        f"w4a16 g{group_size} asymmetric": CompressedTensorsW4A16Format(group_size=group_size, symmetric=False),
        f"gptq g{group_size} (g_idx)": GptqFormat(group_size=group_size, desc_act=True, zero_offset=1),
        f"awq g{group_size}": AwqFormat(group_size=group_size),
        "ct-fp8 tensor (FP8)": _ct_fp8("tensor", None),
        "ct-fp8 channel (FP8_DYNAMIC)": _ct_fp8("channel", None),
        "ct-fp8 block 128x128 (FP8_BLOCK)": _ct_fp8("block", (128, 128)),
        f"w8a16 g{group_size}": CompressedTensorsW8A16Format(_both(PackedArgs(8, group_size, True, False))),
        f"ct-pack-mixed int4 gate/up g{group_size}, down g{group_size // 2}": CompressedTensorsMixedPackedFormat(
            {"gate_up_proj": PackedArgs(4, group_size, True, False), "down_proj": PackedArgs(4, group_size // 2, True, False)}),
        f"ct-pack-mixed int4 g{group_size} + weight_g_idx": CompressedTensorsMixedPackedFormat(
            _both(PackedArgs(4, group_size, True, True))),
    }


def _both(args):
    return {"gate_up_proj": args, "down_proj": args}


def _ct_fp8(strategy, block):
    return CompressedTensorsFp8Format(_both((strategy, block, torch.float32)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--group-size", type=int, default=128)
    a = p.parse_args()
    dense = (TensorSpec("gate_up_proj", (2 * a.intermediate, a.hidden), torch.bfloat16),
             TensorSpec("down_proj", (a.hidden, a.intermediate), torch.bfloat16))
    bf16 = None
    print(f"one routed expert, H {a.hidden}, I {a.intermediate} (MB = 1e6 B)\n")
    print("| format | bytes per expert | MB | vs bf16 |\n| --- | ---: | ---: | ---: |")
    for name, fmt in formats(a.group_size).items():
        n = fmt.layout(dense, sources={"gate_up_proj": 2}).expert_bytes
        bf16 = bf16 or n
        print(f"| {name} | {n:,} | {n / 1e6:.3f} | {n / bf16:.3f}x |")


if __name__ == "__main__":
    main()
