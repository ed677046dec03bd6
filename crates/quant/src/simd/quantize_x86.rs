//! x86 AVX2 / AVX-512 versions of the Q8_0 activation quantizer
//! ([`crate::legacy::quantize_row_q8_0_act`], the scalar reference), bit for bit:
//! - `amax`: `max(|x|, 0)` first, so a NaN drops out exactly as `f32::max` drops it; the
//!   maximum of non-negative, non-NaN values does not depend on the order they meet in.
//! - `d = amax / 127` and `id = 127 / amax` in scalar code, as the reference computes them.
//! - codes: `x * id` (one IEEE multiply, as the reference), rounded to nearest-even by adding
//!   and subtracting 1.5·2^23 (as `round_to_i8`), NaN set to 0, clamped to [-128, 127] (what
//!   `as i8` does), then converted (exact: the values are whole numbers in range).
//!
//! `tests/quantize_simd.rs` holds them to the reference.

use crate::{GgmlType, Isa, QuantFn};

/// The SIMD activation quantizer for `ty` on `isa`, if there is one. Callers check
/// `supported(isa)`.
pub(crate) fn quantize(ty: GgmlType, isa: Isa) -> Option<QuantFn> {
    #[cfg(target_arch = "x86_64")]
    {
        match (ty, isa) {
            (GgmlType::Q8_0, Isa::Avx2) => Some(x86::q8_0_avx2),
            (GgmlType::Q8_0, Isa::Avx512) => Some(x86::q8_0_avx512),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use crate::dot::f32_to_f16;

    const QK: usize = 32;
    const BYTES: usize = 34;
    const MAGIC: f32 = 12582912.0;

    /// The block scale and multiplier from `amax`, as the reference computes them.
    #[inline(always)]
    fn scales(m: f32) -> (f32, f32) {
        (m / 127.0, if m != 0.0 { 127.0 / m } else { 0.0 })
    }

    pub(super) fn q8_0_avx512(src: &[f32], dst: &mut [u8]) {
        // SAFETY: handed out only after `simd::supported(Avx512)` confirmed the features.
        unsafe { q8_0_avx512_impl(src, dst) }
    }

    pub(super) fn q8_0_avx2(src: &[f32], dst: &mut [u8]) {
        // SAFETY: handed out only after `simd::supported(Avx2)` confirmed the features.
        unsafe { q8_0_avx2_impl(src, dst) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn q8_0_avx512_impl(src: &[f32], dst: &mut [u8]) {
        let zero = _mm512_setzero_ps();
        let (magic, lo, hi) = (
            _mm512_set1_ps(MAGIC),
            _mm512_set1_ps(-128.0),
            _mm512_set1_ps(127.0),
        );
        for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
            // SAFETY: `x` is 32 readable f32.
            let (a0, a1) = unsafe {
                (
                    _mm512_loadu_ps(x.as_ptr()),
                    _mm512_loadu_ps(x.as_ptr().add(16)),
                )
            };
            // `max_ps(v, 0)` returns 0 where `v` is NaN (the second operand wins).
            let m0 = _mm512_max_ps(_mm512_abs_ps(a0), zero);
            let m1 = _mm512_max_ps(_mm512_abs_ps(a1), zero);
            let m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
            let (d, id) = scales(m);
            b[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
            let idv = _mm512_set1_ps(id);
            let codes = |a: __m512| -> __m128i {
                let v = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(a, idv), magic), magic);
                let v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), v);
                let v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
                _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))
            };
            let (q0, q1) = (codes(a0), codes(a1));
            // SAFETY: `b[2..34]` is 32 writable bytes.
            unsafe {
                _mm_storeu_si128(b.as_mut_ptr().add(2) as *mut __m128i, q0);
                _mm_storeu_si128(b.as_mut_ptr().add(18) as *mut __m128i, q1);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn q8_0_avx2_impl(src: &[f32], dst: &mut [u8]) {
        let zero = _mm256_setzero_ps();
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (magic, lo, hi) = (
            _mm256_set1_ps(MAGIC),
            _mm256_set1_ps(-128.0),
            _mm256_set1_ps(127.0),
        );
        for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
            // SAFETY: `x` is 32 readable f32.
            let a: [__m256; 4] =
                core::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
            let m = a
                .iter()
                .map(|&v| _mm256_max_ps(_mm256_and_ps(v, abs), zero))
                .fold(zero, |acc, v| _mm256_max_ps(acc, v));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let (d, id) = scales(m);
            b[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
            let idv = _mm256_set1_ps(id);
            let q = a.map(|v| {
                let v = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, idv), magic), magic);
                let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi))
            });
            // Packing works within 128-bit lanes; the permute puts the four quads in order.
            let p01 = _mm256_packs_epi32(q[0], q[1]);
            let p23 = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(p01, p23),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            // SAFETY: `b[2..34]` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(b.as_mut_ptr().add(2) as *mut __m256i, bytes) };
        }
    }
}
