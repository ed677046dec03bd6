//! The low-bit formats: Q1_0, Q2_0 (the model's expert format), the ternary TQ1_0/TQ2_0 and the
//! FP4 formats MXFP4/NVFP4. This module owns their layouts, dequantizers, ggml's reference
//! quantizers (all deterministic, none takes importance weights) and the scalar reference dot
//! products; `simd::lowbit_x86` reproduces the Q2_0 one bit for bit.
//!
//! Dot-product accumulation orders (integer sums are exact, so only the f32 work is fixed):
//! - Q2_0 × Q8_0 (see [`dot_q2_0_q8_0`]): one exact integer sum per 4-element group (one code
//!   byte), weighted in f32 into 32 lane accumulators, reduced by [`reduce_q2_0`].
//! - Q1_0 × Q8_0: per Q8_0 block (32 elements) `acc = isum.mul_add(d_w * d_x, acc)`, one
//!   accumulator, blocks in order.
//! - MXFP4 × Q8_0: per block `acc = isum.mul_add(d_x * 2^(e-128), acc)`.
//! - NVFP4 × Q8_0: per 16-element sub-block `acc = isum.mul_add(d_x * ue4m3(d_s) / 2, acc)`.
//! - TQ1_0 / TQ2_0 × Q8_K: per 256-element block `acc = isum.mul_add(d_w * d_x, acc)`.

use crate::dot::{f32_to_f16, le_f16, reduce16};
use crate::{FormatFns, GgmlType};

/// Bytes of one Q8_0 block: f16 `d`, then 32 signed codes.
const Q8_0_BYTES: usize = 34;
/// Bytes of one Q8_K block: f32 `d`, 256 signed codes, 16 i16 group sums.
const Q8_K_BYTES: usize = 292;
/// Bytes of one Q2_0 block: f16 `d`, then 16 bytes of 2-bit codes.
pub const Q2_0_BYTES: usize = 18;

/// ggml's `kvalues_mxfp4`: the E2M1 values times two (the scales carry the factor 1/2).
pub const KVALUES_FP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    use GgmlType::*;
    let (dequantize, quantize, dot): (crate::DequantFn, crate::QuantFn, crate::DotFn) = match ty {
        Q1_0 => (deq_q1_0, quant_q1_0, dot_q1_0_q8_0),
        Q2_0 => (deq_q2_0, quant_q2_0, dot_q2_0_q8_0),
        TQ1_0 => (deq_tq1_0, quant_tq1_0, dot_tq1_0_q8_k),
        TQ2_0 => (deq_tq2_0, quant_tq2_0, dot_tq2_0_q8_k),
        MXFP4 => (deq_mxfp4, quant_mxfp4, dot_mxfp4_q8_0),
        NVFP4 => (deq_nvfp4, quant_nvfp4, dot_nvfp4_q8_0),
        _ => return None,
    };
    Some(FormatFns {
        dequantize: Some(dequantize),
        quantize: Some(quantize),
        dot: Some(dot),
    })
}

// ---------------------------------------------------------------------------------------------
// Scale encodings.

/// 2^k as f32 for -149 <= k <= 127 (exact, subnormals included).
#[inline]
fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// E8M0 scale `e` halved, 2^(e-128), as ggml's `ggml_e8m0_to_fp32_half` (e = 255 gives 2^127,
/// not NaN).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    pow2(e as i32 - 128)
}

/// UE4M3 sub-scale to f32, halved (ggml's `ggml_ue4m3_to_fp32`): 0 and 0x7F (NaN) read as 0;
/// the top bit is ignored.
#[inline]
pub fn ue4m3_to_f32(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = ((x >> 3) & 0xf) as i32;
    let man = (x & 7) as f32;
    let raw = if exp == 0 {
        man * pow2(-9)
    } else {
        (1.0 + man / 8.0) * pow2(exp - 7)
    };
    raw * 0.5
}

