//! The "legacy" 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and IQ4_NL.
//! This module owns their layouts, dequantizers, quantizers (ggml's reference ones for weights,
//! the CPU backend's `from_float` ones for the activation types Q8_0/Q8_1) and the scalar
//! reference dot products that `simd::legacy_x86` reproduces bit for bit.

use crate::dot::{f32_to_f16, le_f16, le_u32, reduce8};
use crate::{DequantFn, DotFn, FormatFns, GgmlType, Isa, QuantError, QuantFn};

/// Elements per block for every type of this family.
pub const QK: usize = 32;

/// IQ4_NL's 16 non-linear levels (ggml's `kvalues_iq4nl`).
pub const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    use GgmlType::*;
    let f = |dequantize: DequantFn, quantize: QuantFn, dot: Option<DotFn>| FormatFns {
        dequantize: Some(dequantize),
        quantize: Some(quantize),
        dot,
    };
    Some(match ty {
        Q4_0 => f(dequantize_q4_0, quantize_row_q4_0, Some(dot_q4_0_q8_0)),
        Q4_1 => f(dequantize_q4_1, quantize_row_q4_1, Some(dot_q4_1_q8_1)),
        Q5_0 => f(dequantize_q5_0, quantize_row_q5_0, Some(dot_q5_0_q8_0)),
        Q5_1 => f(dequantize_q5_1, quantize_row_q5_1, Some(dot_q5_1_q8_1)),
        // `quantize` is the activation quantizer (what ggml's matmuls feed the dot products);
        // ggml's weight quantizer is `quantize_row_q8_0_ref`. They differ in about 2 codes
        // per million, on near-ties.
        Q8_0 => f(dequantize_q8_0, quantize_row_q8_0_act, Some(dot_q8_0_q8_0)),
        Q8_1 => f(dequantize_q8_1, quantize_row_q8_1, None),
        IQ4_NL => f(
            dequantize_iq4_nl,
            quantize_row_iq4_nl,
            Some(dot_iq4_nl_q8_0),
        ),
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Block layouts (bytes): Q4_0 d:f16 qs[16] | Q4_1 d m qs[16] | Q5_0 d qh:u32 qs[16]
// | Q5_1 d m qh qs[16] | Q8_0 d qs:i8[32] | Q8_1 d s qs[32] | IQ4_NL d qs[16].
// Nibble j of qs holds element j (low) and element j+16 (high).

fn put_f16(b: &mut [u8], o: usize, x: f32) {
    b[o..o + 2].copy_from_slice(&f32_to_f16(x).to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Dequantization: ggml-base is built without FMA, so `q*d + m` is a rounded product then a
// rounded sum, never fused.

fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        for j in 0..16 {
            y[j] = ((b[2 + j] & 0xf) as i32 - 8) as f32 * d;
            y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        let m = le_f16(b, 2);
        for j in 0..16 {
            y[j] = (b[4 + j] & 0xf) as f32 * d + m;
            y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
        }
    }
}

/// The 5-bit codes of a Q5 block: low nibbles from `qs`, bit 4 from `qh` (bit j for element j).
fn q5_codes(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut c = [0u8; 32];
    for j in 0..16 {
        c[j] = (qs[j] & 0xf) | ((((qh >> j) & 1) as u8) << 4);
        c[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    c
}

fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        let c = q5_codes(le_u32(b, 2), &b[6..22]);
        for j in 0..QK {
            y[j] = (c[j] as i32 - 16) as f32 * d;
        }
    }
}

fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        let m = le_f16(b, 2);
        let c = q5_codes(le_u32(b, 4), &b[8..24]);
        for j in 0..QK {
            y[j] = c[j] as f32 * d + m;
        }
    }
}

fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::supported(Isa::Avx2) {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { dequantize_q8_0_avx2(src, dst) };
    }
    dequantize_q8_0_body(src, dst)
}

/// [`dequantize_q8_0_body`] compiled for AVX2: the same IEEE operations, eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequantize_q8_0_avx2(src: &[u8], dst: &mut [f32]) {
    dequantize_q8_0_body(src, dst)
}

#[inline(always)]
fn dequantize_q8_0_body(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        for j in 0..QK {
            y[j] = b[2 + j] as i8 as f32 * d;
        }
    }
}

fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(36).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        for j in 0..QK {
            y[j] = b[4 + j] as i8 as f32 * d;
        }
    }
}

fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = le_f16(b, 0);
        for j in 0..16 {
            y[j] = d * IQ4NL_VALUES[(b[2 + j] & 0xf) as usize] as f32;
            y[j + 16] = d * IQ4NL_VALUES[(b[2 + j] >> 4) as usize] as f32;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantization.

/// Largest |x| of a block, starting from 0 (so an all-zero block gives 0).
/// `v.round_ties_even() as i8`, for every `v`, without the `roundevenf` library call that
/// `round_ties_even` becomes on the baseline x86-64 target (no SSE4.1): adding and subtracting
/// 1.5·2^23 rounds to the nearest integer, ties to even, for |v| ≤ 2^22; beyond that (and for
/// infinities) the sum keeps the sign and `as i8` saturates exactly as it does for the rounded
/// value; NaN stays NaN and converts to 0 either way. Plain code, so the loops vectorize.
#[inline(always)]
pub(crate) fn round_to_i8(v: f32) -> i8 {
    const MAGIC: f32 = 12582912.0;
    ((v + MAGIC) - MAGIC) as i8
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// ggml's reference Q8_0 quantizer (`quantize_row_q8_0_ref`, used by `ggml_quantize_chunk`, so
/// by model converters): `d = amax/127`, `q = round_half_away(x * (1/d))`. This is what a Q8_0
/// *weight* file holds. Activations are quantized differently by ggml's CPU backend: see
/// [`quantize_row_q8_0_act`].
pub fn quantize_row_q8_0_ref(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let d = amax(x) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..QK {
            b[2 + j] = (x[j] * id).round() as i8 as u8;
        }
    }
}

/// ggml's x86 CPU-backend activation quantizer for Q8_0 (`from_float`, the AVX path): it differs
/// from [`quantize_row_q8_0_ref`] twice: the multiplier is `127/amax` (not `1/(amax/127)`), and it
/// rounds ties to even (`_mm256_round_ps`), so a few codes differ by one. ggml's matmuls quantize
/// activations with this, so dot products that must match ggml use it. On random normal data
/// about 2 codes per million differ from the reference quantizer; the fixtures hold none of
/// them. Non-finite inputs give unspecified codes (ggml's pack saturates NaN to -128, this to 0).
pub fn quantize_row_q8_0_act(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let m = amax(x);
        let d = m / 127.0;
        let id = if m != 0.0 { 127.0 / m } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..QK {
            b[2 + j] = round_to_i8(x[j] * id) as u8;
        }
    }
}

/// ggml's x86 CPU-backend Q8_1 quantizer (`from_float`, as [`quantize_row_q8_0_act`]) plus the
/// block sum `s = f16(d * sum(q))`. Q8_1 exists only as the activation type of Q4_1/Q5_1.
pub fn quantize_row_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(36)) {
        let m = amax(x);
        let d = m / 127.0;
        let id = if m != 0.0 { 127.0 / m } else { 0.0 };
        put_f16(b, 0, d);
        let mut sum = 0i32;
        for j in 0..QK {
            let q = round_to_i8(x[j] * id);
            sum += q as i32;
            b[4 + j] = q as u8;
        }
        put_f16(b, 2, d * sum as f32);
    }
}

/// ggml's reference Q8_1 quantizer (`quantize_row_q8_1_ref`): `1/d` multiplier, ties away.
pub fn quantize_row_q8_1_ref(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(36)) {
        let d = amax(x) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let mut sum = 0i32;
        for j in 0..QK {
            let q = (x[j] * id).round() as i8;
            sum += q as i32;
            b[4 + j] = q as u8;
        }
        put_f16(b, 2, sum as f32 * d);
    }
}

/// Largest |x| of a block and the signed value that has it (the first one on ties).
fn signed_amax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Smallest and largest value of a block.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's float-to-`int8_t` then clamp, as ggml writes `MIN(top, (int8_t)(v + bias))`: truncation
/// toward zero; `as i8` saturates where C would be undefined.
fn trunc_code(v: f32, top: i32) -> u8 {
    (v as i8 as i32).min(top) as u8
}

