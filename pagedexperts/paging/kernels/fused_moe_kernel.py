"""The fused MoE Triton kernels: an expert-grouped GEMM that reads packed rows and dequantizes
them in registers, and the same dequantization written out (dense rows).

Owns the ``@triton.jit`` code: ``fused_moe_gemm_kernel`` (one program per (block of BLOCK_M
entries of one row, BLOCK_N output columns): ``C[s, n] = sum_k A[s // a_row_div, k] * W_r[n, k]``
(+ bias), W_r the routed row's weight, read at ``base + offsets[r]`` of each packed role),
``dequantize_kernel``
(``W_r`` of listed rows into a dense [n, N, K] tensor) and the helpers they share:
``_weight_tile`` (a [BLOCK_K, BLOCK_N] tile of W^T from a ``WeightPacking``'s encoding:
codes, packed dim, nibble order, zero points, group / block / channel / tensor scales,
g_idx, global scales) and the exact roundings. Does not: choose blocks, build addresses or
check inputs (``fused_moe``), align entries (``fused_align``), or know any format class.

Exactness. ``_weight_tile`` computes every element with the format's own arithmetic (the value
and scale exact in float32, the product rounded to ``MUL_DT``, then ``ROUND_DT``, then
``DENSE_DT``): a float32 product of two values of at most 12 significant bits is exact, so
rounding it once equals the float16 / bfloat16 product the format's torch code computes. A
division (``SCALE_DIVIDE``; the reciprocal of ``GLOBAL`` 3) is ``div_rn``, float32 correctly
rounded, then rounded to ``MUL_DT``: what torch computes for a float32 division, and for a
float16 / bfloat16 one on a CPU (float32 quotient, then rounded).
Differences from the format's ``dequantize``: an e4m3 NaN code (0x7F / 0xFF) decodes to +-480
(quantizers never write it), ModelOpt's code 8 decodes to -0.0 instead of +0.0 (equal values).

The Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) truncates float32 -> bfloat16 casts
and computes bfloat16 arithmetic on the raw bits, so there ``EMULATE_BF16`` rounds to bfloat16
with integer ops (round to nearest even, as the GPU's ``cvt.rn``) and ``DOT_DT`` is float32
(operands hold the same bfloat16 values; float32 products of them are exact). On a GPU the
launcher sets ``EMULATE_BF16`` False and ``DOT_DT`` to the dense dtype (tensor cores).
``FP8_NATIVE``: decode e4m3 with the hardware conversion (sm_89 and newer); else with integer
ops (sm_80, the interpreter), the same values.

Legend: S entries (token, k) of a step, R addressable rows, N output features, K input
features, BM / BN / BK the tile.
"""

from __future__ import annotations

from pagedexperts.paging.kernels._triton import HAVE_TRITON, tl, triton

