//! The K-quant family: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights (256-element super-blocks with
//! per-sub-block scales) and their activation type Q8_K. This module owns their layouts,
//! dequantizers, ggml's reference quantizers, and the scalar reference dot products whose
//! float order the SIMD kernels in `simd::kquants_x86` reproduce bit for bit.
//!
//! # Dot-product accumulation order (the contract every SIMD kernel reproduces)
//!
//! The float work runs in 8 lanes (dot.rs): a kernel keeps 8 f32 accumulators `acc` (and, for
//! the types with a minimum, Q2_K/Q4_K/Q5_K, 8 more `accm`), all starting at +0.0.
//! Per super-block, in block order:
//! - 8 exact integer lane sums `I[l]` (and `M[l]`), in i32 with wrapping (two's complement)
//!   arithmetic, so any grouping gives the same bits even on adversarial bytes (valid data
//!   never wraps). Element `e` (0..256) of the block adds `sc(e)·q_e·qx_e` to lane
//!   `(e mod 32) / 4`, where `sc(e)` is the integer scale of its sub-block and `q_e` its code
//!   as defined per type below; this is where a 256-bit `maddubs`/`madd` chain over 32
//!   consecutive elements leaves each product, and where a 512-bit kernel's lanes `l` and
//!   `l + 8` over 64 consecutive elements land once added;
//! - `D = x.d * w.d` and `Dm = x.d * w.dmin` (f32 products), then per lane, fused:
//!   `acc[l] = D.mul_add(I[l] as f32, acc[l])`, `accm[l] = Dm.mul_add(M[l] as f32, accm[l])`.
//!
//! The result is `reduce8(acc) - reduce8(accm)` (Q3_K, Q6_K: `reduce8(acc)`), with
//! [`crate::dot::reduce8`]'s fixed tree.
//!
//! Types, with `bs[g]` the Q8_K group sums (`bsums`) of the activation block:
//! - Q2_K: 16 sub-blocks of 16, `q` in 0..=3, scale `sc_s = scales[s] & 15`;
//!   `M[l] = m_2l·bs[2l] + m_2l+1·bs[2l+1]` with `m_s = scales[s] >> 4`.
//! - Q3_K: 16 sub-blocks of 16, `q = low 2 bits | hmask bit << 2` in 0..=7, scale `sc_s − 32`;
//!   then `I[l] −= 4·(sc'_2l·bs[2l] + sc'_2l+1·bs[2l+1])` (`sc' = sc − 32`), which turns the
//!   unsigned codes into ggml's `q − 4` whenever `bsums` are the sums of `qs`.
//! - Q4_K / Q5_K: 8 sub-blocks of 32, `q` in 0..=15 / 0..=31, 6-bit scales `sc_s`;
//!   `M[l] = m_l·(bs[2l] + bs[2l+1])` (lane `l` carries sub-block `l`'s min).
//! - Q6_K: 16 sub-blocks of 16, `q` in 0..=63, i8 scales `sc_s`; then
//!   `I[l] −= 32·(sc_2l·bs[2l] + sc_2l+1·bs[2l+1])`, ggml's `q − 32` in the same way.
//!
//! Keeping the float work per lane spares every block a horizontal integer sum: a block costs
//! one conversion and one fused multiply-add per accumulator.

// Loops index several arrays with layout arithmetic; iterators would obscure the layout.
#![allow(clippy::needless_range_loop)]

use crate::dot::{f32_to_f16, le_f16, reduce8};
use crate::{FormatFns, GgmlType};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Q8_K block layout: f32 `d` at 0, i8 `qs[256]` at [`Q8K_QS`], i16 `bsums[16]` at
/// [`Q8K_BSUMS`] (each the sum of 16 consecutive `qs`).
pub const Q8K_BYTES: usize = 292;
pub const Q8K_QS: usize = 4;
pub const Q8K_BSUMS: usize = 4 + QK_K;

/// Bytes per block of each weight type.
pub const Q2K_BYTES: usize = 84;
pub const Q3K_BYTES: usize = 110;
pub const Q4K_BYTES: usize = 144;
pub const Q5K_BYTES: usize = 176;
pub const Q6K_BYTES: usize = 210;