/// ggml's `quantize_row_q4_0_ref`: `d = max/-8` (max = the signed value of largest magnitude),
/// `q = min(15, trunc(x/d + 8.5))`.
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
        let (_, max) = signed_amax(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..16 {
            let lo = trunc_code(x[j] * id + 8.5, 15);
            let hi = trunc_code(x[j + 16] * id + 8.5, 15);
            b[2 + j] = lo | (hi << 4);
        }
    }
}

/// ggml's `quantize_row_q4_1_ref`: `d = (max-min)/15`, `m = min`, `q = min(15, trunc((x-min)/d + 0.5))`.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(20)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        for j in 0..16 {
            let lo = trunc_code((x[j] - min) * id + 0.5, 15);
            let hi = trunc_code((x[j + 16] - min) * id + 0.5, 15);
            b[4 + j] = lo | (hi << 4);
        }
    }
}

/// Pack 32 five-bit codes as Q5 stores them: `qh` bit j = bit 4 of code j, nibbles as Q4.
fn put_q5(codes: &[u8; 32], qh_out: &mut [u8], qs_out: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        qs_out[j] = (codes[j] & 0xf) | ((codes[j + 16] & 0xf) << 4);
        qh |= (((codes[j] >> 4) & 1) as u32) << j;
        qh |= (((codes[j + 16] >> 4) & 1) as u32) << (j + 16);
    }
    qh_out.copy_from_slice(&qh.to_le_bytes());
}

/// ggml's `quantize_row_q5_0_ref`: `d = max/-16`, `q = min(31, trunc(x/d + 16.5))`.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(22)) {
        let (_, max) = signed_amax(x);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let mut c = [0u8; 32];
        for j in 0..QK {
            c[j] = trunc_code(x[j] * id + 16.5, 31);
        }
        let (qh, qs) = b[2..].split_at_mut(4);
        put_q5(&c, qh, qs);
    }
}

/// ggml's `quantize_row_q5_1_ref`: `d = (max-min)/31`, `m = min`, `q = trunc((x-min)/d + 0.5)`
/// (ggml does not clamp here; only the low 5 bits are stored).
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(24)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let mut c = [0u8; 32];
        for j in 0..QK {
            c[j] = ((x[j] - min) * id + 0.5) as u8;
        }
        let (qh, qs) = b[4..].split_at_mut(4);
        put_q5(&c, qh, qs);
    }
}

