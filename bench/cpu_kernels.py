"""Which torch-shipped CPU kernel should compute int4 experts, int4 non-expert linears and int8
checkpoints (issue 45 item 4): one markdown table from one run.

Routes (each a kernel in the torch CPU wheel, nothing built at run time), computing y = x @ W^T
for x bf16 [M, K] and W [N, K]:

- ``bf16 linear``, ``fp32 linear``: ``F.linear`` over the dequantized weight (oneDNN brgemm).
- ``int4pack gG``: ``aten._weight_int4pack_mm_for_cpu`` (int4 codes, group scale and float zero
  point per G columns, bf16 x; today's packed path, ``formats/cpu_pack.py``); ``fp32 x``: the
  same kernel with float32 x and scales.
- ``int8pack``: ``aten._weight_int8pack_mm`` (per-channel int8 weight, bf16 x).
- ``fbgemm dynamic``: ``quantized.linear_dynamic`` over ``quantized.linear_prepack`` (engine
  x86): int8 x int8, the activation quantized per TENSOR inside the op (float32 in, out).
- ``_int_mm rows``: ``aten._int_mm`` (int8 x int8 -> int32, oneDNN gemm) with the activation
  quantized per row (symmetric, amax / 127) and rescaled in torch ops.
- ``onednn qlinear rows``: ``onednn.qlinear_pointwise`` over ``onednn.qlinear_prepack``
  (brgemm, AMX-INT8 where present), x quantized per row in torch ops, x scale 1, weight scales
  in the op, fp32 out times the row scale.
- ``_int_mm groups`` / ``onednn groups``: int4 codes (q - z) held as int8 and the activation
  quantized per (row, group): one integer matmul of the block-diagonal [M * G, K] activation,
  then the group scales applied and summed over G in fp32 (the format's arithmetic, as Q4_0 x
  Q8 dots in llama.cpp, exact in the weight).
- ``dyn_quant 4bit``: ``aten._dyn_quant_matmul_4bit`` (KleidiAI on Arm; on x86 a scalar
  reference loop, per-row asymmetric int8 activation; float32 only for groups), M = 1 only.

int8 routes fed from an int4 format requantize its dequantized weight per channel (amax / 127:
the page-in conversion); ``rel err int8`` feeds them a per-channel int8 checkpoint instead.

Measured per shape (Qwen3-30B-A3B: experts gate_up [1536, 2048], down [2048, 768]; attention q
[4096, 2048] (= lm_head [4096, 2048]), k and v [512, 2048], o [2048, 4096]; lm_head [151936,
2048] at M = 1 and 8): CPU time (``time.process_time``) per matmul, COLD (each storage rotated
over >= ``--cold-mib`` of distinct copies, one cursor per storage across the routes sharing it)
and warm (one copy), routes interleaved in ``--rounds`` rounds (order rotated), median and
[min-max]; the route's own quantize + rescale ops alone (warm, M = 1 / 128); weight bytes; the
one-off conversion of one matrix from int4 codes + group scales (``formats/cpu_pack.py``'s
IntGroups) into the route's layout; whether that layout is a plain tensor (storable, copyable
into a [K, ...] slot row) or opaque; relative Frobenius error against float32 ``x @ W_deq^T``
on normal x and on x with 4 columns 50x larger; row independence (rows of an M = 8 call equal
M = 1 calls and the first 8 rows of an M = 128 call, torch.equal) and thread invariance (1 vs
2 threads, torch.equal). Then the matmul CPU ms of a decode token of a 4-layer
Qwen3-30B-A3B-shaped model (per layer q, k, v, o and 8 x (gate_up + down), plus lm_head [4096,
2048]) per configuration, from the cold M = 1 medians.

    python bench/cpu_kernels.py [--rounds 5] [--cold-mib 1024] [--shapes gate_up,down,...]
        [--rows 1,2,8,128] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

OUTLIER_COLUMNS = 4  # columns of x scaled by OUTLIER_FACTOR
OUTLIER_FACTOR = 50.0
INT4_OFFSET = 8  # symmetric int4: codes 0..15, zero point 8 (the int4 kernel reads q - 8)
SAMPLE_S = 0.03  # CPU seconds per timed sample (at least 2 calls)


@dataclass(frozen=True)
class Shape:
    """One weight [N, K] (``out_features``, ``in_features``) and the row counts M to time."""

    name: str
    out_features: int
    in_features: int
    rows: tuple[int, ...] = (1, 2, 8, 128)
    two_threads: bool = False  # also time a few routes at 2 threads


SHAPES = (
    Shape("gate_up", 1536, 2048, two_threads=True),
    Shape("down", 2048, 768),
    Shape("q", 4096, 2048, two_threads=True),
    Shape("kv", 512, 2048),
    Shape("o", 2048, 4096),
    Shape("lm_head", 151936, 2048, rows=(1, 8)),
)


@dataclass
class IntWeight:
    """A quantized weight as a format holds it: ``codes`` [N, K] (int4: uint8 0..15; int8: int8),
    ``scales`` fp32 [N, G] and ``zeros`` [N, G] (int4: 8; int8: 0), ``group_size`` (K: per channel)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: (q - z) * s per group."""
        q = (self.codes.to(torch.float32) - self.zeros.to(torch.float32).repeat_interleave(self.group_size, 1))
        return q * self.scales.repeat_interleave(self.group_size, 1)


def quantize_int4(w: torch.Tensor, group_size: int) -> IntWeight:
    """Symmetric int4 per group (scale amax / 7, zero point 8), as ``quantize --format w4a16``."""
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    scales = g.abs().amax(-1).clamp_min(1e-8) / 7
    codes = (torch.round(g / scales[..., None]).clamp(-8, 7) + INT4_OFFSET).to(torch.uint8).view(n, k)
    return IntWeight(codes, scales, torch.full_like(scales, INT4_OFFSET, dtype=torch.uint8), group_size)


def quantize_int8(w: torch.Tensor) -> IntWeight:
    """Symmetric per-channel int8 (scale amax / 127): an int8 checkpoint, or an int4 weight's
    page-in requantization when ``w`` is its dequantized weight."""
    scales = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
    codes = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return IntWeight(codes, scales, torch.zeros_like(scales, dtype=torch.int8), w.shape[1])


# -- the routes' prepared weights ---------------------------------------------------------------


def prep_float(w: IntWeight, dtype) -> dict:
    return {"w": w.dequantize().to(dtype)}


def prep_int4pack(w: IntWeight, dtype=torch.bfloat16) -> dict:
    """``formats/cpu_pack.py``'s conversion: uint8 [N, K/2] and [K/g, N, 2] (scale, (8 - z) s)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
    zeros = (INT4_OFFSET - w.zeros.to(torch.float32)) * w.scales
    pair = torch.stack([w.scales, zeros], dim=-1).to(dtype).transpose(0, 1).contiguous()
    return {"w": packed, "sz": pair, "g": w.group_size}