// Byte layouts (ggml-common.h):
// Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | f16 d @80 | f16 dmin @82
// Q3_K: hmask[32] | qs[64] @32 | scales[12] @96 (16 six-bit values) | f16 d @108
// Q4_K: f16 d | f16 dmin | scales[12] @4 (8 six-bit scale/min pairs) | qs[128] @16
// Q5_K: f16 d | f16 dmin | scales[12] @4 | qh[32] @16 | qs[128] @48
// Q6_K: ql[128] | qh[64] @128 | i8 scales[16] @192 | f16 d @208

/// Smallest group maximum ggml treats as non-zero.
const GROUP_MAX_EPS: f32 = 1e-15;

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    use GgmlType::*;
    let f = |dequantize: fn(&[u8], &mut [f32]), quantize: fn(&[f32], &mut [u8]), dot| FormatFns {
        dequantize: Some(dequantize),
        quantize: Some(quantize),
        dot,
    };
    Some(match ty {
        Q2_K => f(
            dequantize_q2_k,
            quantize_q2_k,
            Some(dot_q2_k as crate::DotFn),
        ),
        Q3_K => f(
            dequantize_q3_k,
            quantize_q3_k,
            Some(dot_q3_k as crate::DotFn),
        ),
        Q4_K => f(
            dequantize_q4_k,
            quantize_q4_k,
            Some(dot_q4_k as crate::DotFn),
        ),
        Q5_K => f(
            dequantize_q5_k,
            quantize_q5_k,
            Some(dot_q5_k as crate::DotFn),
        ),
        Q6_K => f(
            dequantize_q6_k,
            quantize_q6_k,
            Some(dot_q6_k as crate::DotFn),
        ),
        Q8_K => f(dequantize_q8_k, quantize_q8_k, None),
        _ => return None,
    })
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 magic constant. Kept
/// as the bit trick rather than `round_ties_even` so out-of-range inputs (|x| > 2^22, NaN) give
/// the same garbage ggml gives.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0f32;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn put_f16(b: &mut [u8], o: usize, x: f32) {
    b[o..o + 2].copy_from_slice(&f32_to_f16(x).to_le_bytes());
}

// =============================================================================================
// Q8_K

/// Quantize to Q8_K (ggml's `quantize_row_q8_K_ref`; the x86 CPU backend's `from_float` for
/// Q8_K is the same function, so the activation and the reference quantizer agree).
pub fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q8K_BYTES)) {
        quantize_q8_k_block(x, y);
    }
}

fn quantize_q8_k_block(x: &[f32], y: &mut [u8]) {
    // The first element of largest magnitude, keeping its sign (NaN never compares greater).
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        y.fill(0);
        return;
    }
    let iscale = -127.0f32 / max;
    let mut qs = [0i8; QK_K];
    for (q, &v) in qs.iter_mut().zip(x) {
        // Only the top is clamped: the largest element lands on exactly -127.
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    y[0..4].copy_from_slice(&(1.0f32 / iscale).to_le_bytes());
    for (b, &q) in y[Q8K_QS..Q8K_BSUMS].iter_mut().zip(&qs) {
        *b = q as u8;
    }
    for (j, g) in qs.chunks_exact(16).enumerate() {
        let s: i16 = g.iter().map(|&q| q as i16).sum();
        y[Q8K_BSUMS + 2 * j..Q8K_BSUMS + 2 * j + 2].copy_from_slice(&s.to_le_bytes());
    }
}

/// Q8_K to f32: `d * q`.
pub fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (o, &q) in y.iter_mut().zip(&b[Q8K_QS..Q8K_BSUMS]) {
            *o = d * (q as i8) as f32;
        }
    }
}

// =============================================================================================
// Scale unpacking

/// Q4_K/Q5_K: the 8 six-bit (scale, min) pairs packed in 12 bytes (ggml's `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, m)
}