/// Index of the level of `values` (ascending) nearest to `x`; ties go to the upper level, as
/// ggml's `best_index_int8`.
fn best_index(values: &[i8; 16], x: f32) -> usize {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < values[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (values[hi - 1] as f32) < (values[hi] as f32) - x {
        hi - 1
    } else {
        hi
    }
}

/// One IQ4_NL block by ggml's search (`quantize_row_iq4_nl_impl` with one 32-element block and
/// `ntry = 7`): a first scale from the largest value, then 15 trial scales, keeping the one
/// with the best weighted fit. `qw`: None gives ggml's `x²` weighting (no importance matrix),
/// Some(qw) gives `qw[j] * sqrt(sigma2 + x[j]²)` (not checked against ggml: the fixtures hold
/// no imatrix quantization).
fn quantize_block_iq4_nl(x: &[f32], qw: Option<&[f32]>, out: &mut [u8]) {
    const NTRY: i32 = 7;
    let values = &IQ4NL_VALUES;
    let mut sigma2 = 0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / QK as f32;
    let mut weight = [0f32; QK];
    for j in 0..QK {
        weight[j] = match qw {
            Some(q) => q[j] * (sigma2 + x[j] * x[j]).sqrt(),
            None => x[j] * x[j],
        };
    }
    let (amax, max) = signed_amax(x);
    let mut d = 0f32;
    if amax >= 1e-15 {
        let fit = |id: f32| {
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for j in 0..QK {
                let q = values[best_index(values, id * x[j])] as f32;
                let w = weight[j];
                sumqx += w * q * x[j];
                sumq2 += w * q * q;
            }
            (sumqx, sumq2)
        };
        let d0 = -max / values[0] as f32;
        let (sumqx, sumq2) = fit(1.0 / d0);
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let (sumqx, sumq2) = fit((itry + values[0] as i32) as f32 / max);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
    }
    put_f16(out, 0, d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for j in 0..16 {
        let lo = best_index(values, id * x[j]) as u8;
        let hi = best_index(values, id * x[j + 16]) as u8;
        out[2 + j] = lo | (hi << 4);
    }
}

/// ggml's IQ4_NL quantizer as `ggml_quantize_chunk` runs it without an importance matrix
/// (`quantize_iq4_nl(.., NULL)`: weights `x²`, 15 trial scales per block).
pub fn quantize_row_iq4_nl(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
        quantize_block_iq4_nl(x, None, b);
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar reference dot products.
//
// Every legacy dot uses one accumulation order, chosen so that an 8-lane (AVX2) and a 16-lane
// (AVX-512) kernel both reproduce it while keeping four independent FMA chains in flight:
// - block b, lane l (0..8): `p[b][l] = Σ_{k<4} w[b][4l+k] * x[b][4l+k]`, an exact i32 sum of the
//   integer codes (what `maddubs`+`madd` or `dpbusd` leave in 32-bit lane l);
// - `d_b = f16(w.d) * f16(x.d)`, one f32 rounding;
// - `acc[b % 4][l] = mul_add(d_b, p[b][l] as f32, acc[b % 4][l])`, all accumulators from +0;
// - result: `s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l])`, then `reduce8(s)`.
// A 16-lane kernel that keeps blocks (4i, 4i+1) and (4i+2, 4i+3) in the two halves of two zmm
// accumulators A and B gets exactly this from `A + B` then `reduce16`.
// The Q8_1 pairs add a second term per block, `m_w * s_x`, accumulated in `macc[b % 4]` with
// `mul_add`, and return `reduce8(s) + ((macc[0] + macc[2]) + (macc[1] + macc[3]))`.

/// Number of interleaved accumulator groups (blocks are dealt round-robin among them).
pub const GROUPS: usize = 4;

/// The shared accumulation: `block(b)` gives `d_b` and the eight lane sums of block `b`.
#[inline(always)]
fn accumulate(nb: usize, mut block: impl FnMut(usize) -> (f32, [i32; 8])) -> f32 {
    let mut acc = [[0f32; 8]; GROUPS];
    for b in 0..nb {
        let (d, p) = block(b);
        let a = &mut acc[b % GROUPS];
        for l in 0..8 {
            a[l] = d.mul_add(p[l] as f32, a[l]);
        }
    }
    reduce8(combine_groups(&acc))
}

/// `(acc0 + acc2) + (acc1 + acc3)` per lane.
#[inline(always)]
fn combine_groups(acc: &[[f32; 8]; GROUPS]) -> [f32; 8] {
    let mut s = [0f32; 8];
    for l in 0..8 {
        s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    s
}

/// Lane sums of 32 signed weight codes against 32 activation codes.
#[inline(always)]
fn lane_sums(w: &[i32; 32], x: &[u8]) -> [i32; 8] {
    let mut p = [0i32; 8];
    for l in 0..8 {
        for k in 0..4 {
            p[l] += w[4 * l + k] * (x[4 * l + k] as i8 as i32);
        }
    }
    p
}

/// Q8_0 block `b` of row `x`: (scale, the 32 code bytes).
#[inline(always)]
fn q8_0_block(x: &[u8], b: usize) -> (f32, &[u8]) {
    let blk = &x[b * 34..b * 34 + 34];
    (le_f16(blk, 0), &blk[2..])
}

/// Signed codes of a nibble-packed block: element j from the low nibble of `qs[j]`, element j+16
/// from the high nibble, each mapped through `map`.
#[inline(always)]
fn nibbles(qs: &[u8], map: impl Fn(u8) -> i32) -> [i32; 32] {
    let mut w = [0i32; 32];
    for j in 0..16 {
        w[j] = map(qs[j] & 0xf);
        w[j + 16] = map(qs[j] >> 4);
    }
    w
}

/// Q4_0 weight row · Q8_0 activation row (codes `q - 8`), in the order described above.
pub fn dot_q4_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate(n / QK, |b| {
        let wb = &w[b * 18..b * 18 + 18];
        let (dx, xq) = q8_0_block(x, b);
        let c = nibbles(&wb[2..], |q| q as i32 - 8);
        (le_f16(wb, 0) * dx, lane_sums(&c, xq))
    })
}

/// Q5_0 weight row · Q8_0 activation row (codes `q - 16`), in the order described above.
pub fn dot_q5_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate(n / QK, |b| {
        let wb = &w[b * 22..b * 22 + 22];
        let (dx, xq) = q8_0_block(x, b);
        let codes = q5_codes(le_u32(wb, 2), &wb[6..22]);
        let c: [i32; 32] = std::array::from_fn(|j| codes[j] as i32 - 16);
        (le_f16(wb, 0) * dx, lane_sums(&c, xq))
    })
}

/// Q8_0 weight row · Q8_0 activation row, in the order described above.
pub fn dot_q8_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate(n / QK, |b| {
        let (dw, wq) = q8_0_block(w, b);
        let (dx, xq) = q8_0_block(x, b);
        let c: [i32; 32] = std::array::from_fn(|j| wq[j] as i8 as i32);
        (dw * dx, lane_sums(&c, xq))
    })
}

/// IQ4_NL weight row · Q8_0 activation row (codes through [`IQ4NL_VALUES`]), in the order
/// described above.
pub fn dot_iq4_nl_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate(n / QK, |b| {
        let wb = &w[b * 18..b * 18 + 18];
        let (dx, xq) = q8_0_block(x, b);
        let c = nibbles(&wb[2..], |q| IQ4NL_VALUES[q as usize] as i32);
        (le_f16(wb, 0) * dx, lane_sums(&c, xq))
    })
}