def prep_int8(w: IntWeight) -> dict:
    """Plain int8 [N, K] with per-channel scales (int8pack, _int_mm); an int4 weight is
    requantized per channel first. ``gs``: [G, N] group scales (groups routes) or None."""
    if w.codes.dtype != torch.int8:
        w = quantize_int8(w.dequantize())
    s = w.scales[:, 0].contiguous()
    return {"w": w.codes, "s": s, "s_bf16": s.to(torch.bfloat16), "gs": None}


def prep_int8_groups(w: IntWeight) -> dict:
    """int4 codes minus zero point as int8 [N, K] (exact) and fp32 group scales [G, N]."""
    q = (w.codes.to(torch.int16) - w.zeros.to(torch.int16).repeat_interleave(w.group_size, 1)).to(torch.int8)
    return {"w": q, "s": None, "s_bf16": None, "gs": w.scales.t().contiguous(), "g": w.group_size}


def prep_onednn(w: IntWeight, groups: bool = False) -> dict:
    d = prep_int8_groups(w) if groups else prep_int8(w)
    d["packed"] = torch.ops.onednn.qlinear_prepack(d["w"], None)
    d["ws"] = torch.ones(d["w"].shape[0]) if groups else d["s"]
    d["wz"] = torch.zeros(d["w"].shape[0], dtype=torch.long)
    del d["w"]
    return d


