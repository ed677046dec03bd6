//! Multi-row x86 kernels for the I-quants (weights × Q8_K): one pass over a weight row for up
//! to 8 activation rows, each row's result bitwise equal to the single-row kernel of
//! `simd::iquants_x86` on the same ISA (and so to the scalar reference of `crate::iquants`).
//!
//! The reference fixes only the float work: per block one exact i32 sum per lane
//! (`L[l] = Σ ls·w·q` over elements `i` with `(i mod 32) / 4 == l`), then
//! `acc[l] = d.mul_add(L[l] as f32, acc[l])` with `d = dw · dx`. Integer sums can be formed in
//! any order, so these kernels lay the weights out in the activations' natural order (decoded
//! once per block for all rows) and each row only loads its codes, applies the weight signs and
//! multiplies: 32 consecutive elements per 256-bit register leave element `4l..4l+3` in i32
//! lane `l`; 64 per 512-bit register leave them in lanes `l` and `l + 8`, folded by one exact
//! add. Signs move onto the activation codes with byte arithmetic as in the single-row kernels
//! (exact for codes in −127..=127, and the same bytes as theirs for any code).

use crate::{DotRowsFn, GgmlType, Isa};

/// The multi-row kernel for `ty` on `isa`. Callers check `simd::supported(isa)`.
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<DotRowsFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let f: DotRowsFn = match (ty, isa) {
            (GgmlType::IQ4_XS, Isa::Avx2) => x86::iq4_xs_rows_avx2,
            (GgmlType::IQ4_XS, Isa::Avx512) => x86::iq4_xs_rows_avx512,
            (GgmlType::IQ3_S, Isa::Avx2) => x86::iq3_s_rows_avx2,
            (GgmlType::IQ3_S, Isa::Avx512) => x86::iq3_s_rows_avx512,
            (GgmlType::IQ3_XXS, Isa::Avx2) => x86::iq3_xxs_rows_avx2,
            (GgmlType::IQ3_XXS, Isa::Avx512) => x86::iq3_xxs_rows_avx512,
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
// Rows, sub-blocks and chunks index parallel arrays; iterators would hide the layout.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use crate::dot::reduce8;
    use crate::grids::{IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
    use crate::iquants::{Q8K_BYTES, QK_K};

    /// IQ4_XS block: f16 d | u16 scales_h | u8 scales_l[4] | qs[128] (sub-block `ib`: byte
    /// `16ib + j` holds element `j` in its low nibble and `j + 16` in its high nibble).
    const IQ4XS_BYTES: usize = 136;

    /// f16 at `p` to f32 (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let h = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// Asks for the weight block `AHEAD` blocks after `w` (`bytes` long). A weight row is a few
    /// KiB, so the hardware prefetchers ramp up on every call; the hint keeps the stream busy
    /// while the rows work. It may point past the row: prefetches never fault, and the address
    /// is formed with wrapping arithmetic.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn prefetch_ahead(w: *const u8, bytes: usize) {
        const AHEAD: usize = 4;
        let p = w.wrapping_add(AHEAD * bytes);
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
            o += 64;
        }
    }

    /// The Q8_K scale of the activation block at `x`.
    #[inline(always)]
    unsafe fn q8k_d(x: *const u8) -> f32 {
        (x as *const f32).read_unaligned()
    }

    /// Each row's 8 f32 lanes reduced as the single-row kernels finish: `post · reduce8`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn finish<const R: usize>(acc: &[__m256; R], post: f32) -> [f32; R] {
        let mut out = [0f32; R];
        for (o, a) in out.iter_mut().zip(acc) {
            let mut l = [0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), *a);
            *o = post * reduce8(l);
        }
        out
    }

    /// `acc + d·l` fused, on an accumulator kept in memory: it is touched once per block, and
    /// held in a register across the sub-block loop it made LLVM spill hot values instead (the
    /// AVX2 kernels have 16 registers). Volatile, so LLVM keeps it there.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fma_acc(acc: &mut __m256, d: f32, l: __m256i) {
        let p = acc as *mut __m256;
        let a = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), p.read_volatile());
        p.write_volatile(a);
    }

    /// The 8 sub-block scales `ls − 32` of the IQ4_XS block at `w`.
    #[inline(always)]
    unsafe fn iq4_xs_ls(w: *const u8) -> [i16; 8] {
        let sh = (w.add(2) as *const u16).read_unaligned();
        let sl = (w.add(4) as *const u32).read_unaligned();
        core::array::from_fn(|ib| {
            let lo = (sl >> (4 * ib)) & 0xf;
            let hi = ((sh >> (2 * ib)) & 3) as u32;
            (lo | hi << 4) as i16 - 32
        })
    }

    /// The 32 weight values of sub-block `ib` in element order (i8, never −128): low nibbles
    /// give elements 0..16, high nibbles 16..32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn iq4_values_avx2(w: *const u8, ib: usize, kv: __m256i) -> __m256i {
        let q = _mm_loadu_si128(w.add(8 + 16 * ib) as *const __m128i);
        let idx = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(q, 4), q),
            _mm256_set1_epi8(0x0f),
        );
        _mm256_shuffle_epi8(kv, idx)
    }

    /// AVX2: per sub-block the values `k`, `|k|` and the scale stay in registers while every
    /// row adds `madd(maddubs(|k|, sign(q, k)), ls)` to its i32 lanes (the single-row kernel's
    /// products and pair sums, so the same exact integers).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_xs_rows_avx2_inner<const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
        let kv =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(IQ4XS_BYTES * b);
            prefetch_ahead(w, IQ4XS_BYTES);
            let dw = f16_at(w);
            let ls = iq4_xs_ls(w);
            let mut l = [_mm256_setzero_si256(); R];
            // An opaque trip count keeps LLVM from unrolling the sub-blocks and hoisting all
            // their decoded values at once, which spills with 16 registers.
            for (ib, &lsv) in ls.iter().enumerate().take(core::hint::black_box(8)) {
                let k = iq4_values_avx2(w, ib, kv);
                let ak = _mm256_abs_epi8(k);
                let sc = _mm256_set1_epi16(lsv);
                for r in 0..R {
                    let q = _mm256_loadu_si256(xs[r].add(Q8K_BYTES * b + 4 + 32 * ib) as *const _);
                    let p = _mm256_maddubs_epi16(ak, _mm256_sign_epi8(q, k));
                    l[r] = _mm256_add_epi32(l[r], _mm256_madd_epi16(p, sc));
                }
            }
            for r in 0..R {
                let d = dw * q8k_d(xs[r].add(Q8K_BYTES * b));
                fma_acc(&mut acc[r], d, l[r]);
            }
        }
        finish(&acc, 1.0)
    }

    /// AVX-512: two sub-blocks per zmm. Per pair the values are put in element order once
    /// (their sign as a mask register, `|k|`, and the two scales as i16 words); every row
    /// negates its codes under the mask and adds `dpwssd(maddubs(|k|, ±q), ls)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq4_xs_rows_avx512_inner<const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
        let kv = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let m4 = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(IQ4XS_BYTES * b);
            prefetch_ahead(w, IQ4XS_BYTES);
            let dw = f16_at(w);
            let ls = iq4_xs_ls(w);
            let mut ak = [zero; 4];
            let mut neg = [0u64; 4];
            let mut sc = [zero; 4];
            for c in 0..4 {
                // qs of sub-blocks 2c, 2c+1 as 128-bit lanes [lo(2c), hi(2c), lo(2c+1), hi(2c+1)]:
                // element order.
                let v = _mm256_loadu_si256(w.add(8 + 32 * c) as *const __m256i);
                let both =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
                let idx = _mm512_and_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(both, both), m4);
                let k = _mm512_shuffle_epi8(kv, idx);
                ak[c] = _mm512_abs_epi8(k);
                neg[c] = _mm512_movepi8_mask(k);
                let (s0, s1) = (ls[2 * c] as i32 & 0xffff, ls[2 * c + 1] as i32 & 0xffff);
                sc[c] = _mm512_mask_blend_epi32(
                    0xff00,
                    _mm512_set1_epi32(s0 | s0 << 16),
                    _mm512_set1_epi32(s1 | s1 << 16),
                );
            }
            for r in 0..R {
                let x = xs[r].add(Q8K_BYTES * b);
                let mut l = zero;
                for c in 0..4 {
                    let q = _mm512_loadu_si512(x.add(4 + 64 * c) as *const _);
                    let q = _mm512_mask_sub_epi8(q, neg[c], zero, q);
                    l = _mm512_dpwssd_epi32(l, _mm512_maddubs_epi16(ak[c], q), sc[c]);
                }
                let l =
                    _mm256_add_epi32(_mm512_castsi512_si256(l), _mm512_extracti64x4_epi64(l, 1));
                let d = dw * q8k_d(x);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc[r]);
            }
        }
        finish(&acc, 1.0)
    }

    /// A lone row goes to the single-row kernel of the same ISA (faster for one row, and by
    /// contract the same bits), looked up once into `f`.
    unsafe fn single(
        f: &std::sync::OnceLock<Option<crate::DotFn>>,
        ty: crate::GgmlType,
        isa: crate::Isa,
        nb: usize,
        w: *const u8,
        x: *const u8,
    ) -> f32 {
        let ws = ty.type_size() * nb;
        // SAFETY: the caller's `rows_blocks` proved both rows hold `nb` blocks.
        let (w, x) = unsafe {
            (
                std::slice::from_raw_parts(w, ws),
                std::slice::from_raw_parts(x, Q8K_BYTES * nb),
            )
        };
        // `dot_fn` always has at least the scalar reference for these types.
        let f = f.get_or_init(|| crate::dot_fn(ty, isa));
        f.map_or(f32::NAN, |f| f(nb * QK_K, w, x))
    }

    /// The cache of one `single` call site.
    type One = std::sync::OnceLock<Option<crate::DotFn>>;

    unsafe fn one_avx2(nb: usize, w: *const u8, x: *const u8) -> f32 {
        static F: One = One::new();
        single(&F, crate::GgmlType::IQ4_XS, crate::Isa::Avx2, nb, w, x)
    }

    unsafe fn one_avx512(nb: usize, w: *const u8, x: *const u8) -> f32 {
        static F: One = One::new();
        single(&F, crate::GgmlType::IQ4_XS, crate::Isa::Avx512, nb, w, x)
    }

    pub(super) fn iq4_xs_rows_avx2(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
        let (rows, nb) = crate::simd::rows_blocks(n, QK_K, IQ4XS_BYTES, Q8K_BYTES, w, xs, out);
        // Handed out only after `simd::supported(Avx2)`; `rows_blocks` bounds `nb`.
        rows_in_groups!(
            iq4_xs_rows_avx2_inner,
            one_avx2,
            nb,
            w,
            xs[..rows],
            out[..rows]
        );
    }

    pub(super) fn iq4_xs_rows_avx512(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
        let (rows, nb) = crate::simd::rows_blocks(n, QK_K, IQ4XS_BYTES, Q8K_BYTES, w, xs, out);
        // Handed out only after `simd::supported(Avx512)`; `rows_blocks` bounds `nb`.
        rows_in_groups!(
            iq4_xs_rows_avx512_inner,
            one_avx512,
            nb,
            w,
            xs[..rows],
            out[..rows]
        );
    }

    // -----------------------------------------------------------------------------------------
    // IQ3_S and IQ3_XXS: grid magnitudes (unsigned), one sign bit per element, one scale per
    // 32 elements. Per sub-block the 8 grid entries are looked up once for all rows; a row
    // flips the signs of its codes (byte arithmetic, as the single-row kernels) and multiplies.

    /// Grid types, as const-generic tags.
    const IQ3S: u8 = 0;
    const IQ3XXS: u8 = 1;

    const fn grid_bytes(t: u8) -> usize {
        if t == IQ3S {
            110
        } else {
            98
        }
    }

    fn grid_ty(t: u8) -> crate::GgmlType {
        if t == IQ3S {
            crate::GgmlType::IQ3_S
        } else {
            crate::GgmlType::IQ3_XXS
        }
    }

    /// `post` of the reference (the scale unit of the type).
    const fn grid_post(t: u8) -> f32 {
        if t == IQ3S {
            1.0
        } else {
            0.25
        }
    }

    /// Sub-block `ib` of the block at `w`: its 32 grid magnitudes in element order, its 32 sign
    /// bits (bit `j` for element `j`) and its scale `2s + 1`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn grid_sub<const T: u8>(w: *const u8, ib: usize) -> (__m256i, u32, i16) {
        let byte = |o: usize| *w.add(o) as usize;
        let u32_at = |o: usize| (w.add(o) as *const u32).read_unaligned();
        if T == IQ3S {
            let h = byte(66 + ib);
            let g = |k: usize| IQ3S_GRID[byte(2 + 8 * ib + k) | ((h >> k) & 1) << 8] as i32;
            let grid = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
            let s = (byte(106 + ib / 2) >> (4 * (ib % 2))) & 0xf;
            (grid, u32_at(74 + 4 * ib), 2 * s as i16 + 1)
        } else {
            let g = |k: usize| IQ3XXS_GRID[byte(2 + 8 * ib + k)] as i32;
            let grid = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
            let a = u32_at(66 + 4 * ib);
            let sg = |l: usize| (KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize] as u32) << (8 * l);
            (
                grid,
                sg(0) | sg(1) | sg(2) | sg(3),
                2 * (a >> 28) as i16 + 1,
            )
        }
    }

    /// 32 sign bits as bytes −1 (bit set) or +1, for `vpsignb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn sign_bytes(bits: u32) -> __m256i {
        // Byte j takes byte j/8 of `bits`; it is all ones when bit j%8 of that byte is set.
        let rep = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_setr_epi64x(
                0,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            ),
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let neg = _mm256_cmpeq_epi8(_mm256_and_si256(rep, sel), sel);
        _mm256_or_si256(neg, _mm256_set1_epi8(1))
    }

    /// AVX2: per sub-block the grid, signs and scale stay in registers while every row adds
    /// `madd(maddubs(grid, ±q), ls)` to its i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn grid_rows_avx2<const T: u8, const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(grid_bytes(T) * b);
            prefetch_ahead(w, grid_bytes(T));
            let dw = f16_at(w);
            let mut l = [_mm256_setzero_si256(); R];
            // An opaque trip count keeps the sub-blocks from being unrolled and hoisted.
            for ib in 0..core::hint::black_box(8usize) {
                let (grid, sbits, ls) = grid_sub::<T>(w, ib);
                let sg = sign_bytes(sbits);
                let sc = _mm256_set1_epi16(ls);
                for r in 0..R {
                    let q = _mm256_loadu_si256(xs[r].add(Q8K_BYTES * b + 4 + 32 * ib) as *const _);
                    let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(q, sg));
                    l[r] = _mm256_add_epi32(l[r], _mm256_madd_epi16(p, sc));
                }
            }
            for r in 0..R {
                let d = dw * q8k_d(xs[r].add(Q8K_BYTES * b));
                fma_acc(&mut acc[r], d, l[r]);
            }
        }
        finish(&acc, grid_post(T))
    }

    /// AVX-512: two sub-blocks per zmm; signs as a mask register, scales by `vpdpwssd`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn grid_rows_avx512<const T: u8, const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let w = wp.add(grid_bytes(T) * b);
            prefetch_ahead(w, grid_bytes(T));
            let dw = f16_at(w);
            let mut grid = [zero; 4];
            let mut neg = [0u64; 4];
            let mut sc = [zero; 4];
            for c in 0..4 {
                let (g0, s0, l0) = grid_sub::<T>(w, 2 * c);
                let (g1, s1, l1) = grid_sub::<T>(w, 2 * c + 1);
                grid[c] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(g0), g1);
                neg[c] = s0 as u64 | (s1 as u64) << 32;
                sc[c] = _mm512_inserti64x4::<1>(_mm512_set1_epi16(l0), _mm256_set1_epi16(l1));
            }
            for r in 0..R {
                let x = xs[r].add(Q8K_BYTES * b);
                let mut l = zero;
                for c in 0..4 {
                    let q = _mm512_loadu_si512(x.add(4 + 64 * c) as *const _);
                    let q = _mm512_mask_sub_epi8(q, neg[c], zero, q);
                    l = _mm512_dpwssd_epi32(l, _mm512_maddubs_epi16(grid[c], q), sc[c]);
                }
                let l =
                    _mm256_add_epi32(_mm512_castsi512_si256(l), _mm512_extracti64x4_epi64(l, 1));
                let d = dw * q8k_d(x);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc[r]);
            }
        }
        finish(&acc, grid_post(T))
    }

    macro_rules! grid_entries {
        ($($t:ident: $avx2:ident, $avx512:ident;)*) => {$(
            pub(super) fn $avx2(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                let (rows, nb) =
                    crate::simd::rows_blocks(n, QK_K, grid_bytes($t), Q8K_BYTES, w, xs, out);
                unsafe fn one(nb: usize, w: *const u8, x: *const u8) -> f32 {
                    static F: One = One::new();
                    single(&F, grid_ty($t), crate::Isa::Avx2, nb, w, x)
                }
                unsafe fn kernel<const R: usize>(
                    nb: usize,
                    w: *const u8,
                    xs: [*const u8; R],
                ) -> [f32; R] {
                    grid_rows_avx2::<$t, R>(nb, w, xs)
                }
                // Handed out only after `simd::supported(Avx2)`; `rows_blocks` bounds `nb`.
                rows_in_groups!(kernel, one, nb, w, xs[..rows], out[..rows]);
            }

            pub(super) fn $avx512(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                let (rows, nb) =
                    crate::simd::rows_blocks(n, QK_K, grid_bytes($t), Q8K_BYTES, w, xs, out);
                unsafe fn one(nb: usize, w: *const u8, x: *const u8) -> f32 {
                    static F: One = One::new();
                    single(&F, grid_ty($t), crate::Isa::Avx512, nb, w, x)
                }
                unsafe fn kernel<const R: usize>(
                    nb: usize,
                    w: *const u8,
                    xs: [*const u8; R],
                ) -> [f32; R] {
                    grid_rows_avx512::<$t, R>(nb, w, xs)
                }
                // Handed out only after `simd::supported(Avx512)`; `rows_blocks` bounds `nb`.
                rows_in_groups!(kernel, one, nb, w, xs[..rows], out[..rows]);
            }
        )*};
    }

    grid_entries! {
        IQ3S: iq3_s_rows_avx2, iq3_s_rows_avx512;
        IQ3XXS: iq3_xxs_rows_avx2, iq3_xxs_rows_avx512;
    }
}