/// Q3_K: the 16 six-bit scales, minus 32 (low 4 bits: byte j or the high nibble of byte
/// j−8; high 2 bits: bits 2(j/4) of byte 8 + j%4).
#[inline(always)]
pub(crate) fn scales_q3_k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

// =============================================================================================
// Dequantization. ggml-base is built without FMA, so `d·q − m` is a rounded product then a
// rounded difference, never fused.

fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = le_f16(b, 80);
        let dmin = le_f16(b, 82);
        // Sub-block s (16 elements) lives in qs[32·(s/8) + 16·(s%2) ..][+16] at shift 2·((s/2)%4).
        for s in 0..16 {
            let sc = b[s];
            let dl = d * (sc & 0xF) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let q = &b[16 + 32 * (s / 8) + 16 * (s % 2)..][..16];
            let shift = 2 * ((s / 2) % 4);
            for (o, &qb) in y[16 * s..16 * s + 16].iter_mut().zip(q) {
                *o = dl * ((qb >> shift) & 3) as f32 - ml;
            }
        }
    }
}

fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q3K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = le_f16(b, 108);
        let sc = scales_q3_k(&b[96..108]);
        for s in 0..16 {
            let dl = d * sc[s] as f32;
            let (half, j, h) = (s / 8, (s / 2) % 4, s % 2);
            let q = &b[32 + 32 * half + 16 * h..][..16];
            let hm = &b[16 * h..][..16];
            let bit = 1u8 << (4 * half + j);
            for l in 0..16 {
                let v = ((q[l] >> (2 * j)) & 3) as i32 - if hm[l] & bit != 0 { 0 } else { 4 };
                y[16 * s + l] = dl * v as f32;
            }
        }
    }
}

fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::supported(crate::Isa::Avx2) {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { dequantize_q4_k_avx2(src, dst) };
    }
    dequantize_q4_k_body(src, dst)
}

/// [`dequantize_q4_k_body`] compiled for AVX2: the same IEEE operations in the same order
/// (Rust never fuses a multiply and an add on its own), eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequantize_q4_k_avx2(src: &[u8], dst: &mut [f32]) {
    dequantize_q4_k_body(src, dst)
}

#[inline(always)]
fn dequantize_q4_k_body(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q4K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = le_f16(b, 0);
        let dmin = le_f16(b, 2);
        let (sc, m) = scale_min_k4(&b[4..16]);
        for s in 0..8 {
            let dl = d * sc[s] as f32;
            let ml = dmin * m[s] as f32;
            let q = &b[16 + 32 * (s / 2)..][..32];
            let shift = 4 * (s % 2);
            for (o, &qb) in y[32 * s..32 * s + 32].iter_mut().zip(q) {
                *o = dl * ((qb >> shift) & 0xF) as f32 - ml;
            }
        }
    }
}

fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q5K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = le_f16(b, 0);
        let dmin = le_f16(b, 2);
        let (sc, m) = scale_min_k4(&b[4..16]);
        let qh = &b[16..48];
        for s in 0..8 {
            let dl = d * sc[s] as f32;
            let ml = dmin * m[s] as f32;
            let q = &b[48 + 32 * (s / 2)..][..32];
            let shift = 4 * (s % 2);
            for l in 0..32 {
                let v = ((q[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4);
                y[32 * s + l] = dl * v as f32 - ml;
            }
        }
    }
}

/// The 6-bit code of element `e` (0..256) of a Q6_K block, before subtracting 32.
#[inline(always)]
fn q6_code(b: &[u8], e: usize) -> u8 {
    let (half, r) = (e / 128, e % 128);
    let (quarter, l) = (r / 32, r % 32);
    let ql = b[64 * half + 32 * (quarter % 2) + l];
    let lo = if quarter < 2 { ql & 0xF } else { ql >> 4 };
    let hi = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
    lo | (hi << 4)
}