/// f32 to UE4M3 as ggml's `ggml_fp32_to_ue4m3`: clamps to 448, rounds the mantissa half up,
/// saturates at 0x7E.
pub fn f32_to_ue4m3(x: f32) -> u8 {
    // `!(x > 0)` also catches NaN.
    if x.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return 0;
    }
    let x = if x > 448.0 { 448.0 } else { x };
    let bits = x.to_bits();
    let fp32_exp = ((bits >> 23) & 0xff) as i32 - 127;
    let fp32_man = ((bits >> 20) & 7) as i32;
    let mut e = fp32_exp + 7;
    if e <= 0 {
        // Subnormal: man = round(x * 2^9), clamped to 1..7. x*512 is exact, so ggml's result
        // does not depend on whether its compiler fused the multiply-add.
        let man = (x * 512.0 + 0.5) as i32;
        if man < 1 {
            return 0;
        }
        return man.min(7) as u8;
    }
    if e >= 15 {
        return 0x7e;
    }
    let mut m = fp32_man + ((bits >> 19) & 1) as i32;
    if m > 7 {
        m = 0;
        e += 1;
        if e >= 15 {
            return 0x7e;
        }
    }
    ((e << 3) | m) as u8
}

// ---------------------------------------------------------------------------------------------
// Q1_0: 128 elements, f16 d, 16 bytes of sign bits (bit j of byte j/8: set means +d).

fn deq_q1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(128)) {
        let d = le_f16(b, 0);
        for (j, y) in y.iter_mut().enumerate() {
            *y = if (b[2 + j / 8] >> (j % 8)) & 1 != 0 {
                d
            } else {
                -d
            };
        }
    }
}

/// ggml's `quantize_row_q1_0_ref`: d = mean |x| (summed in order), bit = x >= 0.
fn quant_q1_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(128).zip(dst.chunks_exact_mut(18)) {
        let mut sum_abs = 0f32;
        for v in x {
            sum_abs += v.abs();
        }
        b[..2].copy_from_slice(&f32_to_f16(sum_abs / 128.0).to_le_bytes());
        b[2..].fill(0);
        for (j, v) in x.iter().enumerate() {
            if *v >= 0.0 {
                b[2 + j / 8] |= 1 << (j % 8);
            }
        }
    }
}

fn dot_q1_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb4) in w
        .chunks_exact(18)
        .zip(x.chunks_exact(4 * Q8_0_BYTES))
        .take(n / 128)
    {
        let dw = le_f16(wb, 0);
        for (k, xb) in xb4.chunks_exact(Q8_0_BYTES).enumerate() {
            let mut isum = 0i32;
            for (j, &q) in xb[2..].iter().enumerate() {
                let bit = (wb[2 + 4 * k + j / 8] >> (j % 8)) & 1;
                let q = q as i8 as i32;
                isum += if bit != 0 { q } else { -q };
            }
            acc = (isum as f32).mul_add(dw * le_f16(xb, 0), acc);
        }
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// Q2_0: 64 elements, f16 d, 16 bytes of 2-bit codes (element j: bits 2(j%4) of byte j/4);
// value (code - 1)·d.

fn deq_q2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2_0_BYTES).zip(dst.chunks_exact_mut(64)) {
        let d = le_f16(b, 0);
        for (j, y) in y.iter_mut().enumerate() {
            let q = (b[2 + j / 4] >> (2 * (j % 4))) & 3;
            *y = (q as i32 - 1) as f32 * d;
        }
    }
}

/// ggml's `quantize_row_q2_0_ref`: d = max |x| (so code 3, +2d, is never produced),
/// code = clamp(round_half_away(x · (1/d)) + 1, 0, 3).
fn quant_q2_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(64).zip(dst.chunks_exact_mut(Q2_0_BYTES)) {
        let mut amax = 0f32;
        for v in x {
            let a = v.abs();
            if a > amax {
                amax = a;
            }
        }
        let id = if amax > 0.0 { 1.0 / amax } else { 0.0 };
        b[..2].copy_from_slice(&f32_to_f16(amax).to_le_bytes());
        b[2..].fill(0);
        for (j, v) in x.iter().enumerate() {
            // `as i32` saturates where C's conversion is undefined; for finite input the
            // rounded value is within [-1, 1] anyway.
            let q = ((v * id).round() as i32 + 1).clamp(0, 3);
            b[2 + j / 4] |= (q as u8) << (2 * (j % 4));
        }
    }
}

/// Lane accumulators of the Q2_0 dot product: two sets of 16.
pub const Q2_0_LANES: usize = 32;