/// The Q8_1-paired accumulation: as [`accumulate`], plus `macc[b % 4] = mul_add(m_w, s_x, ..)`;
/// `block(b)` gives `(d_b, m_w, s_x, lane sums)`.
#[inline(always)]
fn accumulate_q8_1(nb: usize, mut block: impl FnMut(usize) -> (f32, f32, f32, [i32; 8])) -> f32 {
    let mut acc = [[0f32; 8]; GROUPS];
    let mut macc = [0f32; GROUPS];
    for b in 0..nb {
        let (d, m, s, p) = block(b);
        let g = b % GROUPS;
        for l in 0..8 {
            acc[g][l] = d.mul_add(p[l] as f32, acc[g][l]);
        }
        macc[g] = m.mul_add(s, macc[g]);
    }
    reduce8(combine_groups(&acc)) + ((macc[0] + macc[2]) + (macc[1] + macc[3]))
}

/// Q8_1 block `b` of row `x`: (d, s, the 32 code bytes).
#[inline(always)]
fn q8_1_block(x: &[u8], b: usize) -> (f32, f32, &[u8]) {
    let blk = &x[b * 36..b * 36 + 36];
    (le_f16(blk, 0), le_f16(blk, 2), &blk[4..])
}

/// Q4_1 weight row · Q8_1 activation row: `d_w*d_x * Σ q*x` (unsigned codes) in the order
/// described above, plus the `m_w * s_x` terms.
pub fn dot_q4_1_q8_1(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate_q8_1(n / QK, |b| {
        let wb = &w[b * 20..b * 20 + 20];
        let (dx, sx, xq) = q8_1_block(x, b);
        let c = nibbles(&wb[4..], |q| q as i32);
        (le_f16(wb, 0) * dx, le_f16(wb, 2), sx, lane_sums(&c, xq))
    })
}

/// Q5_1 weight row · Q8_1 activation row, as [`dot_q4_1_q8_1`] with 5-bit codes.
pub fn dot_q5_1_q8_1(n: usize, w: &[u8], x: &[u8]) -> f32 {
    accumulate_q8_1(n / QK, |b| {
        let wb = &w[b * 24..b * 24 + 24];
        let (dx, sx, xq) = q8_1_block(x, b);
        let codes = q5_codes(le_u32(wb, 4), &wb[8..24]);
        let c: [i32; 32] = std::array::from_fn(|j| codes[j] as i32);
        (le_f16(wb, 0) * dx, le_f16(wb, 2), sx, lane_sums(&c, xq))
    })
}

// ---------------------------------------------------------------------------------------------
// Several activation rows against one weight row.

