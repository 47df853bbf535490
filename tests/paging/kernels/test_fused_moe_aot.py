"""Every fused MoE kernel compiles ahead of time for sm_80, sm_89 and sm_90, every format, no GPU.

Shapes: the bundled model's (hidden 128, moe intermediate 64, 64 experts, top-4, float32:
``pagedexperts/data/tiny-qwen3-moe/config.json``; K = 4) and Qwen3-30B-A3B's (hidden 2048,
moe intermediate 768, 128 experts, top-8, bfloat16; K = 40 and 92), each format bound with the
parameters its published checkpoints use (group 128, or the intermediate size when smaller;
block 128 x 128). The launches are built by the same functions the runtime launches with
(``fused_moe.gemm_launch`` / ``dequantize_launch``), so what compiles here is what runs.
Each compile prints its registers and spill bytes per thread. Triton caches the compiles on
disk. The default run compiles the GEMM at Qwen3-30B-A3B's decode shape for every format on
sm_90 and one format per weight kind (dense, int4, FP8, FP4) on sm_80 and sm_89, and the
alignment kernels at that shape; the full matrix (every format on every arch, prefill tiles,
the bundled shapes, the dequantize kernel) is marked slow (about 1 s a compile on a quiet
core; Triton's disk cache makes reruns fast).
"""

from __future__ import annotations

import pytest
import torch

from support.fused_fixtures import FormatCase
from pagedexperts.formats.gptq.autoround import AutoRoundFormat
from pagedexperts.formats.gptq.autoround_fp import AutoRoundFp8Format, AutoRoundMxfp4Format, AutoRoundNvfp4Format
from pagedexperts.formats.gptq.awq import AwqFormat
from pagedexperts.formats.compressed_tensors.w4a16 import CompressedTensorsW4A16Format
from pagedexperts.formats.compressed_tensors.fp4 import CompressedTensorsMxfp4Format, CompressedTensorsNvfp4Format
from pagedexperts.formats.compressed_tensors.fp8 import CompressedTensorsFp8Format
from pagedexperts.formats.compressed_tensors.int8 import CompressedTensorsInt8Format
from pagedexperts.formats.compressed_tensors.packed import CompressedTensorsMixedPackedFormat, CompressedTensorsW8A16Format, PackedArgs
from pagedexperts.formats.dense import DenseFormat
from pagedexperts.formats.fp8_fp4.fp8_block import Fp8BlockFormat
from pagedexperts.formats.gptq.gptq import GptqFormat
from pagedexperts.formats.gptq.gptqmodel_fp8 import GptqModelFp8Format
from pagedexperts.formats.fp8_fp4.int8_block import Int8BlockFormat
from pagedexperts.formats.fp8_fp4.modelopt import ModelOptFp8Format, ModelOptNvfp4Format
from pagedexperts.formats.fp8_fp4.mxfp4 import Mxfp4Format
from pagedexperts.paging.kernels import HAVE_TRITON
from support import bundled

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")

ARCHS = (80, 89, 90)
# name -> (hidden, moe intermediate, experts, top_k, slots K, dtype)
SHAPES = {
    "bundled": (bundled.HIDDEN, bundled.MOE_INTERMEDIATE, bundled.E, bundled.TOP_K, (bundled.TOP_K,), torch.float32),
    "qwen3-30b-a3b": (2048, 768, 128, 8, (40, 92), torch.bfloat16),
}
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8"}