/// The Q2_0 × Q8_0 reference. Block `b` (64 elements) has halves `h` = 0, 1, each paired with
/// one Q8_0 block (`s_h = d_w · d_x,h`, exact in f32: two 11-bit significands). Code byte `j`
/// (0..16, half `h = j / 8`) covers elements `4j .. 4j + 3`; its exact integer sum
/// `g = Σ (code − 1)·q` goes to lane `16·(b % 2) + j` as `acc = (g as f32).mul_add(s_h, acc)`,
/// blocks in order; then [`reduce_q2_0`]. Because `s_h` and `g as f32` are exact, every way of
/// forming the product (`g·d_x` then `·d_w`, or `g·(d_w·d_x)`) rounds once, at the add, to the
/// same bits (for finite scales).
pub fn dot_q2_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; Q2_0_LANES];
    let blocks = w
        .chunks_exact(Q2_0_BYTES)
        .zip(x.chunks_exact(2 * Q8_0_BYTES))
        .take(n / 64);
    for (b, (wb, xb2)) in blocks.enumerate() {
        let dw = le_f16(wb, 0);
        let set = 16 * (b % 2);
        for (h, xb) in xb2.chunks_exact(Q8_0_BYTES).enumerate() {
            let s = dw * le_f16(xb, 0);
            for k in 0..8 {
                let byte = wb[2 + 8 * h + k];
                let mut g = 0i32;
                for i in 0..4 {
                    let code = ((byte >> (2 * i)) & 3) as i32;
                    g += (code - 1) * xb[2 + 4 * k + i] as i8 as i32;
                }
                let l = set + 8 * h + k;
                acc[l] = (g as f32).mul_add(s, acc[l]);
            }
        }
    }
    reduce_q2_0(&acc)
}

/// Sum the Q2_0 lanes: lane `l` of 16 takes `acc[l] + acc[16 + l]`, then [`reduce16`].
#[inline]
pub fn reduce_q2_0(acc: &[f32; Q2_0_LANES]) -> f32 {
    let mut t = [0f32; 16];
    for (l, t) in t.iter_mut().enumerate() {
        *t = acc[l] + acc[16 + l];
    }
    reduce16(t)
}

// ---------------------------------------------------------------------------------------------
// TQ1_0: 256 elements = qs[48] (5 trits per byte, base 3, most significant trit first, stored as
// a fixed-point fraction of 256), qh[4] (4 trits per byte), f16 d. Trit t is value (t − 1)·d.

const TQ1_0_BYTES: usize = 54;

/// Trit `n` (0 = most significant) of a TQ1_0 byte.
#[inline]
fn tq1_trit(q: u8, n: usize) -> i32 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let q = q.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i32
}

/// The 256 trits (0, 1, 2) of a TQ1_0 block, in element order.
fn tq1_trits(b: &[u8], out: &mut [i8; 256]) {
    let mut o = 0;
    // qs[0..32]: five rows of 32, then qs[32..48]: five rows of 16, then qh: four rows of 4.
    for (start, len, rows) in [(0usize, 32usize, 5usize), (32, 16, 5), (48, 4, 4)] {
        for n in 0..rows {
            for m in 0..len {
                out[o] = tq1_trit(b[start + m], n) as i8;
                o += 1;
            }
        }
    }
}

fn deq_tq1_0(src: &[u8], dst: &mut [f32]) {
    let mut t = [0i8; 256];
    for (b, y) in src.chunks_exact(TQ1_0_BYTES).zip(dst.chunks_exact_mut(256)) {
        let d = le_f16(b, 52);
        tq1_trits(b, &mut t);
        for (y, &t) in y.iter_mut().zip(&t) {
            *y = (t as i32 - 1) as f32 * d;
        }
    }
}

/// Pack trits (most significant first) as ggml does: base-3 number, times 256/243 rounded up.
#[inline]
fn tq1_pack(trits: impl Iterator<Item = i32>) -> u8 {
    let mut q: u32 = 0;
    for t in trits {
        q = q * 3 + t as u32;
    }
    (q * 256).div_ceil(243) as u8
}

/// ggml's `quantize_row_tq1_0_ref`: d = max |x|, trit = round_half_away(x / d) + 1.
fn quant_tq1_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(TQ1_0_BYTES)) {
        let (id, d) = ternary_scale(x);
        let tr = |v: f32| (v * id).round() as i32 + 1;
        for m in 0..32 {
            b[m] = tq1_pack((0..5).map(|n| tr(x[m + 32 * n])));
        }
        for m in 0..16 {
            b[32 + m] = tq1_pack((0..5).map(|n| tr(x[160 + m + 16 * n])));
        }
        for j in 0..4 {
            // Four trits, then a zero trit so the first lands most significant.
            b[48 + j] = tq1_pack((0..4).map(|m| tr(x[240 + j + 4 * m])).chain([0]));
        }
        b[52..54].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    }
}