# WeightPacking strings -> the kernels' constexpr codes
CODES = {"dense": 0, "int": 1, "e4m3": 2, "e2m1": 3}
PACKED_DIMS = {"none": 0, "in": 1, "out": 2}
SCALE_CODES = {"float": 0, "e4m3": 1, "e8m0": 2}
GLOBAL_SCALES = {"none": 0, "divide": 1, "multiply": 2, "value_reciprocal": 3}

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
    def _to_dot(x, DENSE_DT: tl.constexpr, DOT_DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
        """An operand in ``DOT_DT`` holding its value rounded to ``DENSE_DT`` (the experts' dtype)."""
        if x.dtype == DOT_DT:
            return x
        else:
            return _round(x.to(tl.float32), DENSE_DT, EMULATE_BF16).to(DOT_DT)

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
        if SCALE_CODES == 1:
            return _e4m3(raw, FP8_NATIVE)
        elif SCALE_CODES == 2:
            e = raw.to(tl.int32)
            return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _weight_tile(k0, offs_k, mask_k, mask_n, Kdim, w_col, w_shift, s_col, z_col, z_shift, g_col, glob,
                     w_stride_k, s_stride_k, z_stride_k,
                     CODES: tl.constexpr, PACKED: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr,
                     VALUE_OFFSET: tl.constexpr, SCALE_CODES: tl.constexpr, GROUP_K: tl.constexpr,
                     HAS_ZERO: tl.constexpr, ZERO_OFFSET: tl.constexpr, G_IDX: tl.constexpr, GLOBAL: tl.constexpr,
                     SCALE_DIVIDE: tl.constexpr, MUL_DT: tl.constexpr, ROUND_DT: tl.constexpr,
                     DENSE_DT: tl.constexpr, DOT_DT: tl.constexpr,
                     EMULATE_BF16: tl.constexpr, FP8_NATIVE: tl.constexpr, BLOCK_K: tl.constexpr):
        """W^T[k0:k0+BK, columns] in DOT_DT: ``w_col`` [BN] pointers to each column's first stored
        element, ``s_col`` / ``z_col`` / ``g_col`` the same for its scale / zero / g_idx, ``w_shift`` /
        ``z_shift`` [BN] its field's bit offset along the output dim, ``glob`` [BN] its global scale."""
        k2 = offs_k[:, None]
        mask = mask_k[:, None] & mask_n[None, :]
        if PACKED == 1:
            raw = tl.load(w_col[None, :] + (k2 // PER_WORD) * w_stride_k, mask=mask, other=0)
        else:
            raw = tl.load(w_col[None, :] + k2 * w_stride_k, mask=mask, other=0)
        if CODES == 0:
            return _to_dot(raw, DENSE_DT, DOT_DT, EMULATE_BF16)
        else:
            field = raw
            if PACKED == 1:
                field = (raw.to(tl.int32) >> (BITS * (k2 % PER_WORD))) & ((1 << BITS) - 1)
            elif PACKED == 2:
                field = (raw.to(tl.int32) >> w_shift[None, :]) & ((1 << BITS) - 1)
            group = 0
            if G_IDX:  # act-order: each element's group from its column's g_idx row
                group = tl.load(g_col[None, :] + k2, mask=mask, other=0)
            if CODES == 1:
                if HAS_ZERO:
                    zraw = _group_tile(z_col, k0, k2, mask, mask_n, group, Kdim, z_stride_k, G_IDX, GROUP_K, BLOCK_K)
                    # ZERO_OFFSET: added to the whole word, carries included (GPTQModel's v1 -> v2 conversion)
                    zero = ((zraw + ZERO_OFFSET) >> z_shift[None, :]) & ((1 << BITS) - 1)
                    v = (field.to(tl.int32) - zero).to(tl.float32)
                else:
                    v = (field.to(tl.int32) - VALUE_OFFSET).to(tl.float32)
            elif CODES == 2:
                v = _e4m3(field, FP8_NATIVE)
            else:
                v = _e2m1(field)
            s = _group_tile(s_col, k0, k2, mask, mask_n, group, Kdim, s_stride_k, G_IDX, GROUP_K, BLOCK_K)
            s = _decode_scale(s, SCALE_CODES, FP8_NATIVE)
            if GLOBAL == 1:
                s = tl.math.div_rn(s, glob[None, :])
            elif GLOBAL == 2:
                s = s * glob[None, :]
            elif GLOBAL == 3:  # the value times the global scale's reciprocal, first (AutoRound NVFP4)
                v = v * tl.where(glob == 0.0, 0.0, tl.math.div_rn(tl.full(glob.shape, 1.0, tl.float32), glob))[None, :]
            if SCALE_DIVIDE:  # GPTQModel FP8: the value divided by its weight_scale_inv
                w = _round(tl.math.div_rn(v, _round(s, MUL_DT, EMULATE_BF16)), MUL_DT, EMULATE_BF16)
            else:
                w = _round(v * _round(s, MUL_DT, EMULATE_BF16), MUL_DT, EMULATE_BF16)
            w = _round(_round(w, ROUND_DT, EMULATE_BF16), DENSE_DT, EMULATE_BF16)
            return w.to(DOT_DT)

    @triton.jit
    def _group_tile(col, k0, k2, mask, mask_n, group, Kdim, stride_k, G_IDX: tl.constexpr, GROUP_K: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """A per-(input group, column) tensor (scales, zero-point words) over the tile's rows
        ``k2`` [BK, 1]: [BK, BN], or [1, BN] when the tile lies in one group. ``col`` [BN]
        pointers to each column's group 0; ``group`` [BK, BN] the g_idx groups (G_IDX) or 0."""
        if G_IDX:
            return tl.load(col[None, :] + group * stride_k, mask=mask, other=0)
        elif GROUP_K == 0:  # one group spans K
            return tl.load(col, mask=mask_n, other=0)[None, :]
        elif GROUP_K % BLOCK_K == 0:  # the tile lies in group k0 // GROUP_K
            return tl.load(col + (k0 // GROUP_K) * stride_k, mask=mask_n, other=0)[None, :]
        elif BLOCK_K % GROUP_K == 0:  # whole groups: load each once, repeat it GROUP_K times
            per_tile: tl.constexpr = BLOCK_K // GROUP_K
            groups = k0 // GROUP_K + tl.arange(0, per_tile)
            small = tl.load(col[None, :] + groups[:, None] * stride_k,
                            mask=(groups[:, None] * GROUP_K < Kdim) & mask_n[None, :], other=0)
            block_n: tl.constexpr = col.shape[0]
            return tl.reshape(tl.broadcast_to(small[:, None, :], (per_tile, GROUP_K, block_n)), (BLOCK_K, block_n))
        else:
            return tl.load(col[None, :] + (k2 // GROUP_K) * stride_k, mask=mask, other=0)

    @triton.jit
    def _position(j, INTERLEAVED: tl.constexpr, PER_WORD: tl.constexpr):
        """The field of column j (0 .. PER_WORD-1) of a word: j, or AWQ's interleaved order
        (even columns in the low half: 0, 2, 4, 6, 1, 3, 5, 7 -> fields 0, 4, 1, 5, 2, 6, 3, 7)."""
        if INTERLEAVED:
            return (j >> 1) + (j & 1) * (PER_WORD // 2)
        else:
            return j

    @triton.jit
    def _row(base, offsets, row, ALIGN: tl.constexpr):
        """The first element of row ``row``: ``base + offsets[row]`` (elements), every offset a
        multiple of ALIGN (so that loads from the row can be vectorised)."""
        return base + tl.multiple_of(tl.load(offsets + row), ALIGN)

    @triton.jit
    def _columns(row, offs_n, mask_n, w_base, w_off, s_base, s_off, z_base, z_off, g_base, g_off, gs_base, gs_off,
                 Kdim, source_rows, scale_rows_per_source, zero_words_per_source, w_stride_n, s_stride_n, z_stride_n,
                 PACKED: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_ZERO: tl.constexpr, G_IDX: tl.constexpr,
                 GLOBAL: tl.constexpr, W_ALIGN: tl.constexpr, S_ALIGN: tl.constexpr, Z_ALIGN: tl.constexpr):
        """Per output column of row ``row``: (w_col, w_shift, s_col, z_col, z_shift, g_col, glob)
        as ``_weight_tile`` takes them."""
        source = offs_n // source_rows
        within = offs_n % source_rows
        w_row = _row(w_base, w_off, row, W_ALIGN)
        w_col = w_row + offs_n * w_stride_n
        w_shift = tl.zeros_like(offs_n)
        if PACKED == 2:
            w_col = w_row + (offs_n // PER_WORD) * w_stride_n
            w_shift = BITS * _position(offs_n % PER_WORD, INTERLEAVED, PER_WORD)
        s_col = w_col
        if HAS_SCALE:
            s_col = _row(s_base, s_off, row, S_ALIGN) + (source * scale_rows_per_source + within // BLOCK_ROWS) * s_stride_n
        z_col = w_col
        z_shift = tl.zeros_like(offs_n)
        if HAS_ZERO:
            z_per_word: tl.constexpr = 32 // BITS
            z_col = _row(z_base, z_off, row, Z_ALIGN) + (source * zero_words_per_source + within // z_per_word) * z_stride_n
            z_shift = BITS * _position(within % z_per_word, INTERLEAVED, z_per_word)
        g_col = z_col
        if G_IDX:
            g_col = _row(g_base, g_off, row, 1) + source * Kdim
        glob = tl.zeros_like(offs_n).to(tl.float32)
        if GLOBAL != 0:
            glob = tl.load(_row(gs_base, gs_off, row, 1) + source, mask=mask_n, other=1.0)
        return w_col, w_shift, s_col, z_col, z_shift, g_col, glob

    @triton.jit
    def fused_moe_gemm_kernel(
        a_ptr, c_ptr, w_base, w_off, s_base, s_off, z_base, z_off, g_base, g_off, gs_base, gs_off, b_base, b_off,
        sorted_entry_ptr, block_row_ptr, num_padded_ptr,
        N, Kdim, num_entries, a_row_div, stride_am, stride_cm,
        w_stride_n, w_stride_k, s_stride_n, s_stride_k, z_stride_n, z_stride_k,
        source_rows, scale_rows_per_source, zero_words_per_source,
        CODES: tl.constexpr, PACKED: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr,
        INTERLEAVED: tl.constexpr, VALUE_OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_CODES: tl.constexpr,
        GROUP_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO_OFFSET: tl.constexpr,
        G_IDX: tl.constexpr, GLOBAL: tl.constexpr, SCALE_DIVIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
        W_ALIGN: tl.constexpr,
        S_ALIGN: tl.constexpr, Z_ALIGN: tl.constexpr, MUL_DT: tl.constexpr, ROUND_DT: tl.constexpr,
        DENSE_DT: tl.constexpr, DOT_DT: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
        FP8_NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """C [S, N] (rows by entry): one program per (block, column tile); blocks at or past the
        device count ``num_padded`` return at once (fixed grid, no host read)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        row = tl.load(block_row_ptr + pid_m).to(tl.int64)
        entries = tl.load(sorted_entry_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = entries < num_entries
        a_rows = tl.where(mask_m, entries // a_row_div, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w_col, w_shift, s_col, z_col, z_shift, g_col, glob = _columns(
            row, offs_n, mask_n, w_base, w_off, s_base, s_off, z_base, z_off, g_base, g_off, gs_base, gs_off, Kdim,
            source_rows, scale_rows_per_source, zero_words_per_source, w_stride_n, s_stride_n, z_stride_n, PACKED,
            PER_WORD, BITS, INTERLEAVED, BLOCK_ROWS, HAS_SCALE, HAS_ZERO, G_IDX, GLOBAL, W_ALIGN, S_ALIGN, Z_ALIGN)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, Kdim, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < Kdim
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = _weight_tile(k0, offs_k, mask_k, mask_n, Kdim, w_col, w_shift, s_col, z_col, z_shift, g_col, glob,
                             w_stride_k, s_stride_k, z_stride_k, CODES, PACKED, PER_WORD, BITS, VALUE_OFFSET,
                             SCALE_CODES, GROUP_K, HAS_ZERO, ZERO_OFFSET, G_IDX, GLOBAL, SCALE_DIVIDE, MUL_DT,
                             ROUND_DT, DENSE_DT, DOT_DT, EMULATE_BF16, FP8_NATIVE, BLOCK_K)
            acc = tl.dot(_to_dot(a, DENSE_DT, DOT_DT, EMULATE_BF16), b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(_row(b_base, b_off, row, 1) + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c = _cast(acc, c_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(c_ptr + entries[:, None] * stride_cm + offs_n[None, :], c, mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def dequantize_kernel(
        out_ptr, rows_ptr, w_base, w_off, s_base, s_off, z_base, z_off, g_base, g_off, gs_base, gs_off,
        N, Kdim, w_stride_n, w_stride_k, s_stride_n, s_stride_k, z_stride_n, z_stride_k,
        source_rows, scale_rows_per_source, zero_words_per_source,
        CODES: tl.constexpr, PACKED: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr,
        INTERLEAVED: tl.constexpr, VALUE_OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_CODES: tl.constexpr,
        GROUP_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO_OFFSET: tl.constexpr,
        G_IDX: tl.constexpr, GLOBAL: tl.constexpr, SCALE_DIVIDE: tl.constexpr, W_ALIGN: tl.constexpr,
        S_ALIGN: tl.constexpr, Z_ALIGN: tl.constexpr, MUL_DT: tl.constexpr, ROUND_DT: tl.constexpr, DENSE_DT: tl.constexpr,
        DOT_DT: tl.constexpr, EMULATE_BF16: tl.constexpr, FP8_NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out [n, N, K] in DENSE_DT: W of the rows ``rows_ptr`` [n] lists, one program per
        (listed row, column tile, input tile)."""
        i = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(2) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_k = offs_k < Kdim
        row = tl.load(rows_ptr + i).to(tl.int64)
        w_col, w_shift, s_col, z_col, z_shift, g_col, glob = _columns(
            row, offs_n, mask_n, w_base, w_off, s_base, s_off, z_base, z_off, g_base, g_off, gs_base, gs_off, Kdim,
            source_rows, scale_rows_per_source, zero_words_per_source, w_stride_n, s_stride_n, z_stride_n, PACKED,
            PER_WORD, BITS, INTERLEAVED, BLOCK_ROWS, HAS_SCALE, HAS_ZERO, G_IDX, GLOBAL, W_ALIGN, S_ALIGN, Z_ALIGN)
        w = _weight_tile(k0, offs_k, mask_k, mask_n, Kdim, w_col, w_shift, s_col, z_col, z_shift, g_col, glob,
                         w_stride_k, s_stride_k, z_stride_k, CODES, PACKED, PER_WORD, BITS, VALUE_OFFSET,
                         SCALE_CODES, GROUP_K, HAS_ZERO, ZERO_OFFSET, G_IDX, GLOBAL, SCALE_DIVIDE, MUL_DT, ROUND_DT,
                         DENSE_DT, DOT_DT, EMULATE_BF16, FP8_NATIVE, BLOCK_K)
        out = out_ptr + i.to(tl.int64) * N * Kdim + offs_n[None, :] * Kdim + offs_k[:, None]
        tl.store(out, _cast(w.to(tl.float32), DENSE_DT, EMULATE_BF16), mask=mask_k[:, None] & mask_n[None, :])