def formats(group: int) -> dict[str, tuple]:
    """name -> (format, transposed) with a published checkpoint's parameters; ``group`` the group size."""
    f32, bf16 = torch.float32, torch.bfloat16
    fp8 = lambda strategy, block, dtype: CompressedTensorsFp8Format(  # noqa: E731
        {"gate_up_proj": (strategy, block, dtype), "down_proj": (strategy, block, dtype)})
    packed = lambda bits, g, sym, act: {"gate_up_proj": PackedArgs(bits, g, sym, act),  # noqa: E731
                                        "down_proj": PackedArgs(bits, g, sym, act)}
    return {
        "dense": (DenseFormat(), False), "dense-gpt-oss": (DenseFormat(), True),
        "fp8-block": (Fp8BlockFormat(block=(128, 128)), False), "int8-block": (Int8BlockFormat(block=(128, 128)), False),
        "ct-fp8-tensor": (fp8("tensor", None, f32), False), "ct-fp8-channel": (fp8("channel", None, bf16), False),
        "ct-fp8-block": (fp8("block", (128, 128), f32), False), "ct-mxfp8": (fp8("group", (1, 32), torch.uint8), False),
        "w8a8-int8": (CompressedTensorsInt8Format(scale_dtype=bf16), False),
        "w4a16": (CompressedTensorsW4A16Format(group_size=group, symmetric=True, scale_dtype=bf16), False),
        "w4a16-asym": (CompressedTensorsW4A16Format(group_size=group, symmetric=False, scale_dtype=bf16), False),
        "w8a16": (CompressedTensorsW8A16Format(packed(8, None, True, False), scale_dtype=bf16), False),
        "ct-pack-mixed-g_idx": (CompressedTensorsMixedPackedFormat(packed(4, group, False, True), scale_dtype=bf16), False),
        "gptq": (GptqFormat(group_size=group, desc_act=False, zero_offset=1), False),
        "gptq-act-order": (GptqFormat(group_size=group, desc_act=True, zero_offset=1), False),
        "auto-round": (AutoRoundFormat(bits=4, group_size=group, zero_offset=1), False),
        "awq": (AwqFormat(group_size=group), False),
        "nvfp4": (CompressedTensorsNvfp4Format(), False), "ct-mxfp4": (CompressedTensorsMxfp4Format(), False),
        "modelopt-nvfp4": (ModelOptNvfp4Format(bf16), False), "modelopt-fp8": (ModelOptFp8Format(bf16), False),
        "mxfp4-gpt-oss": (Mxfp4Format(), True),
        "auto-round-fp8-channel": (AutoRoundFp8Format({"gate_up_proj": ("channel", None, bf16),
                                                       "down_proj": ("channel", None, bf16)}), False),
        "auto-round-fp8-block": (AutoRoundFp8Format({"gate_up_proj": ("block", (128, 128), bf16),
                                                     "down_proj": ("block", (128, 128), bf16)}, block_scales=True), False),
        "auto-round-nvfp4": (AutoRoundNvfp4Format(static_input=True), False),
        "auto-round-mxfp4": (AutoRoundMxfp4Format(), False),
        "gptqmodel-fp8": (GptqModelFp8Format(), False),
    }


FORMAT_NAMES = list(formats(128))


def case_for(name: str, shape: str) -> FormatCase:
    hidden, inter, _, _, _, dtype = SHAPES[shape]
    fmt, transposed = formats(min(128, inter))[name]
    return FormatCase(name, fmt, dtype, transposed=transposed, hidden=hidden, intermediate=inter)


def specialised(kernel, launch) -> tuple[dict, dict]:
    """(signature of every argument in the kernel's order, constexprs) of a launch as Triton's
    launcher specialises it: ints equal to 1 become constexprs, 16-byte aligned pointers and
    ints that are multiples of 16 are hinted ":16", the rest typed ("*bf16", "i32"); a tuple
    argument (the role tables, the row geometry) is typed leaf by leaf, its constexprs keyed by
    their path (argument index, element index, ...)."""
    constexprs = dict(launch.constexprs)

    def typed(value, path):
        if isinstance(value, tuple):
            return tuple(typed(v, path + (i,)) for i, v in enumerate(value))
        if isinstance(value, torch.Tensor):
            return "*" + TRITON_TYPES[value.dtype] + (":16" if value.data_ptr() % 16 == 0 else "")
        if value == 1:
            constexprs[path if len(path) > 1 else kernel.arg_names[path[0]]] = 1
            return "constexpr"
        return ("i32" if abs(value) < 2**31 else "i64") + (":16" if value % 16 == 0 else "")

    types = {name: typed(v, (kernel.arg_names.index(name),)) for name, v in launch.args.items()}
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}, constexprs


def gemm_launches(case: FormatCase, num_tokens: int, arch: int):
    """The decode (or prefill) GEMM launches of both projections of ``case`` on sm_``arch``,
    over two-row zero tables of every packed tensor (real tensors: their dtypes and alignment)."""
    from pagedexperts.paging.kernels.fused_align import Alignment
    from pagedexperts.paging.kernels.fused_moe import (KernelTarget, ProjectionRows, block_m_for, choose_blocks,
                                                       gemm_launch)

    _, _, _, top_k, _, _ = next(s for s in SHAPES.values() if s[0] == case.hidden)
    entries = num_tokens * top_k
    index = torch.zeros(1, dtype=torch.int32)
    alignment = Alignment(index, index, index, block_m_for(entries), entries)
    for tensor in (t for t in case.layout().tensors if t.dense.name in ("gate_up_proj", "down_proj")):
        packing = case.fmt.packing(tensor, transposed=case.transposed)
        tables = {spec.name: torch.zeros((2, *spec.shape), dtype=spec.dtype) for _, spec in packing.tensors}
        bias = torch.zeros(2, packing.out_features, dtype=case.dtype) if case.transposed else None
        rows = ProjectionRows.from_tables(packing, tables, bias=bias)
        a = torch.zeros(1, packing.in_features, dtype=case.dtype)
        c = torch.zeros(1, packing.out_features, dtype=packing.dense_dtype)
        yield tensor.dense.name, gemm_launch(a, c, rows, alignment, a_row_div=top_k, blocks=choose_blocks(entries, packing),
                                             target=KernelTarget(arch))