def prep_fbgemm(w: IntWeight) -> dict:
    d = prep_int8(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.13 (warned once, in the notes)
        qw = torch._make_per_channel_quantized_tensor(d["w"], d["s"].double(), torch.zeros(len(d["s"]), dtype=torch.long), 0)
        return {"packed": torch.ops.quantized.linear_prepack(qw, None)}


def prep_dyn_quant(w: IntWeight) -> dict:
    """``_dyn_quant_pack_4bit_weight``: nibbles (low = even column) [N, K/2] and fp32 scales
    [N, G] (the op reads q - 8: symmetric only)."""
    q = w.codes
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    n, k = q.shape
    return {"w": torch.ops.aten._dyn_quant_pack_4bit_weight(nibbles, w.scales.contiguous(), None, w.group_size, k, n),
            "g": w.group_size, "n": n}


# -- the routes' matmuls ------------------------------------------------------------------------


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 [M, K], fp32 scale [M, 1]: symmetric per row, amax / 127."""
    xf = x.float()
    scale = xf.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(xf / scale).to(torch.int8), scale


def quant_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> block-diagonal int8 [M * G, K] (row (m, g) holds group g of row m, zeros
    elsewhere), fp32 scale [M, G, 1]: symmetric per (row, group)."""
    m, k = x.shape
    groups = k // group_size
    xf = x.float().view(m, groups, group_size)
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(xf / scale).to(torch.int8)
    block = torch.zeros(m, groups, groups, group_size, dtype=torch.int8)
    idx = torch.arange(groups)
    block[:, idx, idx] = xq
    return block.view(m * groups, k), scale


def run_groups_rescale(acc: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """acc [M * G, N] (int32 or fp32) -> bf16 [M, N]: sum over g of acc * x scale * group scale."""
    m, groups = scale.shape[0], scale.shape[1]
    return (acc.view(m, groups, -1) * scale * gs).sum(1).to(torch.bfloat16)


def mm_int_rows(x, p):
    xq, sx = quant_rows(x)
    return (torch._int_mm(xq, p["w"].t()) * sx * p["s"]).to(torch.bfloat16)


def mm_int_groups(x, p):
    xq, sx = quant_groups(x, p["g"])
    return run_groups_rescale(torch._int_mm(xq, p["w"].t()), sx, p["gs"])


def _qlinear(xq, p):
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, p["packed"], p["ws"], p["wz"], None, 1.0, 0,
                                              torch.float32, "none", [], "")


def mm_onednn_rows(x, p):
    xq, sx = quant_rows(x)
    return (_qlinear(xq, p) * sx).to(torch.bfloat16)


def mm_onednn_groups(x, p):
    xq, sx = quant_groups(x, p["g"])
    return run_groups_rescale(_qlinear(xq, p), sx, p["gs"])


@dataclass(frozen=True)
class Route:
    """One candidate: ``prep`` (an int4 weight, or an int8 one where ``takes_int8``) -> prepared
    dict, ``run(x bf16 [M, K], prepared) -> bf16 [M, N]``, ``storage`` (routes with one storage
    share one cold pool and cursor), ``layout`` plain or opaque, the largest M it is timed at,
    ``overhead``: its quantize + rescale ops alone (x, prepared, N) or None."""

    name: str
    prep: Callable
    run: Callable
    storage: str
    layout: str
    takes_int4: bool = True
    takes_int8: bool = False
    max_rows: int = 1 << 30
    group_size: int = 128
    shapes: tuple[str, ...] | None = None  # None: every shape
    overhead: Callable | None = None


def _overhead_rows(x, p, n):
    xq, sx = quant_rows(x)
    acc = torch.zeros(x.shape[0], n, dtype=torch.int32)
    return (acc * sx * torch.ones(n)).to(torch.bfloat16)


def _overhead_groups(x, p, n):
    xq, sx = quant_groups(x, p["g"])
    return run_groups_rescale(torch.zeros(xq.shape[0], n, dtype=torch.int32), sx, torch.ones(sx.shape[1], n))


def _overhead_fbgemm(x, p, n):
    return torch.zeros(x.shape[0], n).to(torch.bfloat16) + x.float().sum()


ROUTES = (
    Route("bf16 linear", lambda w: prep_float(w, torch.bfloat16), lambda x, p: F.linear(x, p["w"]), "bf16", "plain",
          takes_int8=True),
    Route("fp32 linear", lambda w: prep_float(w, torch.float32), lambda x, p: F.linear(x.float(), p["w"]).to(x.dtype),
          "fp32", "plain", takes_int8=True, shapes=("gate_up", "down", "q", "kv", "o")),
    Route("int4pack g128", prep_int4pack,
          lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p["w"], p["g"], p["sz"]), "int4", "plain"),
    Route("int4pack g32", prep_int4pack,
          lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p["w"], p["g"], p["sz"]), "int4g32", "plain",
          group_size=32, shapes=("gate_up",)),
    Route("int4pack g128 fp32 x", lambda w: prep_int4pack(w, torch.float32),
          lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x.float(), p["w"], p["g"], p["sz"]).to(x.dtype),
          "int4f32", "plain", max_rows=8, shapes=("gate_up",)),
    Route("int8pack", prep_int8, lambda x, p: torch.ops.aten._weight_int8pack_mm(x, p["w"], p["s_bf16"]), "int8",
          "plain", takes_int8=True),
    Route("fbgemm dynamic (per-tensor x)", prep_fbgemm,
          lambda x, p: torch.ops.quantized.linear_dynamic(x.float(), p["packed"]).to(x.dtype), "fbgemm", "opaque",
          takes_int8=True, overhead=_overhead_fbgemm),
    Route("_int_mm rows", prep_int8, mm_int_rows, "int8", "plain", takes_int8=True, overhead=_overhead_rows),
    Route("onednn qlinear rows", prep_onednn, mm_onednn_rows, "onednn", "opaque", takes_int8=True,
          overhead=_overhead_rows),
    Route("_int_mm groups (int4 exact)", prep_int8_groups, mm_int_groups, "int8", "plain", overhead=_overhead_groups),
    Route("onednn groups (int4 exact)", lambda w: prep_onednn(w, groups=True), mm_onednn_groups, "onednn", "opaque",
          overhead=_overhead_groups),
    Route("dyn_quant 4bit (x86 ref)", prep_dyn_quant,
          lambda x, p: torch.ops.aten._dyn_quant_matmul_4bit(x.float(), p["w"], p["g"], x.shape[1], p["n"]).to(x.dtype),
          "dynq", "plain", max_rows=1, shapes=("gate_up", "down")),
)


