//! Shared accumulation conventions for dot products.
//!
//! A scalar reference and its SIMD versions must give the same bits, so the reference fixes the
//! order of every floating-point operation:
//! - integer partial sums inside a block are exact (any order);
//! - float work is per lane: a kernel with `L` lanes keeps `L` f32 accumulators and adds each
//!   lane's terms in block order; where the SIMD code uses a fused multiply-add the reference uses
//!   `f32::mul_add`, and nowhere else (Rust never contracts `a * b + c` on its own);
//! - lanes are reduced at the end by the fixed trees below, which are what a horizontal sum of a
//!   256-bit (8 lanes) or 512-bit (16 lanes) register does when halved repeatedly.

/// Sum 8 lanes as a halving horizontal sum does: (l + l+4), then (l + l+2), then (0 + 1).
#[inline]
pub fn reduce8(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// Sum 16 lanes by halving: (l + l+8), then [`reduce8`].
#[inline]
pub fn reduce16(a: [f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = a[i] + a[i + 8];
    }
    reduce8(h)
}

/// Sum 4 lanes by halving: (l + l+2), then (0 + 1).
#[inline]
pub fn reduce4(a: [f32; 4]) -> f32 {
    (a[0] + a[2]) + (a[1] + a[3])
}

/// IEEE half bits to f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 to IEEE half bits, round to nearest even (ggml's `GGML_FP32_TO_FP16`).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Little-endian u16 at byte offset `o`.
#[inline]
pub fn le_u16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

/// Little-endian u32 at byte offset `o`.
#[inline]
pub fn le_u32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The f16 at byte offset `o`, as f32.
#[inline]
pub fn le_f16(b: &[u8], o: usize) -> f32 {
    f16_to_f32(le_u16(b, o))
}
