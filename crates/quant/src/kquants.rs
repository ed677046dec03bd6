//! The K-quant family: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights (256-element super-blocks with
//! per-sub-block scales) and their activation type Q8_K. This module owns their dequantizers,
//! ggml's reference quantizers, and the scalar reference dot products whose float order the
//! SIMD kernels in `simd::kquants_x86` reproduce bit for bit.

use crate::{FormatFns, GgmlType};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Q8_K block layout: f32 `d` at 0, i8 `qs[256]` at [`Q8K_QS`], i16 `bsums[16]` at
/// [`Q8K_BSUMS`] (each the sum of 16 consecutive `qs`).
pub const Q8K_BYTES: usize = 292;
pub const Q8K_QS: usize = 4;
pub const Q8K_BSUMS: usize = 4 + QK_K;

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    match ty {
        GgmlType::Q8_K => Some(FormatFns {
            dequantize: Some(dequantize_q8_k),
            quantize: Some(quantize_q8_k),
            dot: None,
        }),
        _ => None,
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 magic constant. Kept
/// as the bit trick rather than `round_ties_even` so out-of-range inputs (|x| > 2^22, NaN) give
/// the same garbage ggml gives.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0f32;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

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