/// Element `e` is `d · sc[e/16] · (q6_code(e) − 32)`, evaluated left to right as ggml does;
/// the loop walks the layout in ggml's order (per 128-element half, 32 columns of four codes
/// that share one `ql`/`qh` byte pair) so that each byte is read once and the columns
/// vectorize. `q6_code` is the per-element definition it is tested against.
fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q6K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = le_f16(b, 208);
        let sc: [f32; 16] = std::array::from_fn(|i| d * b[192 + i] as i8 as f32);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let y = &mut y[128 * half..128 * half + 128];
            let sc = &sc[8 * half..8 * half + 8];
            for l in 0..32 {
                let (lo0, lo1, h) = (ql[l], ql[32 + l], qh[l]);
                let q = [
                    (lo0 & 0xF) | ((h & 3) << 4),
                    (lo1 & 0xF) | (((h >> 2) & 3) << 4),
                    (lo0 >> 4) | (((h >> 4) & 3) << 4),
                    (lo1 >> 4) | (((h >> 6) & 3) << 4),
                ];
                for (quarter, &q) in q.iter().enumerate() {
                    let e = 32 * quarter + l;
                    y[e] = sc[e / 16] * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

// =============================================================================================
// Reference quantizers (ggml's `quantize_row_q*_K_ref`, which `ggml_quantize_chunk` uses when
// no importance matrix is given). Every float expression keeps ggml's evaluation order and
// rounding (plain f32, left to right, no fused multiply-add) because the codes it picks
// depend on exact ties.

/// ggml's `make_qkx2_quants`: an asymmetric `scale·L + min` fit of `x` with codes 0..=nmax,
/// searching `nstep + 1` candidate scales. Returns (scale, −min).
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let dd = sum_w * sum_l2 - sum_l * sum_l;
        if dd > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / dd;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / dd;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no weights: a symmetric fit with codes
/// −nmax..nmax−1 (stored + nmax), weighting by x², trying 18 nearby scales.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..x.len()].fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let set = |iscale: f32, l_out: &mut [i8]| {
        for (o, &v) in l_out.iter_mut().zip(x) {
            *o = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set(iscale, l_out);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set(iscale, l_out);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: symmetric codes −nmax..nmax−1 (stored + nmax),
/// refined by up to 5 passes of coordinate descent on the x²-weighted error.
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l = [0i32; 16];
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let li = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = li;
        let w = x[i] * x[i];
        sumlx += w * x[i] * li as f32;
        suml2 += w * li as f32 * li as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let mut slx = sumlx - w * x[i] * l[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * l[i] as f32 * l[i] as f32;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for i in 0..n {
        l_out[i] = (l[i] + nmax) as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Pack 256 two-bit codes as Q2_K/Q3_K store them: byte l of each 32-byte group g holds
/// elements 128g + l + 32k at bits 2k.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8]) {
    for g in 0..2 {
        for i in 0..32 {
            let e = 128 * g + i;
            qs[32 * g + i] = l[e] | (l[e + 32] << 2) | (l[e + 64] << 4) | (l[e + 96] << 6);
        }
    }
}

/// Quantize to Q2_K (ggml's `quantize_row_q2_K_ref`).
pub fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q2K_BYTES)) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let mut weights = [0f32; 16];
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            let (s, m) = make_qkx2_quants(
                3,
                xs,
                &weights,
                &mut l[16 * j..16 * j + 16],
                -0.5,
                0.1,
                15,
                true,
            );
            scales[j] = s;
            mins[j] = m;
            if s > max_scale {
                max_scale = s;
            }
            if m > max_min {
                max_min = m;
            }
        }
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                y[j] = nearest_int(iscale * scales[j]) as u8;
            }
            put_f16(y, 80, max_scale / Q4SCALE);
        } else {
            y[..16].fill(0);
            put_f16(y, 80, 0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                y[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            put_f16(y, 82, max_min / Q4SCALE);
        } else {
            put_f16(y, 82, 0.0);
        }
        let dg = le_f16(y, 80);
        let mg = le_f16(y, 82);
        for j in 0..16 {
            let d = dg * (y[j] & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = mg * (y[j] >> 4) as f32;
            for i in 0..16 {
                l[16 * j + i] = nearest_int((x[16 * j + i] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, &mut y[16..80]);
    }
}

/// Quantize to Q3_K (ggml's `quantize_row_q3_K_ref`).
pub fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q3K_BYTES)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        y[96..108].fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0f32 / max_scale;
            for j in 0..16 {
                // ggml narrows to int8 before clamping.
                let lj = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) as i32 + 32;
                if j < 8 {
                    y[96 + j] = (lj & 0xF) as u8;
                } else {
                    y[96 + j - 8] |= ((lj & 0xF) << 4) as u8;
                }
                y[96 + 8 + j % 4] |= ((lj >> 4) << (2 * (j / 4))) as u8;
            }
            put_f16(y, 108, 1.0 / iscale);
        } else {
            put_f16(y, 108, 0.0);
        }
        let dg = le_f16(y, 108);
        let sc = scales_q3_k(&y[96..108]);
        for j in 0..16 {
            let d = dg * sc[j] as f32;
            if d == 0.0 {
                continue;
            }
            for i in 0..16 {
                l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        // High bit of element e goes to hmask[e % 32], bit e / 32.
        y[..32].fill(0);
        let mut low = [0u8; QK_K];
        for e in 0..QK_K {
            let mut v = l[e] as u8;
            if v > 3 {
                y[e % 32] |= 1 << (e / 32);
                v -= 4;
            }
            low[e] = v;
        }
        pack_2bit(&low, &mut y[32..96]);
    }
}

/// Pack 8 six-bit (scale, min) pairs into Q4_K/Q5_K's 12 bytes.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], s: &mut [u8]) {
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// The shared body of Q4_K and Q5_K quantization: fits 8 sub-blocks of 32, writes d, dmin
/// and the packed scales at `y[0..16]`, and returns the codes (0..=nmax).
fn quantize_k4_common(x: &[f32], y: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        // ggml narrows to uint8 before clamping.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    y[4..16].fill(0);
    pack_scale_min_k4(&ls, &lm, &mut y[4..16]);
    put_f16(y, 0, max_scale / 63.0);
    put_f16(y, 2, max_min / 63.0);
    let dg = le_f16(y, 0);
    let mg = le_f16(y, 2);
    let (sc, m) = scale_min_k4(&y[4..16]);
    for j in 0..8 {
        let d = dg * sc[j] as f32;
        if d == 0.0 {
            continue;
        }
        let dm = mg * m[j] as f32;
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    l
}

/// Quantize to Q4_K (ggml's `quantize_row_q4_K_ref`).
pub fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q4K_BYTES)) {
        let l = quantize_k4_common(x, y, 15, -1.0, 20);
        for g in 0..4 {
            for i in 0..32 {
                y[16 + 32 * g + i] = l[64 * g + i] | (l[64 * g + 32 + i] << 4);
            }
        }
    }
}

