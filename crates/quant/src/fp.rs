//! The float family: F32, F16 and BF16 (dequantize, quantize, scalar reference dot products),
//! plus dequantize-only conversions of F64 and the integer types I8/I16/I32/I64 to f32 (used by
//! tensor dumps; they are never weights).
//!
//! Dot-product accumulation order (the contract `simd::fp_x86` reproduces bit for bit):
//! [`FP_LANES`] = 64 f32 lane accumulators, all starting at +0.0; element `i` (both operands
//! widened exactly to f32) goes to lane `i % 64` as `acc = w.mul_add(x, acc)`, in element order;
//! the lanes are then summed by [`reduce64`]. Sixty-four lanes are four 512-bit or eight 256-bit
//! registers, which is enough independent FMA chains to hide FMA latency on both ISAs.

use crate::dot::{f16_to_f32, f32_to_f16, reduce16};
use crate::{FormatFns, GgmlType};

/// Lane accumulators of the F32/F16/BF16 dot products.
pub const FP_LANES: usize = 64;

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    let f = match ty {
        GgmlType::F32 => FormatFns {
            dequantize: Some(deq_f32),
            quantize: Some(quant_f32),
            dot: Some(dot_f32),
        },
        GgmlType::F16 => FormatFns {
            dequantize: Some(deq_f16),
            quantize: Some(quant_f16),
            dot: Some(dot_f16),
        },
        GgmlType::BF16 => FormatFns {
            dequantize: Some(deq_bf16),
            quantize: Some(quant_bf16),
            dot: Some(dot_bf16),
        },
        GgmlType::F64 => FormatFns {
            dequantize: Some(deq_f64),
            ..Default::default()
        },
        GgmlType::I8 => FormatFns {
            dequantize: Some(deq_i8),
            ..Default::default()
        },
        GgmlType::I16 => FormatFns {
            dequantize: Some(deq_i16),
            ..Default::default()
        },
        GgmlType::I32 => FormatFns {
            dequantize: Some(deq_i32),
            ..Default::default()
        },
        GgmlType::I64 => FormatFns {
            dequantize: Some(deq_i64),
            ..Default::default()
        },
        _ => return None,
    };
    Some(f)
}

/// bf16 bits to f32 (exact: the bits become the top half of an f32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits as ggml's `ggml_fp32_to_bf16`: round to nearest even; a NaN keeps its top
/// bits and is forced quiet (so a signalling NaN whose payload sits in the low half does not
/// become an infinity). Subnormals are rounded like any other value, not flushed.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    // Cannot overflow: the largest finite or infinite |u| plus 0x8000 stays below 2^32.
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

fn deq_f32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

fn deq_f16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn deq_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn deq_f64(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        *d = f64::from_le_bytes(b) as f32;
    }
}

fn deq_i8(src: &[u8], dst: &mut [f32]) {
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = c as i8 as f32;
    }
}

fn deq_i16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = i16::from_le_bytes([c[0], c[1]]) as f32;
    }
}

fn deq_i32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
    }
}

fn deq_i64(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        *d = i64::from_le_bytes(b) as f32;
    }
}

fn quant_f32(src: &[f32], dst: &mut [u8]) {
    for (c, &x) in dst.chunks_exact_mut(4).zip(src) {
        c.copy_from_slice(&x.to_le_bytes());
    }
}

fn quant_f16(src: &[f32], dst: &mut [u8]) {
    for (c, &x) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&f32_to_f16(x).to_le_bytes());
    }
}

fn quant_bf16(src: &[f32], dst: &mut [u8]) {
    for (c, &x) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}

/// Sum the 64 lane accumulators: lane `l` of 16 first takes
/// `(a[l] + a[l+16]) + (a[l+32] + a[l+48])`, then [`reduce16`]. This is adding four 16-lane
/// registers pairwise (or eight 8-lane ones: even ones into lanes 0..8, odd into 8..16).
#[inline]
pub fn reduce64(a: &[f32; FP_LANES]) -> f32 {
    let mut t = [0f32; 16];
    for (l, t) in t.iter_mut().enumerate() {
        *t = (a[l] + a[l + 16]) + (a[l + 32] + a[l + 48]);
    }
    reduce16(t)
}

/// The reference loop: `elem(i)` widens element `i` of both rows to f32.
#[inline(always)]
fn lane_dot(n: usize, elem: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut acc = [0f32; FP_LANES];
    for i in 0..n {
        let (w, x) = elem(i);
        let l = i % FP_LANES;
        acc[l] = w.mul_add(x, acc[l]);
    }
    reduce64(&acc)
}

fn dot_f32(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let get = |b: &[u8], i: usize| {
        let o = 4 * i;
        f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
    };
    lane_dot(n.min(w.len() / 4).min(x.len() / 4), |i| {
        (get(w, i), get(x, i))
    })
}

fn dot_f16(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let get = |b: &[u8], i: usize| f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    lane_dot(n.min(w.len() / 2).min(x.len() / 2), |i| {
        (get(w, i), get(x, i))
    })
}

fn dot_bf16(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let get = |b: &[u8], i: usize| bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    lane_dot(n.min(w.len() / 2).min(x.len() / 2), |i| {
        (get(w, i), get(x, i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_ggml_rules() {
        // Ties go to even; the lower half above a tie rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        // A signalling NaN with only low payload bits stays a (quiet) NaN.
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        // The largest finite f32 rounds up to infinity, as RNE says.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
    }
}
