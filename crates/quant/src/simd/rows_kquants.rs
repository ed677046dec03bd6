//! Multi-row x86 kernels for the K-quants (Q2_K..Q6_K weights × Q8_K): one pass over a weight
//! row for up to 8 activation rows, each row's result bitwise equal to the scalar reference of
//! `crate::kquants` (and so to the single-row kernels of `simd::kquants_x86`, which equal it).
//!
//! The reference (the `kquants` module doc) fixes only the float work: per super-block exact
//! i32 lane sums `I[l]` (and `M[l]`), then `acc[l] = D.mul_add(I[l] as f32, acc[l])` and
//! `accm[l] = Dm.mul_add(M[l] as f32, accm[l])`, reduced by `dot::reduce8`. The integer sums
//! may be formed in any order, so the weights are decoded once per block into codes in element
//! order, 32 per 256-bit vector (element `4l..4l+3` of each 32 lands in i32 lane `l` through
//! `maddubs` + `madd`, or in lanes `l`, `l + 8` of a 512-bit `maddubs` + `vpdpwssd`, folded by
//! one add), and every row only multiplies its codes in. Minima (Q2_K, Q4_K, Q5_K) and the
//! code offsets (Q3_K: 4, Q6_K: 32) go through the Q8_K group sums with one `madd` per row.
//! Codes are unsigned (0..=63), so `maddubs` needs no sign trick and no pair sum saturates.

use crate::{DotRowsFn, GgmlType, Isa};