/// Quantize to Q5_K (ggml's `quantize_row_q5_K_ref`).
pub fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q5K_BYTES)) {
        let l = quantize_k4_common(x, y, 31, -0.5, 15);
        y[16..48].fill(0);
        for g in 0..4 {
            for i in 0..32 {
                let (l1, l2) = (l[64 * g + i], l[64 * g + 32 + i]);
                y[16 + i] |= ((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1));
                y[48 + 32 * g + i] = (l1 & 0xF) | ((l2 & 0xF) << 4);
            }
        }
    }
}

/// Quantize to Q6_K (ggml's `quantize_row_q6_K_ref`).
pub fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q6K_BYTES)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
        for j in 0..16 {
            let s = make_qx_quants_rmse1(32, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            scales[j] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            y.fill(0);
            continue;
        }
        let iscale = -128.0f32 / max_scale;
        put_f16(y, 208, 1.0 / iscale);
        for j in 0..16 {
            y[192 + j] = nearest_int(iscale * scales[j]).min(127) as i8 as u8;
        }
        let dg = le_f16(y, 208);
        for j in 0..16 {
            let d = dg * (y[192 + j] as i8) as f32;
            if d == 0.0 {
                continue;
            }
            for i in 0..16 {
                l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        for half in 0..2 {
            for i in 0..32 {
                let e = 128 * half + i;
                let q = [l[e], l[e + 32], l[e + 64], l[e + 96]].map(|v| v as u8);
                y[64 * half + i] = (q[0] & 0xF) | ((q[2] & 0xF) << 4);
                y[64 * half + 32 + i] = (q[1] & 0xF) | ((q[3] & 0xF) << 4);
                y[128 + 32 * half + i] =
                    (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
            }
        }
    }
}

// =============================================================================================
// Scalar reference dot products (weight row × Q8_K row); see the module doc for the order.

/// The Q8_K block's f32 scale.
#[inline(always)]
pub(crate) fn q8k_d(x: &[u8]) -> f32 {
    f32::from_le_bytes([x[0], x[1], x[2], x[3]])
}

#[inline(always)]
fn q8k_q(x: &[u8], e: usize) -> i32 {
    x[Q8K_QS + e] as i8 as i32
}

#[inline(always)]
fn q8k_bsum(x: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([x[Q8K_BSUMS + 2 * g], x[Q8K_BSUMS + 2 * g + 1]]) as i32
}

/// The lane sums `I[l]`: element `e` adds `scale(e)·code(e)·qx_e` to lane `(e mod 32) / 4`.
/// Each lane takes 4 consecutive elements at a time, which never straddle a sub-block, so the
/// scale multiplies their sum (the same value in wrapping i32 arithmetic).
#[inline(always)]
fn int_lanes(y: &[u8], code: impl Fn(usize) -> i32, scale: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for g in 0..QK_K / 32 {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let e0 = 32 * g + 4 * l;
            let t: i32 = (e0..e0 + 4).map(|e| code(e) * q8k_q(y, e)).sum();
            *lane = lane.wrapping_add(t.wrapping_mul(scale(e0)));
        }
    }
    lanes
}

/// `acc[l] = D·I[l] + acc[l]`, fused, per lane.
#[inline(always)]
fn fold_lanes(acc: &mut [f32; 8], d: f32, lanes: &[i32; 8]) {
    for l in 0..8 {
        acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
    }
}

/// `lanes[l] −= k·(sc_2l·bs[2l] + sc_2l+1·bs[2l+1])`: the offset of the symmetric types.
#[inline(always)]
fn lane_offset(lanes: &mut [i32; 8], k: i32, sc: impl Fn(usize) -> i32, y: &[u8]) {
    for l in 0..8 {
        let c =
            (sc(2 * l) * q8k_bsum(y, 2 * l)).wrapping_add(sc(2 * l + 1) * q8k_bsum(y, 2 * l + 1));
        lanes[l] = lanes[l].wrapping_sub(c.wrapping_mul(k));
    }
}

/// Element `e`'s 2-bit code in Q2_K/Q3_K's `qs` (starting at `qs`): byte `32·(e/128) + e%32`,
/// bits `2·((e/32) % 4)`.
#[inline(always)]
fn code2(b: &[u8], qs: usize, e: usize) -> u8 {
    (b[qs + 32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3
}

fn dot_q2_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let (mut acc, mut accm) = ([0f32; 8], [0f32; 8]);
    for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let il = int_lanes(y, |e| code2(b, 16, e) as i32, |e| (b[e / 16] & 0xF) as i32);
        let mut ml = [0i32; 8];
        for l in 0..8 {
            let m = |s: usize| (b[s] >> 4) as i32 * q8k_bsum(y, s);
            ml[l] = m(2 * l).wrapping_add(m(2 * l + 1));
        }
        let dx = q8k_d(y);
        fold_lanes(&mut acc, dx * le_f16(b, 80), &il);
        fold_lanes(&mut accm, dx * le_f16(b, 82), &ml);
    }
    reduce8(acc) - reduce8(accm)
}

fn dot_q3_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let sc = scales_q3_k(&b[96..108]);
        // The high bit of element e is bit e/32 of hmask[e % 32].
        let code = |e: usize| (code2(b, 32, e) | (((b[e % 32] >> (e / 32)) & 1) << 2)) as i32;
        let mut il = int_lanes(y, code, |e| sc[e / 16] as i32);
        lane_offset(&mut il, 4, |s| sc[s] as i32, y);
        fold_lanes(&mut acc, q8k_d(y) * le_f16(b, 108), &il);
    }
    reduce8(acc)
}

