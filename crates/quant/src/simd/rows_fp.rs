//! Multi-row x86 kernels for the float weights (F32, F16, BF16 against activations of the same
//! type): one pass over a weight row for up to 8 activation rows, each row bitwise equal to the
//! scalar reference of `crate::fp` (64 lanes, element `i` into lane `i % 64` by one FMA in
//! element order, a scalar tail, `fp::reduce64`), which `simd::fp_x86` equals too.
//!
//! A row's 64 lanes take four zmm registers, so AVX-512 keeps four rows in registers at a time
//! and takes the weight row a chunk at a time: a chunk is read from memory once and widened
//! once per group of four rows (the second group reads it from L1). Each activation row is as
//! many bytes as the weight row, so the gain is smaller than for the block formats (see
//! docs/PERF.md).
//!
//! There is no AVX2 multi-row kernel: 16 registers hold one row's lanes and little else, and
//! the per-row fallback (the single-row kernel once per row, the weight row then in L1)
//! measured faster than a chunked kernel.

use crate::{DotRowsFn, GgmlType, Isa};

/// The multi-row kernel for `ty` on `isa`. Callers check `simd::supported(isa)`.
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<DotRowsFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let f: DotRowsFn = match (ty, isa) {
            (GgmlType::F32, Isa::Avx512) => x86::f32_rows_avx512,
            (GgmlType::F16, Isa::Avx512) => x86::f16_rows_avx512,
            (GgmlType::BF16, Isa::Avx512) => x86::bf16_rows_avx512,
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

#[cfg(target_arch = "x86_64")]
// Rows and lanes index parallel arrays.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use crate::fp::{bf16_to_f32, reduce64, FP_LANES};

    /// Element types, as const-generic tags.
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    const fn size(t: u8) -> usize {
        if t == F32 {
            4
        } else {
            2
        }
    }

    fn ty(t: u8) -> crate::GgmlType {
        match t {
            F32 => crate::GgmlType::F32,
            F16 => crate::GgmlType::F16,
            _ => crate::GgmlType::BF16,
        }
    }

    /// Elements ahead of the first group that it asks the memory system for.
    const PREFETCH: usize = 1024;

    /// Elements per chunk (2-4 KiB of weights).
    const CHUNK: usize = 1024;

    /// Element `i` of a row at `p`, widened to f32 (the tail's scalar step).
    #[inline(always)]
    unsafe fn elem<const T: u8>(p: *const u8, i: usize) -> f32 {
        match T {
            F32 => (p.add(4 * i) as *const f32).read_unaligned(),
            F16 => crate::dot::f16_to_f32((p.add(2 * i) as *const u16).read_unaligned()),
            _ => bf16_to_f32((p.add(2 * i) as *const u16).read_unaligned()),
        }
    }

    /// 16 elements from element `i`, widened exactly.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn ld16<const T: u8>(p: *const u8, i: usize) -> __m512 {
        match T {
            F32 => _mm512_loadu_ps(p.add(4 * i) as *const f32),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i) as *const __m256i)),
            _ => {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * i) as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
            }
        }
    }

    /// The reference's tail (elements `full..n`, scalar `mul_add` into lane `i % 64`) and
    /// `reduce64`, for one row's stored lanes.
    #[inline(always)]
    unsafe fn finish<const T: u8>(
        mut acc: [f32; FP_LANES],
        full: usize,
        n: usize,
        w: *const u8,
        x: *const u8,
    ) -> f32 {
        for i in full..n {
            let l = i % FP_LANES;
            acc[l] = elem::<T>(w, i).mul_add(elem::<T>(x, i), acc[l]);
        }
        reduce64(&acc)
    }

    /// Rows whose lanes the AVX-512 kernel keeps in registers at once (16 of 32 zmm).
    const GROUP: usize = 4;

    /// AVX-512: register `k` of a row's four holds lanes `16k ..`. Each chunk of the weight
    /// row is widened once per group of up to four rows, whose lanes stay in registers across
    /// the chunk; a second group reads the chunk again from L1.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn rows_avx512<const T: u8, const R: usize>(
        n: usize,
        w: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let full = n - n % FP_LANES;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let mut c0 = 0;
        while c0 < full {
            let end = full.min(c0 + CHUNK);
            let mut g0 = 0;
            while g0 < R {
                group_avx512::<T, R>(&mut acc, g0, c0, end, w, &xs);
                g0 += GROUP;
            }
            c0 = end;
        }
        core::array::from_fn(|r| {
            let mut l = [0f32; FP_LANES];
            for k in 0..4 {
                _mm512_storeu_ps(l.as_mut_ptr().add(16 * k), acc[r][k]);
            }
            finish::<T>(l, full, n, w, xs[r])
        })
    }

    /// Rows `g0 .. g0 + GROUP` (those below `R`) over elements `c0 .. end`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn group_avx512<const T: u8, const R: usize>(
        acc: &mut [[__m512; 4]; R],
        g0: usize,
        c0: usize,
        end: usize,
        w: *const u8,
        xs: &[*const u8; R],
    ) {
        let rows = GROUP.min(R - g0);
        let mut a = [[_mm512_setzero_ps(); 4]; GROUP];
        a[..rows].copy_from_slice(&acc[g0..g0 + rows]);
        let mut e = c0;
        while e < end {
            if g0 == 0 {
                // The first group streams the chunk from memory: ask a few KiB ahead (a hint
                // past the row never faults; the address is formed with wrapping arithmetic).
                let ahead = w.wrapping_add(size(T) * (e + PREFETCH));
                // One 64-element step is `size(T)` cache lines.
                for l in 0..size(T) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l) as *const i8);
                }
            }
            let wv: [__m512; 4] = core::array::from_fn(|k| ld16::<T>(w, e + 16 * k));
            for j in 0..GROUP {
                if j < rows {
                    for k in 0..4 {
                        let x = ld16::<T>(xs[g0 + j], e + 16 * k);
                        a[j][k] = _mm512_fmadd_ps(wv[k], x, a[j][k]);
                    }
                }
            }
            e += FP_LANES;
        }
        acc[g0..g0 + rows].copy_from_slice(&a[..rows]);
    }

    macro_rules! entries {
        ($($t:ident: $avx512:ident;)*) => {$(
            pub(super) fn $avx512(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                // Elements, not blocks: every row holds `n` of them.
                let (rows, n) = crate::simd::rows_blocks(n, 1, size($t), size($t), w, xs, out);
                // A lone row goes to the single-row kernel (faster alone, the same bits).
                unsafe fn one(n: usize, w: *const u8, x: *const u8) -> f32 {
                    static F: std::sync::OnceLock<Option<crate::DotFn>> =
                        std::sync::OnceLock::new();
                    let f = F.get_or_init(|| crate::dot_fn(ty($t), crate::Isa::Avx512));
                    // SAFETY: the caller's `rows_blocks` proved both rows hold `n` elements.
                    let (w, x) = unsafe {
                        (
                            std::slice::from_raw_parts(w, size($t) * n),
                            std::slice::from_raw_parts(x, size($t) * n),
                        )
                    };
                    f.map_or(f32::NAN, |f| f(n, w, x))
                }
                unsafe fn kernel<const R: usize>(
                    n: usize,
                    w: *const u8,
                    xs: [*const u8; R],
                ) -> [f32; R] {
                    rows_avx512::<$t, R>(n, w, xs)
                }
                // Handed out only after `simd::supported(Avx512)`; `rows_blocks` bounds `n`.
                rows_in_groups!(kernel, one, n, w, xs[..rows], out[..rows]);
            }
        )*};
    }

    entries! {
        F32: f32_rows_avx512;
        F16: f16_rows_avx512;
        BF16: bf16_rows_avx512;
    }
}