def compile_launch(kernel, launch, arch: int, what: str) -> None:
    from support.aot_compile import compile_for_arch

    sig, constexprs = specialised(kernel, launch)
    info = compile_for_arch(kernel, signature=sig, constexprs=constexprs, arch=arch, num_warps=launch.num_warps,
                            num_stages=launch.num_stages)
    print(f"AOT {what} sm_{arch}: {info.n_regs} registers, {info.n_spills} spill bytes")
    assert info.n_regs > 0 and info.arch == arch


def _gemm(name: str, shape: str, arch: int, num_tokens: int) -> None:
    from pagedexperts.paging.kernels.fused_moe_kernel import fused_moe_gemm_kernel

    for proj, launch in gemm_launches(case_for(name, shape), num_tokens, arch):
        tiles = "BM{BLOCK_M} BOUT{BLOCK_OUT} BIN{BLOCK_IN}".format(**launch.constexprs)
        compile_launch(fused_moe_gemm_kernel, launch, arch, f"gemm {name} {shape} {proj} T={num_tokens} {tiles}")


# the default run: every format for sm_90, one format per weight kind for sm_80 and sm_89
EVERY_ARCH = ("dense", "gptq", "fp8-block", "nvfp4")
DECODE = [pytest.param(n, a, marks=() if a == 90 or n in EVERY_ARCH else pytest.mark.slow)
          for n in FORMAT_NAMES for a in ARCHS]


@pytest.mark.parametrize("name,arch", DECODE)
def test_gemm_compiles_at_qwen3_decode(name, arch):
    _gemm(name, "qwen3-30b-a3b", arch, 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_gemm_compiles_at_prefill_and_bundled_shapes(name, arch):
    _gemm(name, "qwen3-30b-a3b", arch, 512)
    _gemm(name, "bundled", arch, 1)
    _gemm(name, "bundled", arch, 512)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_dequantize_kernel_compiles(name, arch):
    from pagedexperts.paging.kernels.fused_moe import KernelTarget, ProjectionRows, dequantize_launch
    from pagedexperts.paging.kernels.fused_moe_kernel import dequantize_kernel

    case = case_for(name, "qwen3-30b-a3b")
    for tensor in (t for t in case.layout().tensors if t.dense.name in ("gate_up_proj", "down_proj")):
        packing = case.fmt.packing(tensor, transposed=case.transposed)
        tables = {spec.name: torch.zeros((2, *spec.shape), dtype=spec.dtype) for _, spec in packing.tensors}
        rows = ProjectionRows.from_tables(packing, tables)
        out = torch.zeros(1, dtype=packing.dense_dtype)
        launch = dequantize_launch(out, rows, torch.zeros(1, dtype=torch.int64), target=KernelTarget(arch))
        compile_launch(dequantize_kernel, launch, arch, f"dequantize {name} {tensor.dense.name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [pytest.param("bundled", marks=pytest.mark.slow), "qwen3-30b-a3b"])
def test_align_kernels_compile(shape, arch):
    from pagedexperts.paging.kernels.fused_align import (HISTOGRAM_BLOCK, SCATTER_BLOCK, align_count_kernel,
                                                         align_scatter_kernel)
    from pagedexperts.paging.kernels.fused_moe import Launch, block_m_for
    import triton

    _, _, experts, top_k, slots, _ = SHAPES[shape]
    i32, i64 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    for num_slots in slots:
        rows = num_slots + experts  # K slot rows then E host rows
        for num_tokens in (1, 512):
            block_m = block_m_for(num_tokens * top_k)
            count = Launch((1,), dict(ids_ptr=i64, counts_ptr=i32, starts_ptr=i32, num_padded_ptr=i32,
                                      num_entries=num_tokens * top_k, num_rows=rows),
                           dict(BLOCK_M=block_m, R_BLOCK=triton.next_power_of_2(rows + 1), BLOCK_S=HISTOGRAM_BLOCK), 4, 1)
            scatter = Launch((rows,), dict(ids_ptr=i64, counts_ptr=i32, starts_ptr=i32, sorted_ptr=i32,
                                           block_row_ptr=i32, num_entries=num_tokens * top_k),
                             dict(BLOCK_M=block_m, BLOCK_S=SCATTER_BLOCK), 4, 1)
            compile_launch(align_count_kernel, count, arch, f"align_count {shape} K={num_slots} R={rows} T={num_tokens}")
            compile_launch(align_scatter_kernel, scatter, arch, f"align_scatter {shape} K={num_slots} T={num_tokens}")