TWO_THREAD_ROUTES = ("bf16 linear", "int4pack g128", "int8pack", "fbgemm dynamic (per-tensor x)", "_int_mm rows",
                     "onednn qlinear rows", "onednn groups (int4 exact)")
COMPUTE_BOUND = ("int4pack g128 fp32 x", "dyn_quant 4bit (x86 ref)")  # ms per call: 2 copies, cold or not


# -- measurement --------------------------------------------------------------------------------


@dataclass
class Pool:
    """Copies of one storage's prepared weight (distinct memory, >= the cold bytes) and the
    cursor that every route reading this storage advances."""

    items: list[dict]
    cursor: int = 0

    def next(self) -> dict:
        item = self.items[self.cursor % len(self.items)]
        self.cursor += 1
        return item


@dataclass
class Result:
    """One (shape, route, threads) row: samples in microseconds per call."""

    cold: dict[int, list[float]] = field(default_factory=dict)
    warm: dict[int, list[float]] = field(default_factory=dict)
    wall: dict[int, list[float]] = field(default_factory=dict)
    weight_bytes: int = 0
    layout: str = ""
    convert_ms: float | None = None
    overhead_us: dict[int, float] = field(default_factory=dict)
    err4: tuple[float, float] | None = None
    err8: tuple[float, float] | None = None
    rows_independent: str = ""
    thread_invariant: str = ""