/// The multi-row kernel for `ty` on `isa`. Callers check `simd::supported(isa)`.
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<DotRowsFn> {
    #[cfg(target_arch = "x86_64")]
    {
        use GgmlType::*;
        let f: DotRowsFn = match (ty, isa) {
            (Q2_K, Isa::Avx2) => x86::q2_k_rows_avx2,
            (Q3_K, Isa::Avx2) => x86::q3_k_rows_avx2,
            (Q4_K, Isa::Avx2) => x86::q4_k_rows_avx2,
            (Q5_K, Isa::Avx2) => x86::q5_k_rows_avx2,
            (Q6_K, Isa::Avx2) => x86::q6_k_rows_avx2,
            (Q2_K, Isa::Avx512) => x86::q2_k_rows_avx512,
            (Q3_K, Isa::Avx512) => x86::q3_k_rows_avx512,
            (Q4_K, Isa::Avx512) => x86::q4_k_rows_avx512,
            (Q5_K, Isa::Avx512) => x86::q5_k_rows_avx512,
            (Q6_K, Isa::Avx512) => x86::q6_k_rows_avx512,
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
// Rows and groups index parallel arrays; iterators would hide the layout.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use crate::dot::reduce8;
    use crate::kquants::{
        Q2K_BYTES, Q3K_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, QK_K,
    };
    use crate::GgmlType;

    /// Weight types, as const-generic tags so that one driver serves all five.
    const Q2K: u8 = 2;
    const Q3K: u8 = 3;
    const Q4K: u8 = 4;
    const Q5K: u8 = 5;
    const Q6K: u8 = 6;

    const fn bytes(k: u8) -> usize {
        match k {
            Q2K => Q2K_BYTES,
            Q3K => Q3K_BYTES,
            Q4K => Q4K_BYTES,
            Q5K => Q5K_BYTES,
            _ => Q6K_BYTES,
        }
    }

    /// Types with a minimum (`acc − accm`); the others subtract a code offset instead.
    const fn has_min(k: u8) -> bool {
        matches!(k, Q2K | Q4K | Q5K)
    }

    /// The code offset taken back out through the group sums (Q3_K: 4, Q6_K: 32).
    const fn offset_shift(k: u8) -> i32 {
        if k == Q3K {
            2
        } else {
            5
        }
    }

    fn ty(k: u8) -> GgmlType {
        match k {
            Q2K => GgmlType::Q2_K,
            Q3K => GgmlType::Q3_K,
            Q4K => GgmlType::Q4_K,
            Q5K => GgmlType::Q5_K,
            _ => GgmlType::Q6_K,
        }
    }

    /// f16 at `p` to f32 (exact).
    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        half::f16::from_bits((p as *const u16).read_unaligned()).to_f32()
    }

    /// What a block contributes besides its codes: `d`, `dmin` (0 where there is none), its
    /// integer scales as i16 words (16 per 16 elements, or for Q4_K/Q5_K 8 per 32 elements in
    /// `lo`), and the i16 factors of the 16 group sums (`M` for the types with a minimum, the
    /// offset sum otherwise). Unpacked with vector code: a block's scales are the only per-block
    /// work besides its codes, and it is not divided among the rows.
    struct Prep {
        d: f32,
        dmin: f32,
        lo: __m128i,
        hi: __m128i,
        bs_factor: __m256i,
    }

    /// `inline(always)` (no target features of its own) so that it melts into both kernels:
    /// returned through memory, its vectors would be read back wider than written, which
    /// stalls store forwarding every block. Callers enable AVX2.
    #[inline(always)]
    unsafe fn prep<const K: u8>(w: *const u8) -> Prep {
        let u32_at = |o: usize| (w.add(o) as *const u32).read_unaligned();
        let u64_at = |o: usize| (w.add(o) as *const u64).read_unaligned();
        match K {
            Q2K => {
                let v = _mm_loadu_si128(w as *const __m128i);
                let sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(0xF)));
                let m =
                    _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), _mm_set1_epi8(0xF)));
                let (lo, hi) = (
                    _mm256_castsi256_si128(sc),
                    _mm256_extracti128_si256::<1>(sc),
                );
                Prep {
                    d: f16_at(w.add(80)),
                    dmin: f16_at(w.add(82)),
                    lo,
                    hi,
                    bs_factor: m,
                }
            }
            Q3K => {
                // Low 4 bits: byte j of the first 8 (low nibbles, then high nibbles); high 2
                // bits: bits 2(j/4) of byte 8 + j%4.
                let a = _mm_cvtsi64_si128(u64_at(96) as i64);
                let m4 = _mm_set1_epi8(0xF);
                let low = _mm_unpacklo_epi64(
                    _mm_and_si128(a, m4),
                    _mm_and_si128(_mm_srli_epi16::<4>(a), m4),
                );
                let t = _mm_set1_epi32(u32_at(104) as i32);
                let high = _mm_and_si128(
                    _mm_srlv_epi32(t, _mm_setr_epi32(0, 2, 4, 6)),
                    _mm_set1_epi8(3),
                );
                let sc = _mm_sub_epi8(
                    _mm_or_si128(low, _mm_slli_epi16::<4>(high)),
                    _mm_set1_epi8(32),
                );
                let sc = _mm256_cvtepi8_epi16(sc);
                let (lo, hi) = (
                    _mm256_castsi256_si128(sc),
                    _mm256_extracti128_si256::<1>(sc),
                );
                Prep {
                    d: f16_at(w.add(108)),
                    dmin: 0.0,
                    lo,
                    hi,
                    bs_factor: sc,
                }
            }
            Q4K | Q5K => {
                // ggml's `get_scale_min_k4` on four u32 words: scales in words 0, 1, mins in
                // words 2, 3, one byte each.
                let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
                let (u0, u1, u2) = (u32_at(4), u32_at(8), u32_at(12));
                let sc = (u0 & k1) as u64 | (((u2 & k2) | (((u0 >> 6) & k3) << 4)) as u64) << 32;
                let m =
                    (u1 & k1) as u64 | ((((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4)) as u64) << 32;
                let sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64));
                let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m as i64));
                // Lane l carries sub-block l's min times both of its group sums.
                let m2 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
                Prep {
                    d: f16_at(w),
                    dmin: f16_at(w.add(2)),
                    lo: sc,
                    hi: sc,
                    bs_factor: m2,
                }
            }
            _ => {
                let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(192) as *const __m128i));
                let (lo, hi) = (
                    _mm256_castsi256_si128(sc),
                    _mm256_extracti128_si256::<1>(sc),
                );
                Prep {
                    d: f16_at(w.add(208)),
                    dmin: 0.0,
                    lo,
                    hi,
                    bs_factor: sc,
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ld(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// Bytes of `v` shifted right by `shift` (within 16-bit words) and masked: for
    /// `shift < 8` each byte's own bits `shift ..`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn bits(v: __m256i, shift: usize, mask: i8) -> __m256i {
        _mm256_and_si256(
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32)),
            _mm256_set1_epi8(mask),
        )
    }

    /// The unsigned codes of elements `32g .. 32g + 32` of the block at `w`, in order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn codes<const K: u8>(w: *const u8, g: usize) -> __m256i {
        match K {
            Q2K => bits(ld(w.add(16 + 32 * (g / 4))), 2 * (g % 4), 3),
            Q3K => {
                let lo = bits(ld(w.add(32 + 32 * (g / 4))), 2 * (g % 4), 3);
                let hi = _mm256_slli_epi16::<2>(bits(ld(w), g, 1));
                _mm256_or_si256(lo, hi)
            }
            Q4K => bits(ld(w.add(16 + 32 * (g / 2))), 4 * (g % 2), 0xF),
            Q5K => {
                let lo = bits(ld(w.add(48 + 32 * (g / 2))), 4 * (g % 2), 0xF);
                let hi = _mm256_slli_epi16::<4>(bits(ld(w.add(16)), g, 1));
                _mm256_or_si256(lo, hi)
            }
            _ => {
                let (half, quarter) = (g / 4, g % 4);
                let ql = ld(w.add(64 * half + 32 * (quarter % 2)));
                let lo = bits(ql, 4 * (quarter / 2), 0xF);
                let hi = bits(ld(w.add(128 + 32 * half)), 2 * quarter, 3);
                _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
            }
        }
    }

    /// `pshufb` control: i16 word `lo` over the low 128 bits, word `hi` over the high ones.
    const fn words(lo: u8, hi: u8) -> [u8; 32] {
        let mut c = [0u8; 32];
        let mut i = 0;
        while i < 8 {
            c[2 * i] = 2 * lo;
            c[2 * i + 1] = 2 * lo + 1;
            c[16 + 2 * i] = 2 * hi;
            c[16 + 2 * i + 1] = 2 * hi + 1;
            i += 1;
        }
        c
    }

    /// Per 32-element group of a 16-scale type: words `2(g%4)`, `2(g%4)+1` of its half.
    static PAIRS: [[u8; 32]; 4] = [words(0, 1), words(2, 3), words(4, 5), words(6, 7)];
    /// Per group of Q4_K/Q5_K: word `g` over both halves.
    static WHOLE: [[u8; 32]; 8] = [
        words(0, 0),
        words(1, 1),
        words(2, 2),
        words(3, 3),
        words(4, 4),
        words(5, 5),
        words(6, 6),
        words(7, 7),
    ];

    /// The i16 scales of elements `32g ..`: words 0..8 for the first 16, 8..16 for the rest.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn group_scales<const K: u8>(p: &Prep, g: usize) -> __m256i {
        let (src, ctrl) = if matches!(K, Q4K | Q5K) {
            (p.lo, &WHOLE[g])
        } else {
            (if g < 4 { p.lo } else { p.hi }, &PAIRS[g % 4])
        };
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(src), ld(ctrl.as_ptr()))
    }

    /// After the code sums `il` of a row: the offset or the minimum through the group sums at
    /// `x`, then both fused multiply-adds.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fold_row<const K: u8>(
        il: __m256i,
        bsf: __m256i,
        p: &Prep,
        x: *const u8,
        acc: &mut __m256,
        accm: &mut __m256,
    ) {
        let bs = _mm256_madd_epi16(ld(x.add(Q8K_BSUMS)), bsf);
        let dx = (x as *const f32).read_unaligned();
        let il = if has_min(K) {
            il
        } else {
            _mm256_sub_epi32(il, _mm256_sll_epi32(bs, _mm_cvtsi32_si128(offset_shift(K))))
        };
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(dx * p.d), _mm256_cvtepi32_ps(il), *acc);
        if has_min(K) {
            *accm = _mm256_fmadd_ps(_mm256_set1_ps(dx * p.dmin), _mm256_cvtepi32_ps(bs), *accm);
        }
    }

    /// Each row's `reduce8(acc) − reduce8(accm)` (types without a minimum: `reduce8(acc)`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn finish<const K: u8, const R: usize>(
        acc: &[__m256; R],
        accm: &[__m256; R],
    ) -> [f32; R] {
        let lanes = |v: __m256| {
            let mut l = [0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), v);
            reduce8(l)
        };
        core::array::from_fn(|r| {
            if has_min(K) {
                lanes(acc[r]) - lanes(accm[r])
            } else {
                lanes(acc[r])
            }
        })
    }

    /// Blocks ahead that the kernels ask the memory system for. A weight row is short (a few
    /// KiB), so the hardware prefetchers ramp up on every call; a hint a few blocks ahead keeps
    /// the stream busy while the rows work. The hint may point past the row: prefetches never
    /// fault, and the address is formed with wrapping arithmetic.
    const AHEAD: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn prefetch_ahead<const K: u8>(w: *const u8) {
        let p = w.wrapping_add(AHEAD * bytes(K));
        let mut o = 0;
        while o < bytes(K) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
            o += 64;
        }
    }

    /// AVX2: per 32-element group the codes and scales stay in registers while every row adds
    /// `madd(maddubs(codes, q), scales)` to its i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_avx2<const K: u8, const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut accm = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(bytes(K) * b);
            prefetch_ahead::<K>(w);
            let p = prep::<K>(w);
            let mut il = [_mm256_setzero_si256(); R];
            // An opaque trip count keeps LLVM from unrolling the groups and hoisting all their
            // codes at once, which spills with 16 registers.
            for g in 0..core::hint::black_box(8usize) {
                let c = codes::<K>(w, g);
                let sc = group_scales::<K>(&p, g);
                for r in 0..R {
                    let q = ld(xs[r].add(Q8K_BYTES * b + Q8K_QS + 32 * g));
                    let s = _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), sc);
                    il[r] = _mm256_add_epi32(il[r], s);
                }
            }
            let bsf = p.bs_factor;
            for r in 0..R {
                let x = xs[r].add(Q8K_BYTES * b);
                // The float accumulators are touched once per block: kept in memory (volatile,
                // so LLVM does not hold them in registers across the group loop, where with
                // 16 registers it spilled hot values instead).
                let (pa, pm) = (&mut acc[r] as *mut __m256, &mut accm[r] as *mut __m256);
                let (mut a, mut m) = (pa.read_volatile(), pm.read_volatile());
                fold_row::<K>(il[r], bsf, &p, x, &mut a, &mut m);
                pa.write_volatile(a);
                pm.write_volatile(m);
            }
        }
        finish::<K, R>(&acc, &accm)
    }

    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    unsafe fn join(a: __m256i, b: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
    }

    /// AVX-512: 64 elements (two groups) per zmm; the four code vectors and their scales stay
    /// in registers while every row adds `vpdpwssd(maddubs(codes, q), scales)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn rows_avx512<const K: u8, const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut accm = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(bytes(K) * b);
            prefetch_ahead::<K>(w);
            let p = prep::<K>(w);
            let mut c = [_mm512_setzero_si512(); 4];
            let mut sc = [_mm512_setzero_si512(); 4];
            for h in 0..4 {
                c[h] = join(codes::<K>(w, 2 * h), codes::<K>(w, 2 * h + 1));
                sc[h] = join(
                    group_scales::<K>(&p, 2 * h),
                    group_scales::<K>(&p, 2 * h + 1),
                );
            }
            let bsf = p.bs_factor;
            for r in 0..R {
                let x = xs[r].add(Q8K_BYTES * b);
                let mut l = _mm512_setzero_si512();
                for h in 0..4 {
                    let q = _mm512_loadu_si512(x.add(Q8K_QS + 64 * h) as *const _);
                    l = _mm512_dpwssd_epi32(l, _mm512_maddubs_epi16(c[h], q), sc[h]);
                }
                let il =
                    _mm256_add_epi32(_mm512_castsi512_si256(l), _mm512_extracti64x4_epi64(l, 1));
                fold_row::<K>(il, bsf, &p, x, &mut acc[r], &mut accm[r]);
            }
        }
        finish::<K, R>(&acc, &accm)
    }

    /// A lone row goes to the single-row kernel of the same ISA (faster for one row, and the
    /// same bits by contract), looked up once.
    unsafe fn single<const K: u8>(
        f: &std::sync::OnceLock<Option<crate::DotFn>>,
        isa: crate::Isa,
        nb: usize,
        w: *const u8,
        x: *const u8,
    ) -> f32 {
        // SAFETY: the caller's `rows_blocks` proved both rows hold `nb` blocks.
        let (w, x) = unsafe {
            (
                std::slice::from_raw_parts(w, bytes(K) * nb),
                std::slice::from_raw_parts(x, Q8K_BYTES * nb),
            )
        };
        // `dot_fn` always has at least the scalar reference for these types.
        let f = f.get_or_init(|| crate::dot_fn(ty(K), isa));
        f.map_or(f32::NAN, |f| f(nb * QK_K, w, x))
    }

    macro_rules! entries {
        ($($k:ident: $avx2:ident, $avx512:ident;)*) => {$(
            pub(super) fn $avx2(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                let (rows, nb) =
                    crate::simd::rows_blocks(n, QK_K, bytes($k), Q8K_BYTES, w, xs, out);
                unsafe fn one(nb: usize, w: *const u8, x: *const u8) -> f32 {
                    static F: std::sync::OnceLock<Option<crate::DotFn>> =
                        std::sync::OnceLock::new();
                    single::<$k>(&F, crate::Isa::Avx2, nb, w, x)
                }
                // Handed out only after `simd::supported(Avx2)`; `rows_blocks` bounds `nb`.
                rows_in_groups!(rows_avx2_k, one, nb, w, xs[..rows], out[..rows]);
                #[allow(non_snake_case)]
                unsafe fn rows_avx2_k<const R: usize>(
                    nb: usize,
                    w: *const u8,
                    xs: [*const u8; R],
                ) -> [f32; R] {
                    rows_avx2::<$k, R>(nb, w, xs)
                }
            }

            pub(super) fn $avx512(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                let (rows, nb) =
                    crate::simd::rows_blocks(n, QK_K, bytes($k), Q8K_BYTES, w, xs, out);
                unsafe fn one(nb: usize, w: *const u8, x: *const u8) -> f32 {
                    static F: std::sync::OnceLock<Option<crate::DotFn>> =
                        std::sync::OnceLock::new();
                    single::<$k>(&F, crate::Isa::Avx512, nb, w, x)
                }
                // Handed out only after `simd::supported(Avx512)`; `rows_blocks` bounds `nb`.
                rows_in_groups!(rows_avx512_k, one, nb, w, xs[..rows], out[..rows]);
                unsafe fn rows_avx512_k<const R: usize>(
                    nb: usize,
                    w: *const u8,
                    xs: [*const u8; R],
                ) -> [f32; R] {
                    rows_avx512::<$k, R>(nb, w, xs)
                }
            }
        )*};
    }

    entries! {
        Q2K: q2_k_rows_avx2, q2_k_rows_avx512;
        Q3K: q3_k_rows_avx2, q3_k_rows_avx512;
        Q4K: q4_k_rows_avx2, q4_k_rows_avx512;
        Q5K: q5_k_rows_avx2, q5_k_rows_avx512;
        Q6K: q6_k_rows_avx2, q6_k_rows_avx512;
    }
}
