//! x86 AVX2 / AVX-512 dot products for F32, F16 and BF16, bitwise equal to the scalar reference
//! in `fp`: 64 lane accumulators (eight 256-bit or four 512-bit registers, register `r` holding
//! lanes `8r..` or `16r..`), one FMA per element in element order, then `fp::reduce64`. Both
//! operands are widened exactly to f32 (F16C for f16, a 16-bit shift for bf16) before the FMA;
//! AVX512_BF16's `vdpbf16ps` is not used because it flushes subnormals and fixes its own pairwise
//! order, which the reference would then have to copy. A tail of fewer than 64 elements is
//! finished on the stored lanes with scalar `mul_add`, exactly as the reference does.

use crate::fp::{bf16_to_f32, reduce64, FP_LANES};
use crate::{DotFn, GgmlType, Isa};

pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let f: DotFn = match (ty, isa) {
            (GgmlType::F32, Isa::Avx2) => x86::f32_avx2,
            (GgmlType::F16, Isa::Avx2) => x86::f16_avx2,
            (GgmlType::BF16, Isa::Avx2) => x86::bf16_avx2,
            (GgmlType::F32, Isa::Avx512) => x86::f32_avx512,
            (GgmlType::F16, Isa::Avx512) => x86::f16_avx512,
            (GgmlType::BF16, Isa::Avx512) => x86::bf16_avx512,
            _ => return None,
        };
        Some(f)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// Element `i` of a row, widened to f32 (for the scalar tail).
#[inline(always)]
fn elem_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}
#[inline(always)]
fn elem_f16(b: &[u8], i: usize) -> f32 {
    crate::dot::f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}
#[inline(always)]
fn elem_bf16(b: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

/// Finish lanes `acc` with elements `from..n` (scalar, the reference's own step) and reduce.
#[inline(always)]
fn finish(
    mut acc: [f32; FP_LANES],
    from: usize,
    n: usize,
    w: &[u8],
    x: &[u8],
    elem: fn(&[u8], usize) -> f32,
) -> f32 {
    for i in from..n {
        let l = i % FP_LANES;
        acc[l] = elem(w, i).mul_add(elem(x, i), acc[l]);
    }
    reduce64(&acc)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Defines an AVX2 kernel: `$load(ptr, i)` widens 8 elements starting at element `i`.
    macro_rules! avx2_kernel {
        ($name:ident, $inner:ident, $size:expr, $load:ident, $elem:ident) => {
            pub(super) fn $name(n: usize, w: &[u8], x: &[u8]) -> f32 {
                let n = n.min(w.len() / $size).min(x.len() / $size);
                // SAFETY: handed out only after `simd::supported(Isa::Avx2)`; `n` is clamped to
                // both slices, and the kernel reads elements below `n` only.
                unsafe { $inner(n, w, x) }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $inner(n: usize, w: &[u8], x: &[u8]) -> f32 {
                let (wp, xp) = (w.as_ptr(), x.as_ptr());
                let mut a = [_mm256_setzero_ps(); 8];
                let full = n - n % FP_LANES;
                let mut i = 0;
                while i < full {
                    for (r, a) in a.iter_mut().enumerate() {
                        let e = i + 8 * r;
                        *a = _mm256_fmadd_ps($load(wp, e), $load(xp, e), *a);
                    }
                    i += FP_LANES;
                }
                let mut acc = [0f32; FP_LANES];
                for (r, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(8 * r), *a);
                }
                finish(acc, full, n, w, x, $elem)
            }
        };
    }

    /// Defines an AVX-512 kernel: `$load(ptr, i)` widens 16 elements starting at element `i`.
    macro_rules! avx512_kernel {
        ($name:ident, $inner:ident, $size:expr, $load:ident, $elem:ident) => {
            pub(super) fn $name(n: usize, w: &[u8], x: &[u8]) -> f32 {
                let n = n.min(w.len() / $size).min(x.len() / $size);
                // SAFETY: handed out only after `simd::supported(Isa::Avx512)`; `n` is clamped
                // to both slices, and the kernel reads elements below `n` only.
                unsafe { $inner(n, w, x) }
            }

            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            unsafe fn $inner(n: usize, w: &[u8], x: &[u8]) -> f32 {
                let (wp, xp) = (w.as_ptr(), x.as_ptr());
                let mut a = [_mm512_setzero_ps(); 4];
                let full = n - n % FP_LANES;
                let mut i = 0;
                while i < full {
                    for (r, a) in a.iter_mut().enumerate() {
                        let e = i + 16 * r;
                        *a = _mm512_fmadd_ps($load(wp, e), $load(xp, e), *a);
                    }
                    i += FP_LANES;
                }
                let mut acc = [0f32; FP_LANES];
                for (r, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(16 * r), *a);
                }
                finish(acc, full, n, w, x, $elem)
            }
        };
    }

    #[inline(always)]
    unsafe fn ld8_f32(p: *const u8, i: usize) -> __m256 {
        _mm256_loadu_ps(p.add(4 * i) as *const f32)
    }
    #[inline(always)]
    unsafe fn ld8_f16(p: *const u8, i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn ld8_bf16(p: *const u8, i: usize) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
    }
    #[inline(always)]
    unsafe fn ld16_f32(p: *const u8, i: usize) -> __m512 {
        _mm512_loadu_ps(p.add(4 * i) as *const f32)
    }
    #[inline(always)]
    unsafe fn ld16_f16(p: *const u8, i: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn ld16_bf16(p: *const u8, i: usize) -> __m512 {
        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * i) as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
    }

    avx2_kernel!(f32_avx2, f32_avx2_inner, 4, ld8_f32, elem_f32);
    avx2_kernel!(f16_avx2, f16_avx2_inner, 2, ld8_f16, elem_f16);
    avx2_kernel!(bf16_avx2, bf16_avx2_inner, 2, ld8_bf16, elem_bf16);
    avx512_kernel!(f32_avx512, f32_avx512_inner, 4, ld16_f32, elem_f32);
    avx512_kernel!(f16_avx512, f16_avx512_inner, 2, ld16_f16, elem_f16);
    avx512_kernel!(bf16_avx512, bf16_avx512_inner, 2, ld16_bf16, elem_bf16);
}