/// (1/d, d) with d = max |x| over a ternary block (1/d = 0 for an all-zero block).
fn ternary_scale(x: &[f32]) -> (f32, f32) {
    let mut amax = 0f32;
    for v in x {
        // ggml's MAX(a, b) is `a > b ? a : b`.
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    (if amax != 0.0 { 1.0 / amax } else { 0.0 }, amax)
}

/// Q8_K block: (d, the 256 codes).
#[inline]
fn q8_k(xb: &[u8]) -> (f32, &[u8]) {
    (
        f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]),
        &xb[4..260],
    )
}

fn dot_tq1_0_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    let mut t = [0i8; 256];
    for (wb, xb) in w
        .chunks_exact(TQ1_0_BYTES)
        .zip(x.chunks_exact(Q8_K_BYTES))
        .take(n / 256)
    {
        tq1_trits(wb, &mut t);
        let (dx, q) = q8_k(xb);
        let isum: i32 = t
            .iter()
            .zip(q)
            .map(|(&t, &q)| (t as i32 - 1) * q as i8 as i32)
            .sum();
        acc = (isum as f32).mul_add(le_f16(wb, 52) * dx, acc);
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// TQ2_0: 256 elements = qs[64], f16 d. Within each 32-byte group j, element 128·(j/32) +
// 32·l + m is bits 2l of qs[j + m].

const TQ2_0_BYTES: usize = 66;

#[inline]
fn tq2_code(b: &[u8], e: usize) -> i32 {
    let (j, l, m) = (32 * (e / 128), (e % 128) / 32, e % 32);
    ((b[j + m] >> (2 * l)) & 3) as i32
}

fn deq_tq2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(TQ2_0_BYTES).zip(dst.chunks_exact_mut(256)) {
        let d = le_f16(b, 64);
        for (e, y) in y.iter_mut().enumerate() {
            *y = (tq2_code(b, e) - 1) as f32 * d;
        }
    }
}

/// ggml's `quantize_row_tq2_0_ref`.
fn quant_tq2_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(TQ2_0_BYTES)) {
        let (id, d) = ternary_scale(x);
        for j in (0..64).step_by(32) {
            for m in 0..32 {
                let mut q = 0u8;
                for l in 0..4 {
                    let t = (x[4 * j + 32 * l + m] * id).round() as i32 + 1;
                    q |= ((t & 3) as u8) << (2 * l);
                }
                b[j + m] = q;
            }
        }
        b[64..66].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    }
}

fn dot_tq2_0_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb) in w
        .chunks_exact(TQ2_0_BYTES)
        .zip(x.chunks_exact(Q8_K_BYTES))
        .take(n / 256)
    {
        let (dx, q) = q8_k(xb);
        let isum: i32 = q
            .iter()
            .enumerate()
            .map(|(e, &q)| (tq2_code(wb, e) - 1) * q as i8 as i32)
            .sum();
        acc = (isum as f32).mul_add(le_f16(wb, 64) * dx, acc);
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// MXFP4: 32 elements = E8M0 e, qs[16] (nibble split); value kvalues_fp4[q] · 2^(e−128).

const MXFP4_BYTES: usize = 17;

fn deq_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(MXFP4_BYTES).zip(dst.chunks_exact_mut(32)) {
        let d = e8m0_half(b[0]);
        for j in 0..16 {
            y[j] = KVALUES_FP4[(b[1 + j] & 15) as usize] as f32 * d;
            y[j + 16] = KVALUES_FP4[(b[1 + j] >> 4) as usize] as f32 * d;
        }
    }
}

/// The FP4 code nearest `x / d` (the first of equals), as ggml's `best_index_mxfp4`. The
/// products `k·d` are exact (k has at most 4 significant bits, d at most 4), so the result does
/// not depend on whether the C compiler fused `k·d − x`.
#[inline]
fn best_index_fp4(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_FP4[0] as f32 * d - x).abs();
    for (i, &k) in KVALUES_FP4.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// ggml's `quantize_row_mxfp4_ref`: e = floor(log2(max |x|)) − 2 + 127 (0 for an all-zero
