"""The fused MoE Triton kernels: ``fused_moe_gemm_kernel`` (an expert-grouped GEMM reading packed rows,
dequantizing in registers) and ``dequantize_kernel``, with their helpers and argument groups. Each
weight element is computed with the format's own arithmetic, equal to ``formats.unpack`` bit for bit
(docs/fused-kernels.md "Kernel internals").

Legend: S entries, R addressable rows, ``out_features`` / ``in_features`` (never K: K is the slot
count), BM / BOUT / BIN the tile.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedexperts.formats.packing import WeightPacking, scale_rows_per_source
from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton


class WeightEncoding(NamedTuple):
    """How a ``WeightPacking`` encodes W (one constexpr, in ``formats.packing``'s names)."""

    codes: str
    packed_dim: str
    per_word: int  # values per stored element of the weight row
    bits: int  # bits of one packed field (8 for one value per byte)
    interleaved: bool  # AWQ's nibble order
    value_offset: int  # subtracted from an int field without zero points
    has_scale: bool
    scale_codes: str
    group_in: int  # input columns per scale; 0: one group spans the input
    block_rows: int  # output rows per scale, inside one source
    has_zero: bool
    zero_word: int  # added to each zero-point word, carries included (GPTQ v1)
    zero_value: int  # added to each zero point after unpacking, no wrap (AutoRound)
    g_idx: bool  # act-order: each input column's group read from the g_idx row
    global_scale: str
    scale_op: str  # how the value meets its scale: multiply, or divide (GPTQModel FP8)

    @classmethod
    def of(cls, packing: WeightPacking) -> "WeightEncoding":
        return cls(codes=packing.codes, packed_dim=packing.packed_dim, per_word=packing.per_word,
                   bits=packing.bits or 8, interleaved=packing.interleaved, value_offset=packing.value_offset,
                   has_scale=packing.spec("scale") is not None, scale_codes=packing.scale_codes,
                   group_in=packing.group_size, block_rows=packing.block_rows,
                   has_zero=packing.spec("zero") is not None, zero_word=packing.zero_word(),
                   zero_value=0 if packing.zero_carries else packing.zero_offset,
                   g_idx=packing.spec("g_idx") is not None, global_scale=packing.global_scale,
                   scale_op=packing.scale_op)


class Arithmetic(NamedTuple):
    """A packing's dtypes on one target (one constexpr): ``mul``, ``round``, ``dense``, ``dot``;
    ``emulate_bf16`` (interpreter), ``fp8_native`` (sm_89+)."""

    mul: object
    round: object
    dense: object
    dot: object
    emulate_bf16: bool
    fp8_native: bool


def geometry(packing: WeightPacking) -> tuple:
    """A packing's runtime ints: rows, scale rows, zero words per source; (out, in) strides of each
    role."""
    bits = packing.bits or 8
    strides = tuple(packing.row_strides(role) if packing.spec(role) else (0, 0) for role in ("weight", "scale", "zero"))
    return (packing.source_rows, scale_rows_per_source(packing), -(-packing.source_rows // (32 // bits))) + strides


def packing_args(packing: WeightPacking) -> tuple[dict, dict]:
    """(runtime arguments, constexprs) that describe ``packing`` to the kernels."""
    return {"geometry": geometry(packing)}, {"ENCODING": WeightEncoding.of(packing)}


if HAVE_TRITON:

    @triton.jit
    def _round(x, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
        """float32 ``x`` rounded to ``DT`` (nearest even), returned in float32."""
        if DT == tl.float16:
            x = x.to(tl.float16).to(tl.float32)
        elif DT == tl.bfloat16:
            if EMULATE_BF16:
                bits = x.to(tl.int32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
            else:
                x = x.to(tl.bfloat16).to(tl.float32)
        return x

    @triton.jit
    def _cast(x, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
        """float32 ``x`` as a ``DT`` tensor (nearest even)."""
        if DT == tl.bfloat16 and EMULATE_BF16:
            bits = _round(x, DT, EMULATE_BF16).to(tl.int32, bitcast=True)
            return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DT)

    @triton.jit
    def _to_dot(x, ARITH: tl.constexpr):
        """An operand in ``ARITH.dot`` holding its value rounded to ``ARITH.dense`` (the experts' dtype)."""
        if x.dtype == ARITH.dot:
            return x
        else:
            return _round(x.to(tl.float32), ARITH.dense, ARITH.emulate_bf16).to(ARITH.dot)

    @triton.jit
    def _e4m3(byte, NATIVE: tl.constexpr):
        """float8_e4m3fn bytes (uint8) -> float32."""
        if NATIVE:
            return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            b = byte.to(tl.int32)
            e = (b >> 3) & 0xF
            m = b & 0x7
            normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
            return tl.where((b & 0x80) != 0, -mag, mag)

    @triton.jit
    def _e2m1(code):
        """4-bit e2m1 codes (int32; bit 3 the sign) -> float32 (0, .5, 1, 1.5, 2, 3, 4, 6)."""
        e = (code >> 1) & 0x3
        m = code & 0x1
        normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
        return tl.where((code & 0x8) != 0, -mag, mag)

    @triton.jit
    def _decode_scale(raw, SCALE_CODES: tl.constexpr, FP8_NATIVE: tl.constexpr):
        """Stored scales -> float32: float, e4m3 bytes, or E8M0 bytes (2 ** (e - 127))."""
        if SCALE_CODES == "e4m3":
            return _e4m3(raw, FP8_NATIVE)
        elif SCALE_CODES == "e8m0":
            e = raw.to(tl.int32)
            return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _value(raw, in2, mask, mask_out, group, in0, in_features, cols, geometry, ENC: tl.constexpr,
               ARITH: tl.constexpr, BLOCK_IN: tl.constexpr):
        """A [BIN, BOUT] tile's values in float32 (int: field minus zero point; e4m3 / e2m1 decoded)."""
        field = raw
        if ENC.packed_dim == "in":
            field = (raw.to(tl.int32) >> (ENC.bits * (in2 % ENC.per_word))) & ((1 << ENC.bits) - 1)
        elif ENC.packed_dim == "out":
            field = (raw.to(tl.int32) >> cols[1][None, :]) & ((1 << ENC.bits) - 1)
        if ENC.codes == "int":
            if ENC.has_zero:
                zraw = _group_tile(cols[3], in0, in2, mask, mask_out, group, in_features, geometry[5][1], ENC, BLOCK_IN)
                zero = (((zraw + ENC.zero_word) >> cols[4][None, :]) & ((1 << ENC.bits) - 1)) + ENC.zero_value
                return (field.to(tl.int32) - zero).to(tl.float32)
            else:
                return (field.to(tl.int32) - ENC.value_offset).to(tl.float32)
        elif ENC.codes == "e4m3":
            return _e4m3(field, ARITH.fp8_native)
        else:
            return _e2m1(field)

    @triton.jit
    def _weight_tile(in0, offs_in, mask_in, mask_out, in_features, cols, geometry, ENC: tl.constexpr,
                     ARITH: tl.constexpr, BLOCK_IN: tl.constexpr):
        """W^T[in0:in0+BIN, columns] in ``ARITH.dot``, from ``cols`` (``_columns``) and ``geometry``."""
        w_col, _, s_col, _, _, g_col, glob = cols
        in2 = offs_in[:, None]
        mask = mask_in[:, None] & mask_out[None, :]
        if ENC.packed_dim == "in":
            raw = tl.load(w_col[None, :] + (in2 // ENC.per_word) * geometry[3][1], mask=mask, other=0)
        else:
            raw = tl.load(w_col[None, :] + in2 * geometry[3][1], mask=mask, other=0)
        if ENC.codes == "dense":
            return _to_dot(raw, ARITH)
        else:
            group = 0
            if ENC.g_idx:  # act-order: each element's group from its column's g_idx row
                group = tl.load(g_col[None, :] + in2, mask=mask, other=0)
            v = _value(raw, in2, mask, mask_out, group, in0, in_features, cols, geometry, ENC, ARITH, BLOCK_IN)
            s = _group_tile(s_col, in0, in2, mask, mask_out, group, in_features, geometry[4][1], ENC, BLOCK_IN)
            s = _decode_scale(s, ENC.scale_codes, ARITH.fp8_native)
            if ENC.global_scale == "divide":
                s = tl.math.div_rn(s, glob[None, :])
            elif ENC.global_scale == "multiply":
                s = s * glob[None, :]
            elif ENC.global_scale == "value_reciprocal":  # the value times 1 / global first (AutoRound NVFP4)
                v = v * tl.where(glob == 0.0, 0.0, tl.math.div_rn(tl.full(glob.shape, 1.0, tl.float32), glob))[None, :]
            s = _round(s, ARITH.mul, ARITH.emulate_bf16)
            if ENC.scale_op == "divide":  # GPTQModel FP8: the value divided by its weight_scale_inv
                w = _round(tl.math.div_rn(v, s), ARITH.mul, ARITH.emulate_bf16)
            else:
                w = _round(v * s, ARITH.mul, ARITH.emulate_bf16)
            w = _round(_round(w, ARITH.round, ARITH.emulate_bf16), ARITH.dense, ARITH.emulate_bf16)
            return w.to(ARITH.dot)

    @triton.jit
    def _group_tile(col, in0, in2, mask, mask_out, group, in_features, stride_in, ENC: tl.constexpr,
                    BLOCK_IN: tl.constexpr):
        """Per-(input group, column) values over the tile: [BIN, BOUT], or [1, BOUT] within one group."""
        GROUP_IN: tl.constexpr = ENC.group_in
        if ENC.g_idx:
            return tl.load(col[None, :] + group * stride_in, mask=mask, other=0)
        elif GROUP_IN == 0:  # one group spans the input
            return tl.load(col, mask=mask_out, other=0)[None, :]
        elif GROUP_IN % BLOCK_IN == 0:  # the tile lies in group in0 // GROUP_IN
            return tl.load(col + (in0 // GROUP_IN) * stride_in, mask=mask_out, other=0)[None, :]
        elif BLOCK_IN % GROUP_IN == 0:  # whole groups: load each once, repeat it GROUP_IN times
            per_tile: tl.constexpr = BLOCK_IN // GROUP_IN
            groups = in0 // GROUP_IN + tl.arange(0, per_tile)
            small = tl.load(col[None, :] + groups[:, None] * stride_in,
                            mask=(groups[:, None] * GROUP_IN < in_features) & mask_out[None, :], other=0)
            block_out: tl.constexpr = col.shape[0]
            return tl.reshape(tl.broadcast_to(small[:, None, :], (per_tile, GROUP_IN, block_out)), (BLOCK_IN, block_out))
        else:
            return tl.load(col[None, :] + (in2 // GROUP_IN) * stride_in, mask=mask, other=0)

    @triton.jit
    def _position(j, INTERLEAVED: tl.constexpr, PER_WORD: tl.constexpr):
        """The field of column j in a word: j, or AWQ's interleaved order (0, 4, 1, 5, 2, 6, 3, 7)."""
        if INTERLEAVED:
            return (j >> 1) + (j & 1) * (PER_WORD // 2)
        else:
            return j

    @triton.jit
    def _row(table, row, ALIGN: tl.constexpr):
        """``base + offsets[row]`` of a role's ``table`` (offsets multiples of ALIGN)."""
        return table[0] + tl.multiple_of(tl.load(table[1] + row), ALIGN)

    @triton.jit
    def _columns(row, offs_out, mask_out, tables, geometry, in_features, ENC: tl.constexpr, ALIGNS: tl.constexpr):
        """Per output column of ``row``: (w_col, w_shift, s_col, z_col, z_shift, g_col, glob)."""
        source_rows, scale_rows_per_source, zero_words_per_source = geometry[0], geometry[1], geometry[2]
        source = offs_out // source_rows
        within = offs_out % source_rows
        w_row = _row(tables[0], row, ALIGNS[0])
        w_col = w_row + offs_out * geometry[3][0]
        w_shift = tl.zeros_like(offs_out)
        if ENC.packed_dim == "out":
            w_col = w_row + (offs_out // ENC.per_word) * geometry[3][0]
            w_shift = ENC.bits * _position(offs_out % ENC.per_word, ENC.interleaved, ENC.per_word)
        s_col = w_col
        if ENC.has_scale:
            s_col = _row(tables[1], row, ALIGNS[1]) + (source * scale_rows_per_source + within // ENC.block_rows) * geometry[4][0]
        z_col = w_col
        z_shift = tl.zeros_like(offs_out)
        if ENC.has_zero:
            z_per_word: tl.constexpr = 32 // ENC.bits
            z_col = _row(tables[2], row, ALIGNS[2]) + (source * zero_words_per_source + within // z_per_word) * geometry[5][0]
            z_shift = ENC.bits * _position(within % z_per_word, ENC.interleaved, z_per_word)
        g_col = z_col
        if ENC.g_idx:
            g_col = _row(tables[3], row, 1) + source * in_features
        glob = tl.zeros_like(offs_out).to(tl.float32)
        if ENC.global_scale != "none":
            glob = tl.load(_row(tables[4], row, 1) + source, mask=mask_out, other=1.0)
        return w_col, w_shift, s_col, z_col, z_shift, g_col, glob

    @triton.jit
    def fused_moe_gemm_kernel(
        a_ptr, c_ptr, alignment, tables, bias, geometry,
        out_features, in_features, num_entries, a_row_div, stride_am, stride_cm,
        ENCODING: tl.constexpr, ARITHMETIC: tl.constexpr, ALIGNS: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
    ):
        """C [S, out] from A [*, in], one program per (block, column tile); blocks past the count
        return."""
        sorted_entry_ptr, block_row_ptr, num_padded_ptr = alignment
        pid_m = tl.program_id(0)
        pid_out = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        row = tl.load(block_row_ptr + pid_m).to(tl.int64)
        entries = tl.load(sorted_entry_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = entries < num_entries
        a_rows = tl.where(mask_m, entries // a_row_div, 0)
        offs_out = pid_out * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        mask_out = offs_out < out_features
        cols = _columns(row, offs_out, mask_out, tables, geometry, in_features, ENCODING, ALIGNS)
        acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=tl.float32)
        for in0 in range(0, in_features, BLOCK_IN):
            offs_in = in0 + tl.arange(0, BLOCK_IN)
            mask_in = offs_in < in_features
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_in[None, :],
                        mask=mask_m[:, None] & mask_in[None, :], other=0.0)
            b = _weight_tile(in0, offs_in, mask_in, mask_out, in_features, cols, geometry, ENCODING, ARITHMETIC,
                             BLOCK_IN)
            acc = tl.dot(_to_dot(a, ARITHMETIC), b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(_row(bias, row, 1) + offs_out, mask=mask_out, other=0.0).to(tl.float32)[None, :]
        c = _cast(acc, c_ptr.dtype.element_ty, ARITHMETIC.emulate_bf16)
        tl.store(c_ptr + entries[:, None] * stride_cm + offs_out[None, :], c, mask=mask_m[:, None] & mask_out[None, :])

    @triton.jit
    def dequantize_kernel(
        out_ptr, rows_ptr, tables, geometry, out_features, in_features,
        ENCODING: tl.constexpr, ARITHMETIC: tl.constexpr, ALIGNS: tl.constexpr,
        BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
    ):
        """out [n, out, in]: W of the listed rows, one program per (row, column tile, input tile)."""
        i = tl.program_id(0)
        offs_out = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        in0 = tl.program_id(2) * BLOCK_IN
        offs_in = in0 + tl.arange(0, BLOCK_IN)
        mask_out = offs_out < out_features
        mask_in = offs_in < in_features
        row = tl.load(rows_ptr + i).to(tl.int64)
        cols = _columns(row, offs_out, mask_out, tables, geometry, in_features, ENCODING, ALIGNS)
        w = _weight_tile(in0, offs_in, mask_in, mask_out, in_features, cols, geometry, ENCODING, ARITHMETIC, BLOCK_IN)
        out = out_ptr + i.to(tl.int64) * out_features * in_features + offs_out[None, :] * in_features + offs_in[:, None]
        tl.store(out, _cast(w.to(tl.float32), ARITHMETIC.dense, ARITHMETIC.emulate_bf16),
                 mask=mask_in[:, None] & mask_out[None, :])