/// `out[r] = w · xs[r]` for every activation row, on `isa`, each bit for bit what
/// [`crate::vec_dot_isa`] gives for that row alone (so a verify window of up to 8 tokens equals
/// decoding them one at a time). The SIMD kernels read the weight row once per 8 rows and keep
/// every row's accumulators in registers. Types: Q4_0, Q5_0, Q8_0, IQ4_NL (Q8_0 activations)
/// and Q4_1, Q5_1 (Q8_1 activations, scalar, one row at a time).
pub fn dot_rows(
    ty: GgmlType,
    isa: Isa,
    n: usize,
    w: &[u8],
    xs: &[&[u8]],
    out: &mut [f32],
) -> Result<(), QuantError> {
    use GgmlType::*;
    let xty = match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        _ => {
            return Err(QuantError::Unsupported {
                ty,
                what: "multi-row dot product",
            })
        }
    };
    crate::check_bytes(ty, n, w.len(), "weight row")?;
    for x in xs {
        crate::check_bytes(xty, n, x.len(), "activation row")?;
    }
    if out.len() != xs.len() {
        return Err(QuantError::Length {
            ty,
            what: "output (one slot per activation row)",
            got: out.len(),
            expected: xs.len(),
        });
    }
    if isa != Isa::Scalar && crate::simd::supported(isa) {
        if let Some(f) = crate::simd::legacy_x86::dot_rows(ty, isa) {
            f(n, w, xs, out);
            return Ok(());
        }
    }
    let f = crate::dot_fn(ty, isa).ok_or(QuantError::Unsupported {
        ty,
        what: "dot product",
    })?;
    for (o, x) in out.iter_mut().zip(xs) {
        *o = f(n, w, x);
    }
    Ok(())
}

/// [`dot_rows`] for a Q8_0 weight row on this CPU's best ISA.
pub fn dot_rows_q8_0(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) -> Result<(), QuantError> {
    dot_rows(GgmlType::Q8_0, crate::simd::best(), n, w, xs, out)
}

/// [`dot_rows`] for a Q4_0 weight row on this CPU's best ISA.
pub fn dot_rows_q4_0(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) -> Result<(), QuantError> {
    dot_rows(GgmlType::Q4_0, crate::simd::best(), n, w, xs, out)
}

#[cfg(test)]
mod rounding_tests {
    use super::round_to_i8;

    fn check(v: f32) {
        assert_eq!(
            round_to_i8(v),
            v.round_ties_even() as i8,
            "{v:e} ({:#010x})",
            v.to_bits()
        );
    }

    /// The magic-constant rounding equals `round_ties_even` then the saturating cast, over
    /// every halfway point and its neighbours in the quantizer's range, the edges of the magic
    /// constant's range, special values, and a stride through all 2^32 bit patterns.
    #[test]
    fn round_to_i8_is_round_ties_even() {
        for i in -300i32..=300 {
            let h = i as f32 + 0.5;
            for v in [
                h,
                f32::from_bits(h.to_bits() + 1),
                f32::from_bits(h.to_bits() - 1),
            ] {
                check(v);
                check(-v);
            }
            check(i as f32);
        }
        for e in [4194304.0f32, 8388608.0, 12582912.0, 16777216.0] {
            for d in -4i32..=4 {
                let v = f32::from_bits((e.to_bits() as i32 + d) as u32);
                check(v);
                check(-v);
            }
        }
        for v in [
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ] {
            check(v);
            check(-v);
        }
        let mut bits = 0u32;
        for _ in 0..(1 << 22) {
            check(f32::from_bits(bits));
            bits = bits.wrapping_add(1021);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod dequantize_avx2_tests {
    use super::*;

    /// The AVX2 build of the Q8_0 dequantizer equals the baseline build bit for bit.
    #[test]
    fn q8_0_avx2_equals_the_baseline_build() {
        if !crate::simd::supported(Isa::Avx2) {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut b = vec![0u8; 64 * 34];
        for x in b.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = (s >> 32) as u8;
        }
        let (mut a, mut v) = (vec![0f32; 64 * QK], vec![0f32; 64 * QK]);
        dequantize_q8_0_body(&b, &mut a);
        // SAFETY: AVX2 checked above.
        unsafe { dequantize_q8_0_avx2(&b, &mut v) };
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&v));
    }
}