/// Q4_K and Q5_K: `code(b, e)` is element `e`'s code (the 4 low bits, plus the high bit for
/// Q5_K); the scales sit at byte 4, d and dmin at 0 and 2.
#[inline(always)]
fn dot_k4(w: &[u8], x: &[u8], bytes: usize, code: impl Fn(&[u8], usize) -> u8) -> f32 {
    let (mut acc, mut accm) = ([0f32; 8], [0f32; 8]);
    for (b, y) in w.chunks_exact(bytes).zip(x.chunks_exact(Q8K_BYTES)) {
        let (sc, m) = scale_min_k4(&b[4..16]);
        let il = int_lanes(y, |e| code(b, e) as i32, |e| sc[e / 32] as i32);
        let mut ml = [0i32; 8];
        for l in 0..8 {
            ml[l] = (q8k_bsum(y, 2 * l) + q8k_bsum(y, 2 * l + 1)) * m[l] as i32;
        }
        let dx = q8k_d(y);
        fold_lanes(&mut acc, dx * le_f16(b, 0), &il);
        fold_lanes(&mut accm, dx * le_f16(b, 2), &ml);
    }
    reduce8(acc) - reduce8(accm)
}

fn dot_q4_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_k4(w, x, Q4K_BYTES, |b, e| {
        (b[16 + 32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0xF
    })
}

fn dot_q5_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_k4(w, x, Q5K_BYTES, |b, e| {
        let lo = (b[48 + 32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0xF;
        lo | (((b[16 + e % 32] >> (e / 32)) & 1) << 4)
    })
}

fn dot_q6_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let sc = |s: usize| b[192 + s] as i8 as i32;
        let mut il = int_lanes(y, |e| q6_code(b, e) as i32, |e| sc(e / 16));
        lane_offset(&mut il, 32, sc, y);
        fold_lanes(&mut acc, q8k_d(y) * le_f16(b, 208), &il);
    }
    reduce8(acc)
}

