"""Triton kernels of the metrale custom ops (the device face of each `plugins` op).

This module imports triton at the top: import it only where triton is installed (the op modules
do so lazily, inside their `*_triton` launchers, and `aot` when compiling). Each kernel computes
exactly the math of its op's PyTorch reference, with float32 accumulation; the references are
the oracles these kernels are tested against (on CPU with `TRITON_INTERPRET=1`).

Invariants shared by every kernel:
- Quantized weights are decoded in registers from their bytes with integer arithmetic (no FP8
  hardware conversion), so the same source compiles for any SM: the FP8 plugin exists for
  targets that lack native FP8. FP8 E4M3 and E2M1 values are rebuilt bit by bit as float32
  (exact); the E4M3 NaN code (0x7F/0xFF) is not a weight value and decodes to ±480.
- A dequantized weight fed to `tl.dot` is the stored code times its FP8 scale (at most 4 + 2
  significant bits, magnitude in [2^-10, 2688]), which is exact in bf16 and fp16; per-row and
  global float32 scales are applied to the float32 accumulator. So the tensor-core dot in the
  activation dtype loses nothing against a float32 dequantize.
- Kernels are compiled with floating-point fusion off (`TRITON_DEFAULT_FP_FUSION=0` or the
  `enable_fp_fusion=False` option), so elementwise kernels round like the references.
- Pointers are to contiguous tensors; strides are in elements. Integer ids are int64 on input,
  and candidate ids are written as int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A candidate slot not yet filled (larger than any vocabulary id).
EMPTY_ID = tl.constexpr(2147483647)


@triton.jit
def _e4m3_to_f32(b):
    """FP8 E4M3 bytes (uint32 holding 0..255) -> float32, exactly (subnormals included)."""
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # exponent field 0: man/8 * 2^-6 = man * 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(exp == 0, sub, normal)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (uint32 holding 0..15) -> float32: sign bit 3, exponent bits 2-1, mantissa bit 0.

    Exponent 0 is subnormal (0 or 0.5); code 8 is -0.0, as in `formats.E2M1_VALUES`.
    """
    sign = (c & 8) << 28
    exp = (c >> 1) & 3
    man = c & 1
    normal = ((exp + 126) << 23) | (man << 22)
    sub = man * (126 << 23)  # 0.5 has the float32 bits 126 << 23
    return (sign | tl.where(exp == 0, sub, normal)).to(tl.float32, bitcast=True)


@triton.jit
def _cast_out(y, out_ty: tl.constexpr):
    """float32 -> the output dtype, rounding to nearest even. Rounding to bf16 is done on the
    bits (then the cast is exact) because the CPU interpreter's float32 -> bf16 cast truncates;
    the GPU's cast rounds to nearest even, so both give the same bits. NaN is not preserved."""
    if out_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return y.to(out_ty)


@triton.jit
def _dot_acc(a, w, acc, DOT_F32: tl.constexpr):
    """acc [BM, BN] f32 += a [BM, BK] @ w[BN, BK].T.

    The operands are a's dtype (bf16/fp16 on tensor cores; w is exact in it) unless DOT_F32,
    which multiplies in float32 ("ieee": no TF32 rounding). DOT_F32 gives the same products
    (both operands are exact either way) and exists for the CPU interpreter, which has no
    bfloat16 arithmetic; it is also what float32 activations use.
    """
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision="ieee")