def weight_bytes(p: dict, shape: Shape) -> int:
    """Bytes of a prepared weight: its plain tensors; an opaque int8 one as N K + 4 N."""
    total = 0
    for v in p.values():
        if isinstance(v, torch.Tensor) and v.layout == torch.strided:
            total += v.numel() * v.element_size()
        elif v is not None and not isinstance(v, (int, torch.Tensor)):  # fbgemm's packed params
            total += shape.out_features * shape.in_features + 4 * shape.out_features
    if any(isinstance(v, torch.Tensor) and v.layout != torch.strided for v in p.values()):
        total += shape.out_features * shape.in_features
    return total


def clone_item(p: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) and v.layout == torch.strided else v for k, v in p.items()}


def storage_pool(route: Route, w4: IntWeight, shape: Shape, copies: int) -> Pool:
    """``copies`` distinct copies (plain tensors cloned, opaque ones prepacked again) of the
    prepared weight of ``route``'s storage, holding what all its routes read: the per-channel
    int8 codes stand in for the groups routes' int4 codes, with group scales of ones (the
    timing does not depend on the values)."""
    base = route.prep(w4)
    if route.storage in ("int8", "onednn"):
        base = {**base, "gs": torch.ones(shape.in_features // 128, shape.out_features), "g": 128}
    if route.storage == "onednn":
        w8 = prep_int8(w4)["w"]
        return Pool([base] + [{**base, "packed": torch.ops.onednn.qlinear_prepack(w8, None)} for _ in range(copies - 1)])
    if route.storage == "fbgemm":
        d = prep_int8(w4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(d["w"], d["s"].double(), torch.zeros(len(d["s"]), dtype=torch.long), 0)
            return Pool([base] + [{"packed": torch.ops.quantized.linear_prepack(qw, None)} for _ in range(copies - 1)])
    return Pool([base] + [clone_item(base) for _ in range(copies - 1)])


def cpu_us(fn: Callable, calls: int) -> tuple[float, float]:
    """(CPU, wall) microseconds per call of ``fn`` over ``calls`` calls."""
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def inputs(m: int, k: int, seed: int, outliers: bool = False) -> torch.Tensor:
    """x bf16 [m, k] ~ N(0, 1); ``outliers``: OUTLIER_COLUMNS fixed columns x OUTLIER_FACTOR."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if outliers:
        cols = torch.randperm(k, generator=torch.Generator().manual_seed(7))[:OUTLIER_COLUMNS]
        x[:, cols] *= OUTLIER_FACTOR
    return x.to(torch.bfloat16)


def check_route(route: Route, w4: IntWeight, w8: IntWeight | None, res: Result) -> None:
    """Errors against float32 x @ W_deq^T, row independence and thread invariance (torch.equal)."""
    k = w4.codes.shape[1]
    x, xo = inputs(8, k, 1), inputs(8, k, 1, outliers=True)
    p = route.prep(w4)
    if route.takes_int4:
        ref = w4.dequantize()
        res.err4 = (rel_err(route.run(x, p), x.float() @ ref.t()), rel_err(route.run(xo, p), xo.float() @ ref.t()))
    if route.takes_int8 and w8 is not None:
        ref8, p8 = w8.dequantize(), route.prep(w8)
        res.err8 = (rel_err(route.run(x, p8), x.float() @ ref8.t()), rel_err(route.run(xo, p8), xo.float() @ ref8.t()))
    big = min(128, route.max_rows if route.max_rows > 1 else 8)
    xb = torch.cat([x, inputs(big - 8, k, 2)]) if big > 8 else x
    y8 = route.run(x, p)
    singles = torch.cat([route.run(x[i: i + 1], p) for i in range(8)])
    diff = max(float((y8.float() - singles.float()).abs().max()), float((route.run(xb, p)[:8].float() - y8.float()).abs().max()))
    res.rows_independent = "yes" if diff == 0 else f"no (max diff {diff:.2g})"
    one = route.run(xb, p)
    torch.set_num_threads(2)
    two = route.run(xb, p)
    torch.set_num_threads(1)
    res.thread_invariant = "yes" if torch.equal(one, two) else "no"


def convert_ms(route: Route, w4: IntWeight) -> float:
    """Median of 3: int4 codes + group scales -> the route's prepared weight (one matrix)."""
    times = []
    for _ in range(3):
        t0 = time.process_time()
        route.prep(w4)
        times.append((time.process_time() - t0) * 1e3)
    return statistics.median(times)


def overhead_us(route: Route, p: dict, shape: Shape, m: int) -> float:
    x = inputs(m, shape.in_features, 3)
    route.overhead(x, p, shape.out_features)
    calls = max(3, math.ceil(SAMPLE_S / max(cpu_us(lambda: route.overhead(x, p, shape.out_features), 1)[0] * 1e-6,
                                              1e-6)))
    return statistics.median(cpu_us(lambda: route.overhead(x, p, shape.out_features), calls)[0] for _ in range(3))


def time_shape(shape: Shape, routes: list[Route], pools: dict[str, Pool], rounds: int, threads: int,
               results: dict) -> None:
    """Cold and warm CPU us per call of each route at each M, rounds interleaved (order rotated)."""
    torch.set_num_threads(threads)
    for m in shape.rows:
        here = [r for r in routes if m <= r.max_rows]
        x = inputs(m, shape.in_features, 4)
        est = {}
        for r in here:
            r.run(x, pools[r.storage].next())
            est[r.name] = max(cpu_us(lambda: r.run(x, pools[r.storage].next()), 1)[0] * 1e-6, 1e-6)
        for rnd in range(rounds):
            shift = rnd % len(here)
            for r in here[shift:] + here[:shift]:
                pool, res = pools[r.storage], results[(shape.name, r.name, threads)]
                calls = max(2, min(len(pool.items), math.ceil(SAMPLE_S / est[r.name])))
                cold, wall = cpu_us(lambda: r.run(x, pool.next()), calls)
                res.cold.setdefault(m, []).append(cold)
                res.wall.setdefault(m, []).append(wall)
                if threads == 1:
                    item = pool.items[0]
                    r.run(x, item)
                    res.warm.setdefault(m, []).append(cpu_us(lambda: r.run(x, item), max(3, math.ceil(SAMPLE_S / est[r.name])))[0])
    torch.set_num_threads(1)


def measure_shape(shape: Shape, routes: list[Route], args, results: dict) -> None:
    """Checks, conversion cost, pools and timing of every route at one shape."""
    n, k = shape.out_features, shape.in_features
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    w4 = {g: quantize_int4(w, g) for g in sorted({r.group_size for r in routes})}
    small = n * k <= 64 * 1024 * 1024  # errors and conversion: not at lm_head [151936, 2048]
    w8 = quantize_int8(w) if small else None
    del w
    for r in routes:
        res = results.setdefault((shape.name, r.name, 1), Result())
        if small:
            check_route(r, w4[r.group_size], w8, res)
            res.convert_ms = convert_ms(r, w4[r.group_size])
    pools = {}
    for r in routes:
        if r.storage in pools:
            continue
        base = r.prep(w4[r.group_size])
        per_copy = weight_bytes(base, shape)
        copies = 2 if r.name in COMPUTE_BOUND else max(2, math.ceil(args.cold_mib * 2**20 / per_copy))
        pools[r.storage] = storage_pool(r, w4[r.group_size], shape, copies)
    for r in routes:
        res = results[(shape.name, r.name, 1)]
        res.weight_bytes = weight_bytes(r.prep(w4[r.group_size]), shape) if small else weight_bytes(pools[r.storage].items[0], shape)
        res.layout = r.layout
        if r.overhead is not None:
            res.overhead_us = {m: overhead_us(r, pools[r.storage].items[0], shape, m) for m in (1, 128)}
    time_shape(shape, routes, pools, args.rounds, 1, results)
    if shape.two_threads and not args.quick:
        two = [r for r in routes if r.name in TWO_THREAD_ROUTES]
        for r in two:
            results.setdefault((shape.name, r.name, 2), Result(layout=r.layout))
        time_shape(shape, two, pools, args.rounds, 2, results)
    pools.clear()
    gc.collect()


# -- report -------------------------------------------------------------------------------------


def spread(samples: list[float] | None) -> str:
    if not samples:
        return ""
    return f"{statistics.median(samples):.0f} [{min(samples):.0f}-{max(samples):.0f}]"


def median(results: dict, shape: str, route: str, m: int = 1) -> float | None:
    res = results.get((shape, route, 1))
    return statistics.median(res.cold[m]) if res is not None and res.cold.get(m) else None


def table(results: dict, shapes: list[Shape], rows: tuple[int, ...]) -> list[str]:
    head = (["shape [N, K]", "route", "threads", "weight MiB", "layout", "convert ms"]
            + [f"cold us M={m}" for m in rows] + ["GB/s cold M=1"] + [f"warm us M={m}" for m in (1, 8, 128) if m in rows]
            + ["quant+rescale us M=1 / 128", "rel err int4 w (x / outliers)", "rel err int8 w (x / outliers)",
               "rows independent", "same at 2 threads"])
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    by_name = {s.name: s for s in shapes}
    for (shape_name, route, threads), res in results.items():
        shape = by_name[shape_name]
        cells = [f"{shape_name} [{shape.out_features}, {shape.in_features}]", route, str(threads),
                 f"{res.weight_bytes / 2**20:.2f}" if res.weight_bytes else "",
                 res.layout, f"{res.convert_ms:.1f}" if res.convert_ms is not None else ""]
        for m in rows:
            cell = spread(res.cold.get(m))
            if threads > 1 and cell:
                cell += f" (wall {statistics.median(res.wall[m]):.0f})"
            cells.append(cell)
        c1 = res.cold.get(1)
        cells.append(f"{res.weight_bytes / statistics.median(c1) / 1e3:.1f}" if c1 and res.weight_bytes else "")
        cells += [spread(res.warm.get(m)) for m in (1, 8, 128) if m in rows]
        cells.append(" / ".join(f"{res.overhead_us[m]:.0f}" for m in (1, 128)) if res.overhead_us else "")
        cells.append(" / ".join(f"{e:.4f}" for e in res.err4) if res.err4 else "")
        cells.append(" / ".join(f"{e:.4f}" for e in res.err8) if res.err8 else "")
        cells += [res.rows_independent, res.thread_invariant]
        out.append("| " + " | ".join(cells) + " |")
    return out


CONFIGS = (
    ("today: bf16 attention + lm_head, int4pack experts", "bf16 linear", "int4pack g128"),
    ("int4pack everywhere", "int4pack g128", "int4pack g128"),
    ("onednn qlinear rows attention + lm_head, int4pack experts", "onednn qlinear rows", "int4pack g128"),
    ("_int_mm rows attention + lm_head, int4pack experts", "_int_mm rows", "int4pack g128"),
    ("onednn qlinear rows everywhere (int8 weights)", "onednn qlinear rows", "onednn qlinear rows"),
    ("_int_mm rows everywhere (int8 weights)", "_int_mm rows", "_int_mm rows"),
    ("int8pack everywhere (int8 weights)", "int8pack", "int8pack"),
    ("onednn groups everywhere (int4 codes as int8)", "onednn groups (int4 exact)", "onednn groups (int4 exact)"),
    ("bf16 everywhere (plain)", "bf16 linear", "bf16 linear"),
)


def estimates(results: dict, layers: int = 4, experts: int = 8) -> list[str]:
    """Matmul CPU ms of one decode token (M = 1, cold medians): per layer q, k, v, o and
    ``experts`` x (gate_up + down), plus lm_head [4096, 2048] (q's shape)."""
    lines = []
    for label, dense, expert in CONFIGS:
        parts = [median(results, s, dense) for s in ("q", "kv", "o")] + [median(results, s, expert) for s in ("gate_up", "down")]
        if any(p is None for p in parts):
            continue
        q, kv, o, gate_up, down = parts
        attn, moe = q + 2 * kv + o, experts * (gate_up + down)
        total = layers * (attn + moe) + q
        lines.append(f"- {label}: {total / 1e3:.2f} ms (per layer attention {attn / 1e3:.2f} + experts {moe / 1e3:.2f}; "
                     f"lm_head {q / 1e3:.2f})")
    return lines


def read_gbps() -> float:
    """One thread's read bandwidth: sum of a 1 GiB float32 tensor, GB/s (median of 3)."""
    buf = torch.ones(2**28)
    buf.sum()
    times = [cpu_us(buf.sum, 1)[0] for _ in range(3)]
    return buf.numel() * 4 / statistics.median(times) / 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median and [min-max] over them)")
    parser.add_argument("--cold-mib", type=int, default=1024,
                        help="MiB of distinct weight copies each storage rotates over (cold: beyond L2 and L3)")
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES),
                        help=f"comma-separated, of {', '.join(s.name for s in SHAPES)}")
    parser.add_argument("--rows", default="1,2,8,128", help="comma-separated M values (lm_head: 1 and 8 of them)")
    parser.add_argument("--quick", action="store_true", help="1 round, 64 MiB pools, no 2-thread rows (a smoke run)")
    args = parser.parse_args(argv)
    names = {s.name: s for s in SHAPES}
    unknown = [n for n in args.shapes.split(",") if n not in names]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {list(names)}")
    rows = tuple(int(m) for m in args.rows.split(","))
    if args.quick:
        args.rounds, args.cold_mib = 1, 64
    shapes = [Shape(s.name, s.out_features, s.in_features, tuple(m for m in s.rows if m in rows), s.two_threads)
              for s in SHAPES if s.name in args.shapes.split(",")]
    torch.set_num_threads(1)
    load = open("/proc/loadavg").read().split()[:3]
    gbps = read_gbps()
    results: dict = {}
    for shape in shapes:
        routes = [r for r in ROUTES if r.shapes is None or shape.name in r.shapes]
        measure_shape(shape, routes, args, results)
    load_end = open("/proc/loadavg").read().split()[:3]
    print(f"{datetime.date.today()} · torch {torch.__version__} · {cpu_name()} · CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()} · 1 thread unless said · {args.rounds} rounds · cold pools "
          f">= {args.cold_mib} MiB per storage · one-thread read {gbps:.1f} GB/s · load average {' '.join(load)} "
          f"at start, {' '.join(load_end)} at end\n")
    print("\n".join(table(results, shapes, rows)))
    print("\nMatmul CPU ms per decode token, 4 layers x (q, k, v, o, 8 x (gate_up + down)) + lm_head [4096, 2048], "
          "cold M = 1 medians:\n")
    print("\n".join(estimates(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