#[cfg(test)]
mod q6_k_layout_tests {
    use super::*;

    /// The structured Q6_K dequantizer equals the per-element definition (`q6_code`, the
    /// reading of the block layout the dot reference uses) bit for bit on random blocks.
    #[test]
    fn dequantize_q6_k_equals_the_per_element_definition() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut b = vec![0u8; 4 * Q6K_BYTES];
        for x in b.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = (s >> 32) as u8;
        }
        for blk in b.chunks_exact_mut(Q6K_BYTES) {
            blk[208..210].copy_from_slice(&0x3555u16.to_le_bytes()); // a finite f16 scale
        }
        let mut got = vec![0f32; 4 * QK_K];
        dequantize_q6_k(&b, &mut got);
        for (k, blk) in b.chunks_exact(Q6K_BYTES).enumerate() {
            let d = le_f16(blk, 208);
            for e in 0..QK_K {
                let sc = blk[192 + e / 16] as i8;
                let want = d * sc as f32 * (q6_code(blk, e) as i32 - 32) as f32;
                assert_eq!(
                    got[k * QK_K + e].to_bits(),
                    want.to_bits(),
                    "block {k} element {e}"
                );
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod dequantize_avx2_tests {
    use super::*;

    /// The AVX2 build of the Q4_K dequantizer equals the baseline build bit for bit.
    #[test]
    fn q4_k_avx2_equals_the_baseline_build() {
        if !crate::simd::supported(crate::Isa::Avx2) {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut b = vec![0u8; 16 * Q4K_BYTES];
        for x in b.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = (s >> 32) as u8;
        }
        let (mut a, mut v) = (vec![0f32; 16 * QK_K], vec![0f32; 16 * QK_K]);
        dequantize_q4_k_body(&b, &mut a);
        // SAFETY: AVX2 checked above.
        unsafe { dequantize_q4_k_avx2(&b, &mut v) };
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&v));
    }
}