@triton.jit
def fp8_w8a16_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, y_ptr,  # x [M, K] act; w uint8 (E4M3 bytes) [N, K]; scale f32 [N]
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    """y[m, n] = scale[n] * sum_k x[m, k] * e4m3(w[n, k]). Grid (cdiv(M, BM), cdiv(N, BN))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        wb = tl.load(w_ptr + rn[:, None] * K + kk[None, :],
                     mask=(rn[:, None] < N) & (kk[None, :] < K), other=0)  # u8 [BN, BK]
        w = _e4m3_to_f32(wb.to(tl.uint32))  # f32 [BN, BK], exact in bf16/fp16 (module doc)
        acc = _dot_acc(a, w, acc, DOT_F32)
    s = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)  # f32 [BN]
    y = acc * s[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], _cast_out(y, y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _nvfp4_tile(p_ptr, bs_ptr, rows, kk0, n_rows, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantize rows x [kk0, kk0+BLOCK_K) of an NVFP4 weight to E2M1 * FP8 block scale (f32).

    p_ptr: uint8 [n_rows, K/2]; bs_ptr: E4M3 bytes [n_rows, K/16]; rows: [BLOCK_R] row indices.
    kk0 and K are multiples of 16; BLOCK_K a multiple of 16. Rows/columns out of range give 0.
    """
    half = kk0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] byte columns
    rmask = rows[:, None] < n_rows
    p = tl.load(p_ptr + rows[:, None] * (K // 2) + half[None, :],
                mask=rmask & (half[None, :] < K // 2), other=0).to(tl.uint32)  # [BR, BK/2]
    codes = tl.interleave(p & 0xF, p >> 4)  # [BR, BK]: element 2i is the low nibble
    blk = kk0 // 16 + tl.arange(0, BLOCK_K // 16)  # [BK/16]
    bsb = tl.load(bs_ptr + rows[:, None] * (K // 16) + blk[None, :],
                  mask=rmask & (blk[None, :] < K // 16), other=0).to(tl.uint32)  # [BR, BK/16]
    vals = tl.reshape(_e2m1_to_f32(codes), [BLOCK_R, BLOCK_K // 16, 16])
    vals = vals * _e4m3_to_f32(bsb)[:, :, None]
    return tl.reshape(vals, [BLOCK_R, BLOCK_K])


@triton.jit
def nvfp4_w4a16_gemm_kernel(
    x_ptr, p_ptr, bs_ptr, gs_ptr, y_ptr,  # x [M, K]; packed u8 [N, K/2]; bs E4M3 [N, K/16]; gs f32 []
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    """y[m, n] = gs * sum_k x[m, k] * e2m1(code[n, k]) * e4m3(bs[n, k // 16]).

    Grid (cdiv(M, BM), cdiv(N, BN)); K is a multiple of 16 (the NVFP4 block).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        w = _nvfp4_tile(p_ptr, bs_ptr, rn, k0, N, K, BLOCK_N, BLOCK_K)  # f32 [BN, BK]
        acc = _dot_acc(a, w, acc, DOT_F32)
    gs = tl.load(gs_ptr)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], _cast_out(acc * gs, y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def nvfp4_moe_gate_up_kernel(
    x_ptr, ids_ptr, gu_ptr, gu_bs_ptr, gu_gs_ptr, act_ptr,
    # x [T, H]; ids i64 [T*k]; gate_up packed u8 [E, 2I, H/2], bs E4M3 [E, 2I, H/16],
    # gs f32 [E, 2] (gate's, up's);
    # act f32 [T*k, I] (workspace)
    H, INTER, TOPK,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Stage 1 of the MoE op: act[p, i] = silu(gate_e(x_t))[i] * up_e(x_t)[i] for the routed
    pair p = t*k + j, e = ids[p]. Grid (T*k, cdiv(I, BI)); H is a multiple of 16."""
    p = tl.program_id(0)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI]
    t = p // TOPK
    e = tl.load(ids_ptr + p)  # i64
    gp = gu_ptr + e * (2 * INTER) * (H // 2)
    gb = gu_bs_ptr + e * (2 * INTER) * (H // 16)
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        xv = tl.load(x_ptr + t * H + rh, mask=rh < H, other=0.0).to(tl.float32)  # [BH]
        wg = _nvfp4_tile(gp, gb, ri, h0, INTER, H, BLOCK_I, BLOCK_H)  # gate rows [BI, BH]
        wu = _nvfp4_tile(gp + INTER * (H // 2), gb + INTER * (H // 16), ri, h0, INTER, H,
                         BLOCK_I, BLOCK_H)  # up rows (I.. 2I) [BI, BH]
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    g = acc_g * tl.load(gu_gs_ptr + 2 * e)
    u = acc_u * tl.load(gu_gs_ptr + 2 * e + 1)
    act = g * tl.sigmoid(g) * u  # silu(g) * u
    tl.store(act_ptr + p * INTER + ri, act, mask=ri < INTER)


@triton.jit
def nvfp4_moe_down_kernel(
    act_ptr, ids_ptr, wt_ptr, dn_ptr, dn_bs_ptr, dn_gs_ptr, y_ptr,
    # act f32 [T*k, I]; ids i64 [T*k]; weights [T*k]; down packed u8 [E, H, I/2],
    # bs E4M3 [E, H, I/16], gs f32 [E]; y [T, H] in the activation dtype
    H, INTER, TOPK,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Stage 2 of the MoE op: y[t, h] = sum_j weights[t, j] * down_e(act[t*k + j])[h], looping
    over the k routed pairs of token t. Grid (T, cdiv(H, BH)); I is a multiple of 16."""
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        dp = dn_ptr + e * H * (INTER // 2)
        db = dn_bs_ptr + e * H * (INTER // 16)
        part = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i0 in range(0, INTER, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)
            av = tl.load(act_ptr + p * INTER + ri, mask=ri < INTER, other=0.0)  # f32 [BI]
            wd = _nvfp4_tile(dp, db, rh, i0, H, INTER, BLOCK_H, BLOCK_I)  # [BH, BI]
            part += tl.sum(wd * av[None, :], axis=1)
        wt = tl.load(wt_ptr + p).to(tl.float32)
        acc += wt * (part * tl.load(dn_gs_ptr + e))
    tl.store(y_ptr + t * H + rh, _cast_out(acc, y_ptr.dtype.element_ty), mask=rh < H)


@triton.jit
def dflash2_dynamic_conv_kernel(
    x_ptr, k_ptr, y_ptr,  # x [B*T, H]; kernel [B*T, G, 2]; y [B*T, H]
    T, H, G, BLOCK_SLOTS,
    BLOCK_H: tl.constexpr,
):
    """y[r, c] = k[r, g, 0]*x[r, c] + k[r, g, 1]*x[r-1, c] with g = c // (H/G); the second tap is
    absent at each block's first slot (t % BLOCK_SLOTS == 0). Grid (B*T, cdiv(H, BH))."""
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] channels
    m = c < H
    g = c // (H // G)
    k0 = tl.load(k_ptr + r * G * 2 + g * 2, mask=m, other=0.0).to(tl.float32)
    k1 = tl.load(k_ptr + r * G * 2 + g * 2 + 1, mask=m, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
    slot = tl.full([BLOCK_H], (r % T) % BLOCK_SLOTS, tl.int32)  # a block, not a scalar mask
    xp = tl.load(x_ptr + (r - 1) * H + c, mask=m & (slot != 0), other=0.0).to(tl.float32)
    y = k0 * xv + k1 * xp
    tl.store(y_ptr + r * H + c, _cast_out(y, y_ptr.dtype.element_ty), mask=m)


@triton.jit
def dflash2_select_kernel(
    proj_ptr, logit_ptr, cand_ptr, anchor_ptr, pred_ptr, succ_ptr, out_ptr,
    N, K, D,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """DFlash2's candidate selector over one sequence's N draft slots, left to right: slot j takes
    the candidate c of highest logit_c + successor[c]·(proj[j] + predecessor[prev]), prev the
    token slot j−1 took (the anchor at slot 0); ties to the earlier candidate. proj [B, N, D];
    logit, cand [B, N, K] (ids int64); anchor [B] int64; codebooks [V, D]; out [B, N] int64.
    Float32 throughout. Grid (B,)."""
    b = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    rd = tl.arange(0, BLOCK_D)
    mk = rk < K
    md = rd < D
    prev = tl.load(anchor_ptr + b)
    for j in range(N):
        row = b * N + j
        z = (tl.load(proj_ptr + row * D + rd, mask=md, other=0.0).to(tl.float32)
             + tl.load(pred_ptr + prev * D + rd, mask=md, other=0.0).to(tl.float32))  # [BD]
        ids = tl.load(cand_ptr + row * K + rk, mask=mk, other=0)  # [BK]
        succ = tl.load(succ_ptr + ids[:, None] * D + rd[None, :], mask=mk[:, None] & md[None, :],
                       other=0.0).to(tl.float32)  # [BK, BD]
        s = tl.load(logit_ptr + row * K + rk, mask=mk, other=0.0).to(tl.float32) + tl.sum(succ * z[None, :], axis=1)
        best = tl.argmax(tl.where(mk, s, float("-inf")), axis=0)
        prev = tl.sum(tl.where(rk == best, ids, 0), axis=0)
        tl.store(out_ptr + row, prev)


@triton.jit
def qk_norm_rope_kernel(
    q_in_ptr, k_in_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
    T, NH, NKV, Q_STRIDE, K_STRIDE, eps,
    HD: tl.constexpr,
):
    """Qwen3's per-head RMSNorm of q and k, then rotary (rotate-half), for one head of one row.
    q_in [B·T, Q_STRIDE] holds a row's NH q heads from column 0, k_in [B·T, K_STRIDE] its NKV k
    heads (views of one fused projection, or two); w [NH+NKV, HD] each head's norm multiplier;
    cos, sin [T, HD]. Head h of row r = b·T + t goes to q [B, NH, T, HD] (h < NH) or k [B, NKV,
    T, HD]. The normed head is rounded to the output dtype (the norm's own output), then roped
    in float32 and rounded once. HD is a power of two. Grid (B·T, NH+NKV)."""
    r = tl.program_id(0).to(tl.int64)  # (row × stride passes 2^31 in a long batched prefill)
    h = tl.program_id(1)
    b = r // T
    t = r % T
    d = tl.arange(0, HD)
    rot = (d + HD // 2) % HD  # rotate-half: y[d + HD/2] (negated) in the first half, y[d − HD/2] after
    if h < NH:
        src = q_in_ptr + r * Q_STRIDE + h * HD
        dst = q_ptr + ((b * NH + h) * T + t) * HD
    else:
        src = k_in_ptr + r * K_STRIDE + (h - NH) * HD
        dst = k_ptr + ((b * NKV + h - NH) * T + t) * HD
    x = tl.load(src + d).to(tl.float32)
    xr = tl.load(src + rot).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
    out_ty = q_ptr.dtype.element_ty
    y = _cast_out(x * inv * tl.load(w_ptr + h * HD + d).to(tl.float32), out_ty).to(tl.float32)
    yr = _cast_out(xr * inv * tl.load(w_ptr + h * HD + rot).to(tl.float32), out_ty).to(tl.float32)
    c = tl.load(cos_ptr + t * HD + d).to(tl.float32)
    s = tl.load(sin_ptr + t * HD + d).to(tl.float32)
    tl.store(dst + d, _cast_out(y * c + tl.where(d < HD // 2, -yr, yr) * s, out_ty))


@triton.jit
def moe_route_kernel(
    x_ptr, w_ptr, ids_ptr, wt_ptr,
    # x [T, H]; router weight [E, H]; ids i64 [T, k]; weights [T, k] in x's dtype
    H, E, TOPK, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """`layers.MoE.route` for one row: the router's logits rounded to x's dtype (the linear's
    output), their softmax in float32, the top k (largest first, a tie to the lower id, as
    `torch.topk` orders them), renormalised to sum 1 when NORM, rounded to x's dtype. Grid (T,)."""
    t = tl.program_id(0).to(tl.int64)
    re = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        xv = tl.load(x_ptr + t * H + rh, mask=rh < H, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + re[:, None] * H + rh[None, :], mask=(re[:, None] < E) & (rh[None, :] < H),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    out_ty = wt_ptr.dtype.element_ty
    logits = tl.where(re < E, _cast_out(acc, out_ty).to(tl.float32), float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    # the k largest in turn (each max, then the lowest id holding it), twice: first for their
    # sum in that order (the renormalisation's), then to write them; no store is read back
    total = 0.0
    left = p
    for j in range(0, TOPK):
        m = tl.max(left, axis=0)
        total += m
        left = tl.where(re == tl.min(tl.where(left == m, re, BLOCK_E), axis=0), -1.0, left)
    left = p
    for j in range(0, TOPK):
        m = tl.max(left, axis=0)
        e = tl.min(tl.where(left == m, re, BLOCK_E), axis=0)
        tl.store(ids_ptr + t * TOPK + j, e.to(tl.int64))
        if NORM:
            m = m / total
        tl.store(wt_ptr + t * TOPK + j, _cast_out(m, out_ty))
        left = tl.where(re == e, -1.0, left)


@triton.jit
def moe_gate_up_kernel(
    x_ptr, ids_ptr, gu_ptr, act_ptr,
    # x [T, H]; ids i64 [T*k]; gate_up [E*2I, H] in x's dtype (expert e: gate rows e*2I..,
    # up rows e*2I+I..); act f32 [T*k, I] (workspace)
    H, INTER, TOPK,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Stage 1 of the bf16/fp32 routed experts: act[p] = silu(gate_e(x_t)) * up_e(x_t) for the
    routed pair p = t*k + j, e = ids[p], rounded where `MLP` rounds (each projection's output,
    silu's, the product's) to x's dtype. Grid (T*k, cdiv(I, BI))."""
    p = tl.program_id(0).to(tl.int64)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    t = p // TOPK
    e = tl.load(ids_ptr + p)
    g_rows = gu_ptr + (e * 2 * INTER + ri[:, None]) * H
    u_rows = g_rows + INTER * H
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        xv = tl.load(x_ptr + t * H + rh, mask=rh < H, other=0.0).to(tl.float32)
        m = (ri[:, None] < INTER) & (rh[None, :] < H)
        acc_g += tl.sum(tl.load(g_rows + rh[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(tl.load(u_rows + rh[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :], axis=1)
    out_ty = x_ptr.dtype.element_ty
    g = _cast_out(acc_g, out_ty).to(tl.float32)
    u = _cast_out(acc_u, out_ty).to(tl.float32)
    s = _cast_out(g * tl.sigmoid(g), out_ty).to(tl.float32)
    tl.store(act_ptr + p * INTER + ri, _cast_out(s * u, out_ty).to(tl.float32), mask=ri < INTER)


@triton.jit
def moe_down_kernel(
    act_ptr, ids_ptr, wt_ptr, dn_ptr, y_ptr,
    # act f32 [T*k, I]; ids i64 [T*k]; weights [T*k] in x's dtype; down [E, I, H] in x's
    # dtype; y [T, H] in x's dtype
    H, INTER, TOPK,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Stage 2: y[t] = sum over t's k routed pairs of weight * down_e(act[p]), each pair's
    projection and its weighted value rounded to x's dtype (as `MoE._dense_experts`' batched
    product and its scaling round), the sum in float32, rounded once. Grid (T, cdiv(H, BH))."""
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    out_ty = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        part = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i0 in range(0, INTER, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)
            av = tl.load(act_ptr + p * INTER + ri, mask=ri < INTER, other=0.0)
            wd = tl.load(dn_ptr + (e * INTER + ri[:, None]) * H + rh[None, :],
                         mask=(ri[:, None] < INTER) & (rh[None, :] < H), other=0.0).to(tl.float32)
            part += tl.sum(wd * av[:, None], axis=0)
        wt = tl.load(wt_ptr + p).to(tl.float32)
        acc += _cast_out(_cast_out(part, out_ty).to(tl.float32) * wt, out_ty).to(tl.float32)
    tl.store(y_ptr + t * H + rh, _cast_out(acc, out_ty), mask=rh < H)


@triton.jit
def _lane_scores(q, k_base, k_sd, last, hid_base, rows, rs, S, HD: tl.constexpr, TREE: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """Scores [BM, BS] of `lane_attention_kernel`'s rows over slots rs: q·k rounded to q's dtype
    (the product's output), -inf where a row may not see the slot."""
    d = tl.arange(0, HD)
    kt = tl.load(k_base + d[:, None] * k_sd + rs[None, :], mask=rs[None, :] < S, other=0.0)  # [HD, BS]
    if DOT_F32:
        sc = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        sc = tl.dot(q, kt.to(q.dtype))
    sc = _cast_out(sc, q.dtype).to(tl.float32)
    if TREE:
        hidden = tl.load(hid_base + rows[:, None] * S + rs[None, :], mask=rs[None, :] < S, other=1)
        seen = (hidden == 0) & (rs[None, :] < S)
    else:
        seen = rs[None, :] <= last[:, None]
    return tl.where(seen, sc, float("-inf"))


@triton.jit
def lane_attention_kernel(
    q_ptr, k_ptr, v_ptr, last_ptr, hid_ptr, out_ptr,
    # q [nh, B*R, HD] (contiguous); k [B, NKV, HD, S] and v [B, NKV, S, HD] by strides, each
    # slot-contiguous (k) or head-dim-contiguous (v); last i64 [B*R]; hid u8 [B, R, S] (TREE:
    # 1 where a row may not see the slot); out [B*R, NKV*G*HD], all but last and hid in one dtype
    R, S, NKV, G, scale,
    k_sb, k_sh, k_sd, v_sb, v_sh, v_ss,
    HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, TREE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """`step_caches.LaneKV.attend` for one key/value head of one sequence: its G·R query rows
    (query head kvh·G + j // R, the sequence's row j % R), scaled and rounded as the PyTorch form
    scales them, their scores over the sequence's S slots rounded to the dtype, masked, softmax in
    float32 rounded to the dtype, then the probabilities times the values, rounded once. Three
    passes over the keys (the scores' max, their exponentials' sum, the weighted values), so the
    probabilities are the PyTorch form's up to the dot products' order. Grid (B, NKV)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    live = j < G * R
    h = kvh * G + j // R
    rows = b * R + j % R  # the query rows' index among the B·R rows
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (h[:, None] * (R * tl.num_programs(0)) + rows[:, None]) * HD + d[None, :],
                mask=live[:, None], other=0.0)
    q = _cast_out(q.to(tl.float32) * scale, q_ptr.dtype.element_ty)
    last = tl.load(last_ptr + rows, mask=live, other=-1)
    k_base = k_ptr + b * k_sb + kvh * k_sh
    v_base = v_ptr + b * v_sb + kvh * v_sh
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        sc = _lane_scores(q, k_base, k_sd, last, hid_ptr, rows, rs, S, HD, TREE, DOT_F32)
        m = tl.maximum(m, tl.max(sc, axis=1))
    m = tl.where(live, m, 0.0)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        sc = _lane_scores(q, k_base, k_sd, last, hid_ptr, rows, rs, S, HD, TREE, DOT_F32)
        total += tl.sum(tl.exp(sc - m[:, None]), axis=1)
    total = tl.where(live, total, 1.0)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        sc = _lane_scores(q, k_base, k_sd, last, hid_ptr, rows, rs, S, HD, TREE, DOT_F32)
        p = _cast_out(tl.exp(sc - m[:, None]) / total[:, None], q_ptr.dtype.element_ty)
        vt = tl.load(v_base + rs[:, None] * v_ss + d[None, :], mask=rs[:, None] < S, other=0.0)  # [BS, HD]
        if DOT_F32:
            acc = tl.dot(p.to(tl.float32), vt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p, vt.to(p.dtype), acc)
    out = out_ptr + rows[:, None] * (NKV * G * HD) + h[:, None] * HD + d[None, :]
    tl.store(out, _cast_out(acc, out_ptr.dtype.element_ty), mask=live[:, None])