/// block), each element the nearest FP4 value.
fn quant_mxfp4(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(MXFP4_BYTES)) {
        let mut amax = 0f32;
        for v in x {
            if amax < v.abs() {
                amax = v.abs();
            }
        }
        // `f32::log2` is the platform's log2f, as in ggml (correct rounding matters right below
        // powers of two). The C float-to-u8 conversion goes through a 32-bit integer on x86.
        let e = if amax > 0.0 {
            ((amax.log2().floor() - 2.0 + 127.0) as i32) as u8
        } else {
            0
        };
        let d = e8m0_half(e);
        b[0] = e;
        for j in 0..16 {
            b[1 + j] = best_index_fp4(x[j], d) | (best_index_fp4(x[j + 16], d) << 4);
        }
    }
}

fn dot_mxfp4_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb) in w
        .chunks_exact(MXFP4_BYTES)
        .zip(x.chunks_exact(Q8_0_BYTES))
        .take(n / 32)
    {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += KVALUES_FP4[(wb[1 + j] & 15) as usize] as i32 * xb[2 + j] as i8 as i32;
            isum += KVALUES_FP4[(wb[1 + j] >> 4) as usize] as i32 * xb[18 + j] as i8 as i32;
        }
        acc = (isum as f32).mul_add(le_f16(xb, 0) * e8m0_half(wb[0]), acc);
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// NVFP4: 64 elements = 4 UE4M3 sub-scales d[4] (one per 16 elements), qs[32]; sub-block s uses
// qs[8s..8s+8], nibble split within the sub-block.

const NVFP4_BYTES: usize = 36;

fn deq_nvfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(NVFP4_BYTES).zip(dst.chunks_exact_mut(64)) {
        for (s, y) in y.chunks_exact_mut(16).enumerate() {
            let d = ue4m3_to_f32(b[s]);
            for j in 0..8 {
                let q = b[4 + 8 * s + j];
                y[j] = KVALUES_FP4[(q & 15) as usize] as f32 * d;
                y[j + 8] = KVALUES_FP4[(q >> 4) as usize] as f32 * d;
            }
        }
    }
}

/// ggml's `quantize_row_nvfp4_ref`: per 16 elements, scale = UE4M3(max |x| / 6).
fn quant_nvfp4(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(64).zip(dst.chunks_exact_mut(NVFP4_BYTES)) {
        for (s, xs) in x.chunks_exact(16).enumerate() {
            let mut amax = 0f32;
            for v in xs {
                if amax < v.abs() {
                    amax = v.abs();
                }
            }
            let ue = f32_to_ue4m3(amax / 6.0);
            b[s] = ue;
            let d = ue4m3_to_f32(ue);
            for j in 0..8 {
                b[4 + 8 * s + j] = best_index_fp4(xs[j], d) | (best_index_fp4(xs[j + 8], d) << 4);
            }
        }
    }
}

fn dot_nvfp4_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    let blocks = w
        .chunks_exact(NVFP4_BYTES)
        .zip(x.chunks_exact(2 * Q8_0_BYTES))
        .take(n / 64);
    for (wb, xb2) in blocks {
        for s in 0..4 {
            let xb = &xb2[Q8_0_BYTES * (s / 2)..];
            let off = 2 + 16 * (s % 2);
            let mut isum = 0i32;
            for j in 0..8 {
                let q = wb[4 + 8 * s + j];
                isum += KVALUES_FP4[(q & 15) as usize] as i32 * xb[off + j] as i8 as i32;
                isum += KVALUES_FP4[(q >> 4) as usize] as i32 * xb[off + 8 + j] as i8 as i32;
            }
            acc = (isum as f32).mul_add(le_f16(xb, 0) * ue4m3_to_f32(wb[s]), acc);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue4m3_round_trips_every_code() {
        // Every code below exponent 15 decodes and re-encodes to itself.
        for c in 1u8..0x78 {
            let v = ue4m3_to_f32(c) * 2.0;
            assert_eq!(f32_to_ue4m3(v), c, "code {c:#x} value {v}");
        }
        // ggml's encoder saturates the whole top binade (256..448) to 0x7E.
        for c in 0x78u8..0x7f {
            assert_eq!(f32_to_ue4m3(ue4m3_to_f32(c) * 2.0), 0x7e, "code {c:#x}");
        }
        assert_eq!(f32_to_ue4m3(1e9), 0x7e);
        assert_eq!(f32_to_ue4m3(-1.0), 0);
        assert_eq!(f32_to_ue4m3(f32::NAN), 0);
    }

    #[test]
    fn e8m0_covers_subnormals() {
        assert_eq!(e8m0_half(0).to_bits(), 0x0020_0000);
        assert_eq!(e8m0_half(1).to_bits(), 0x0040_0000);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(255), 2f32.powi(127));
    }
}
