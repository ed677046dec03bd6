//! x86 AVX2 / AVX-512 Q2_0 × Q8_0 dot products (the expert-weight kernel), bitwise equal to
//! `lowbit::dot_q2_0_q8_0`. The other low-bit types keep their scalar reference.
//!
//! Both kernels keep the reference's 32 lanes in registers in reference order: per block, the
//! exact integer sum of code byte `j` (4 elements) against its Q8_0 codes, `Σ code·q − Σ q`,
//! lands in lane `j` of the block's accumulator set (`b % 2`) through one FMA with
//! `s_h = d_w · d_x,h`. That product is exact in f32, so the kernels form it four blocks at a
//! time with F16C (the scalar loads of the scales run beside the vector work) and reuse it.
//! - AVX-512 (VNNI + VBMI): one register per block. `vpmovzxwq` puts code bytes 2k, 2k+1 in
//!   qword k, `vpmultishiftqb` spreads their 2-bit codes to one byte each, and two `vpdpbusd` give
//!   Σ code·q and Σ q per dword.
//! - AVX2: a register per half; codes spread by zero-extension and shifts, sums by
//!   `vpmaddubsw` (codes 0..3 are unsigned, so no sign trick is needed and q = −128 is exact)
//!   and `vpmaddwd`.
//!
//! An AVX-512 CPU without VBMI gets the AVX2 kernel (the bits are the same). Single-thread
//! speed, 4096-element rows: see the `q2_0_bench` test in `tests/fmt_lowbit.rs`.
//!
//! Multi-row kernels (`dot_rows`: one pass over a weight row for up to 8 activation rows,
//! each row bitwise equal to the single-row kernel) are at the end of the file; their bench is
//! `bench_dot_rows` in `tests/dot_rows.rs`.

use crate::{DotFn, GgmlType, Isa};

pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if ty != GgmlType::Q2_0 {
            return None;
        }
        match isa {
            Isa::Avx2 => Some(x86::q2_0_avx2 as DotFn),
            Isa::Avx512 if is_x86_feature_detected!("avx512vbmi") => {
                Some(x86::q2_0_avx512 as DotFn)
            }
            Isa::Avx512 => Some(x86::q2_0_avx2 as DotFn),
            Isa::Scalar => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// The Q2_0 multi-row kernel on `isa` (one weight row against up to 8 activation rows per pass),
/// each row's result bitwise equal to [`dot`]'s kernel for the same ISA.
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<crate::DotRowsFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if ty != GgmlType::Q2_0 {
            return None;
        }
        match isa {
            Isa::Avx2 => Some(x86::q2_0_rows_avx2 as crate::DotRowsFn),
            Isa::Avx512 if is_x86_feature_detected!("avx512vbmi") => {
                Some(x86::q2_0_rows_avx512 as crate::DotRowsFn)
            }
            Isa::Avx512 => Some(x86::q2_0_rows_avx2 as crate::DotRowsFn),
            Isa::Scalar => None,
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
    use crate::dot::le_f16;
    use crate::lowbit::{reduce_q2_0, Q2_0_BYTES, Q2_0_LANES};
    use std::arch::x86_64::*;

    /// Bytes of the two Q8_0 blocks paired with one Q2_0 block.
    const XB: usize = 68;
    const WB: usize = Q2_0_BYTES;

    /// Blocks the kernels may read: `n / 64`, clamped to both slices so that no caller can make
    /// them read out of bounds.
    #[inline]
    fn blocks(n: usize, w: &[u8], x: &[u8]) -> usize {
        (n / 64).min(w.len() / WB).min(x.len() / XB)
    }

    pub(super) fn q2_0_avx2(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let nb = blocks(n, w, x);
        // SAFETY: handed out only after `simd::supported(Avx2)` (AVX2, FMA, F16C); the kernel
        // reads blocks below `nb`, which both slices hold.
        unsafe { q2_0_avx2_inner(nb, w.as_ptr(), x.as_ptr()) }
    }

    pub(super) fn q2_0_avx512(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let nb = blocks(n, w, x);
        // SAFETY: handed out only after `simd::supported(Avx512)` (F/BW/VL/VNNI + AVX2/FMA/F16C)
        // and a VBMI check; the kernel reads blocks below `nb`, which both slices hold.
        unsafe { q2_0_avx512_inner(nb, w.as_ptr(), x.as_ptr()) }
    }

    #[inline(always)]
    unsafe fn rd16(p: *const u8) -> u64 {
        (p as *const u16).read_unaligned() as u64
    }

    /// Combined scales of the four blocks at `w`/`x`: `[s(0,0), s(0,1), s(1,0), …, s(3,1)]`
    /// with `s(j,h) = d_w(j) · d_x(j,h)`, exact, so equal to the reference's own product.
    #[inline(always)]
    unsafe fn scales4(w: *const u8, x: *const u8) -> __m256 {
        let d = |o: usize| rd16(x.add(o));
        let xlo = d(0) | d(34) << 16 | d(XB) << 32 | d(XB + 34) << 48;
        let xhi = d(2 * XB) | d(2 * XB + 34) << 16 | d(3 * XB) << 32 | d(3 * XB + 34) << 48;
        let wd =
            rd16(w) | rd16(w.add(WB)) << 16 | rd16(w.add(2 * WB)) << 32 | rd16(w.add(3 * WB)) << 48;
        let xf = _mm256_cvtph_ps(_mm_set_epi64x(xhi as i64, xlo as i64));
        let wf = _mm_cvtph_ps(_mm_cvtsi64_si128(wd as i64));
        let dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        _mm256_mul_ps(
            xf,
            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(wf), dup),
        )
    }

    /// The two scales of one block (for the last blocks of a row, outside groups of four).
    #[inline(always)]
    unsafe fn scales1(w: *const u8, x: *const u8) -> (f32, f32) {
        let w = std::slice::from_raw_parts(w, 2);
        let x = std::slice::from_raw_parts(x, XB);
        let dw = le_f16(w, 0);
        (dw * le_f16(x, 0), dw * le_f16(x, 34))
    }

    // ---------------------------------------------------------------------------------------
    // AVX2

    /// Codes of 8 code bytes, one zero-extended byte per dword: byte i of dword k becomes
    /// bits 2i..2i+1 of byte k. The ORed copies (shifts 0, 6, 12, 18) cannot collide because
    /// each dword starts with only 8 significant bits.
    #[inline(always)]
    unsafe fn spread_codes_avx2(w: *const u8, m3: __m256i) -> __m256i {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(w as *const __m128i));
        let t = _mm256_or_si256(v, _mm256_slli_epi32::<6>(v));
        _mm256_and_si256(_mm256_or_si256(t, _mm256_slli_epi32::<12>(t)), m3)
    }

    /// Per-dword integer sums of one half: codes `c` (0..3) against the 32 Q8_0 codes at `q`.
    /// The 16-bit pair sums cannot saturate: |3·(−128)·2| < 2^15.
    #[inline(always)]
    unsafe fn half_sums_avx2(c: __m256i, q: *const u8) -> __m256i {
        let y = _mm256_loadu_si256(q as *const __m256i);
        let ones8 = _mm256_set1_epi8(1);
        let p = _mm256_sub_epi16(_mm256_maddubs_epi16(c, y), _mm256_maddubs_epi16(ones8, y));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// One block into `acc` (lanes 0..8 and 8..16 of its set) with scales `s0`, `s1`.
    #[inline(always)]
    unsafe fn block_avx2(
        acc: &mut [__m256; 2],
        w: *const u8,
        x: *const u8,
        s0: __m256,
        s1: __m256,
    ) {
        let m3 = _mm256_set1_epi8(3);
        let g0 = half_sums_avx2(spread_codes_avx2(w.add(2), m3), x.add(2));
        let g1 = half_sums_avx2(spread_codes_avx2(w.add(10), m3), x.add(36));
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g0), s0, acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1), s1, acc[1]);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2_0_avx2_inner(nb: usize, wp: *const u8, xp: *const u8) -> f32 {
        // acc[set][h] holds reference lanes 16·set + 8h .. 16·set + 8h + 8.
        let mut acc = [[_mm256_setzero_ps(); 2]; 2];
        let pick = |s: __m256, i: i32| _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(i));
        let mut b = 0;
        while b + 4 <= nb {
            let (w, x) = (wp.add(WB * b), xp.add(XB * b));
            let s = scales4(w, x);
            for j in 0..4 {
                let (s0, s1) = (pick(s, 2 * j as i32), pick(s, 2 * j as i32 + 1));
                block_avx2(&mut acc[j % 2], w.add(WB * j), x.add(XB * j), s0, s1);
            }
            b += 4;
        }
        while b < nb {
            let (w, x) = (wp.add(WB * b), xp.add(XB * b));
            let (s0, s1) = scales1(w, x);
            // Constant indices keep the accumulators in registers.
            let a = if b % 2 == 0 { &mut acc[0] } else { &mut acc[1] };
            block_avx2(a, w, x, _mm256_set1_ps(s0), _mm256_set1_ps(s1));
            b += 1;
        }
        let mut lanes = [0f32; Q2_0_LANES];
        for (set, a) in acc.iter().enumerate() {
            for (h, v) in a.iter().enumerate() {
                _mm256_storeu_ps(lanes.as_mut_ptr().add(16 * set + 8 * h), *v);
            }
        }
        reduce_q2_0(&lanes)
    }

    // ---------------------------------------------------------------------------------------
    // AVX-512

    /// `vpmultishiftqb` bit offsets: byte i of a qword takes bits 2i.. of the qword, i.e. codes
    /// 0..3 of its first code byte, then codes 0..3 of its second.
    static CODE_SHIFT: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            t[i] = 2 * (i % 8) as u8;
            i += 1;
        }
        t
    };

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn q2_0_avx512_inner(nb: usize, wp: *const u8, xp: *const u8) -> f32 {
        let shift = _mm512_loadu_si512(CODE_SHIFT.as_ptr() as *const _);
        let m3 = _mm512_set1_epi8(3);
        let ones = _mm512_set1_epi8(1);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); 2];

        // Dword j of the result: the integer sum of code byte j (reference lane order).
        let sums = |w: *const u8, x: *const u8| -> __m512i {
            let q = _mm512_cvtepu16_epi64(_mm_loadu_si128(w.add(2) as *const __m128i));
            let c = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, q), m3);
            let y0 = _mm512_castsi256_si512(_mm256_loadu_si256(x.add(2) as *const __m256i));
            let y = _mm512_inserti64x4::<1>(y0, _mm256_loadu_si256(x.add(36) as *const __m256i));
            _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, c, y),
                _mm512_dpbusd_epi32(zero, ones, y),
            )
        };
        // [s(j,0) × 8, s(j,1) × 8] from the four blocks' scales.
        let idx = |j: i32| {
            let (a, b) = (2 * j, 2 * j + 1);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        let (i0, i1, i2, i3) = (idx(0), idx(1), idx(2), idx(3));

        let mut b = 0;
        while b + 4 <= nb {
            let (w, x) = (wp.add(WB * b), xp.add(XB * b));
            let s = _mm512_castps256_ps512(scales4(w, x));
            let g0 = sums(w, x);
            let g1 = sums(w.add(WB), x.add(XB));
            let g2 = sums(w.add(2 * WB), x.add(2 * XB));
            let g3 = sums(w.add(3 * WB), x.add(3 * XB));
            let f = |g: __m512i, i: __m512i, a: __m512| {
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(g), _mm512_permutexvar_ps(i, s), a)
            };
            acc[0] = f(g0, i0, acc[0]);
            acc[1] = f(g1, i1, acc[1]);
            acc[0] = f(g2, i2, acc[0]);
            acc[1] = f(g3, i3, acc[1]);
            b += 4;
        }
        while b < nb {
            let (w, x) = (wp.add(WB * b), xp.add(XB * b));
            let (s0, s1) = scales1(w, x);
            let s = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
            let a = if b % 2 == 0 { &mut acc[0] } else { &mut acc[1] };
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums(w, x)), s, *a);
            b += 1;
        }
        let mut lanes = [0f32; Q2_0_LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc[0]);
        _mm512_storeu_ps(lanes.as_mut_ptr().add(16), acc[1]);
        reduce_q2_0(&lanes)
    }

    // ---------------------------------------------------------------------------------------
    // Several activation rows against one pass over the weight row.
    //
    // Per block the integer sums g_j = Σ (code − 1)·q are formed as
    // `Σ (q + 128)·(code − 1) − 128·Σ (code − 1)`: the activation side becomes unsigned by a
    // xor, the weight side `code − 1` is signed, and the correction depends on the weights
    // alone, so it is computed once per block for all rows. Both forms are exact, so every row
    // gets the single-row kernel's g and, with the same scales, lanes and FMA order, its bits.
    // AVX-512 keeps the single-row layout (one block per zmm, all rows' accumulators in
    // registers). AVX2 cannot hold 8 rows of 4 accumulators in 16 registers, so it decodes a
    // chunk of blocks into an L1 table that the rows take turns over, with every row's scales
    // `d_w · d_x` (exact) formed first into a small table that the FMAs read as broadcasts.

    /// Blocks per chunk (2048 elements): the scale table holds 2·CH f32 per row.
    const CH: usize = 32;

    pub(super) fn q2_0_rows_avx2(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
        let (rows, nb) = crate::simd::rows_blocks(n, 64, WB, XB, w, xs, out);
        rows_in_groups!(
            q2_0_rows_avx2_inner,
            q2_0_avx2_inner,
            nb,
            w,
            xs[..rows],
            out[..rows]
        );
    }

    pub(super) fn q2_0_rows_avx512(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
        let (rows, nb) = crate::simd::rows_blocks(n, 64, WB, XB, w, xs, out);
        rows_in_groups!(
            q2_0_rows_avx512_inner,
            q2_0_avx512_inner,
            nb,
            w,
            xs[..rows],
            out[..rows]
        );
    }

    /// The f16 scales of the 8 Q8_0 blocks paired with four Q2_0 blocks at `x`, as f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn xscales8(x: *const u8) -> __m256 {
        let d = |o: usize| rd16(x.add(o));
        let xlo = d(0) | d(34) << 16 | d(XB) << 32 | d(XB + 34) << 48;
        let xhi = d(2 * XB) | d(2 * XB + 34) << 16 | d(3 * XB) << 32 | d(3 * XB + 34) << 48;
        _mm256_cvtph_ps(_mm_set_epi64x(xhi as i64, xlo as i64))
    }

    /// The f16 scales of four Q2_0 blocks at `w`, each twice: `[d0, d0, d1, d1, …, d3, d3]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn wscales4_dup(w: *const u8) -> __m256 {
        let wd =
            rd16(w) | rd16(w.add(WB)) << 16 | rd16(w.add(2 * WB)) << 32 | rd16(w.add(3 * WB)) << 48;
        let wf = _mm_cvtph_ps(_mm_cvtsi64_si128(wd as i64));
        let dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(wf), dup)
    }

    /// Every row's scales of the `k <= CH` blocks at `w` / `xs[r]`: `s[r][2j + h] = d_w(j) ·
    /// d_x(r, j, h)`, the products the single-row kernels form (exact, so equal however made).
    // Rows and blocks index parallel arrays.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn chunk_scales<const R: usize>(
        w: *const u8,
        xs: &[*const u8; R],
        k: usize,
        s: &mut [[f32; 2 * CH]; R],
    ) {
        let groups = k / 4;
        let mut wd = [_mm256_setzero_ps(); CH / 4];
        for g in 0..groups {
            wd[g] = wscales4_dup(w.add(4 * WB * g));
        }
        for r in 0..R {
            for g in 0..groups {
                let v = _mm256_mul_ps(xscales8(xs[r].add(4 * XB * g)), wd[g]);
                _mm256_storeu_ps(s[r].as_mut_ptr().add(8 * g), v);
            }
            for j in 4 * groups..k {
                let (s0, s1) = scales1(w.add(WB * j), xs[r].add(XB * j));
                s[r][2 * j] = s0;
                s[r][2 * j + 1] = s1;
            }
        }
    }

    /// A decoded block: per half, the signed codes `code − 1` and the per-dword correction
    /// `−128·Σ (code − 1)`.
    #[derive(Clone, Copy)]
    struct Decoded {
        c: [__m256i; 2],
        corr: [__m256i; 2],
    }

    const DECODED_ZERO: Decoded = Decoded {
        c: [unsafe { core::mem::zeroed() }; 2],
        corr: [unsafe { core::mem::zeroed() }; 2],
    };

    /// One half of [`decode_avx2`]: the codes of the 8 code bytes at `w` and their correction.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode_half_avx2(w: *const u8) -> (__m256i, __m256i) {
        let one8 = _mm256_set1_epi8(1);
        let c = spread_codes_avx2(w, _mm256_set1_epi8(3));
        // 128 · (1 − code): pair sums within ±512, no saturation.
        let nc = _mm256_maddubs_epi16(_mm256_set1_epi8(0x80_u8 as i8), _mm256_sub_epi8(one8, c));
        (
            _mm256_sub_epi8(c, one8),
            _mm256_madd_epi16(nc, _mm256_set1_epi16(1)),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode_avx2(w: *const u8) -> Decoded {
        let (c0, k0) = decode_half_avx2(w.add(2));
        let (c1, k1) = decode_half_avx2(w.add(10));
        Decoded {
            c: [c0, c1],
            corr: [k0, k1],
        }
    }

    /// One half block of one row into `a`: g per dword is `Σ (q + 128)·(code − 1) + corr`
    /// (`maddubs` pair sums stay within [−510, 1020]), then `a + g·s` fused.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_avx2(a: __m256, c: __m256i, corr: __m256i, q: *const u8, s: &f32) -> __m256 {
        let y = _mm256_loadu_si256(q as *const __m256i);
        let yu = _mm256_xor_si256(y, _mm256_set1_epi8(0x80_u8 as i8));
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(yu, c), _mm256_set1_epi16(1));
        let g = _mm256_add_epi32(p, corr);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(g), _mm256_broadcast_ss(s), a)
    }

    /// AVX2: the 16 registers cannot hold 8 rows of 4 accumulators, so a chunk of blocks is
    /// decoded once into an L1 table and the rows take turns over it.
    // Rows and blocks index parallel arrays.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2_0_rows_avx2_inner<const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        // acc[r][2·set + h]: reference lanes 16·set + 8h .. +8 of row r.
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mut s = [[0f32; 2 * CH]; R];
        let mut dec = [DECODED_ZERO; CH];
        let mut b = 0;
        while b < nb {
            let k = CH.min(nb - b);
            let w = wp.add(WB * b);
            let x: [*const u8; R] = core::array::from_fn(|r| xs[r].add(XB * b));
            for j in 0..k {
                dec[j] = decode_avx2(w.add(WB * j));
            }
            chunk_scales(w, &x, k, &mut s);
            // CH is even, so block b + j is in set j % 2.
            for r in 0..R {
                let mut a = acc[r];
                let sr = &s[r];
                let mut j = 0;
                while j + 2 <= k {
                    for i in 0..2 {
                        let (d, xb) = (&dec[j + i], x[r].add(XB * (j + i)));
                        let sj = &sr[2 * (j + i)..];
                        a[2 * i] = half_avx2(a[2 * i], d.c[0], d.corr[0], xb.add(2), &sj[0]);
                        a[2 * i + 1] =
                            half_avx2(a[2 * i + 1], d.c[1], d.corr[1], xb.add(36), &sj[1]);
                    }
                    j += 2;
                }
                if j < k {
                    let (d, xb) = (&dec[j], x[r].add(XB * j));
                    a[0] = half_avx2(a[0], d.c[0], d.corr[0], xb.add(2), &sr[2 * j]);
                    a[1] = half_avx2(a[1], d.c[1], d.corr[1], xb.add(36), &sr[2 * j + 1]);
                }
                acc[r] = a;
            }
            b += k;
        }
        finish_rows(&acc)
    }

    /// Each row's lanes (`acc[r][2·set + h]` = reference lanes `16·set + 8h ..`) reduced.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn finish_rows<const R: usize>(acc: &[[__m256; 4]; R]) -> [f32; R] {
        let mut out = [0f32; R];
        for (o, a) in out.iter_mut().zip(acc) {
            let mut lanes = [0f32; Q2_0_LANES];
            for (l, v) in a.iter().enumerate() {
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * l), *v);
            }
            *o = reduce_q2_0(&lanes);
        }
        out
    }

    /// The 64 activation codes of the two Q8_0 blocks at `x`, xor `bias`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn ypair(x: *const u8, bias: __m512i) -> __m512i {
        let y0 = _mm512_castsi256_si512(_mm256_loadu_si256(x.add(2) as *const __m256i));
        let y = _mm512_inserti64x4::<1>(y0, _mm256_loadu_si256(x.add(36) as *const __m256i));
        _mm512_xor_si512(y, bias)
    }

    /// AVX-512 (VNNI + VBMI): one block per zmm as in the single-row kernel, every row's two
    /// accumulator sets in registers (16 for 8 rows), four decoded blocks shared by all rows.
    // Rows and blocks index parallel arrays.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn q2_0_rows_avx512_inner<const R: usize>(
        nb: usize,
        wp: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let shift = _mm512_loadu_si512(CODE_SHIFT.as_ptr() as *const _);
        let m3 = _mm512_set1_epi8(3);
        let one8 = _mm512_set1_epi8(1);
        let bias = _mm512_set1_epi8(0x80_u8 as i8);
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let idx = |j: i32| {
            let (a, b) = (2 * j, 2 * j + 1);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        let ix = [idx(0), idx(1), idx(2), idx(3)];
        let mut b = 0;
        while b + 4 <= nb {
            let w = wp.add(WB * b);
            // A hint for the weights 16 blocks ahead (it may point past the row: prefetches
            // never fault, and the address is formed with wrapping arithmetic).
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(16 * WB) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(16 * WB + 64) as *const i8);
            let mut c = [zero; 4];
            let mut corr = [zero; 4];
            for j in 0..4 {
                let q = _mm512_cvtepu16_epi64(_mm_loadu_si128(w.add(WB * j + 2) as *const __m128i));
                let cj = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, q), m3);
                corr[j] = _mm512_dpbusd_epi32(zero, bias, _mm512_sub_epi8(one8, cj));
                c[j] = _mm512_sub_epi8(cj, one8);
            }
            let wdup = wscales4_dup(w);
            for r in 0..R {
                let x = xs[r].add(XB * b);
                let s = _mm512_castps256_ps512(_mm256_mul_ps(xscales8(x), wdup));
                for j in 0..4 {
                    let xb = x.add(XB * j);
                    let y = ypair(xb, bias);
                    let g = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[j], y, c[j]));
                    let sj = _mm512_permutexvar_ps(ix[j], s);
                    acc[r][j % 2] = _mm512_fmadd_ps(g, sj, acc[r][j % 2]);
                }
            }
            b += 4;
        }
        while b < nb {
            let w = wp.add(WB * b);
            let q = _mm512_cvtepu16_epi64(_mm_loadu_si128(w.add(2) as *const __m128i));
            let cj = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, q), m3);
            let corr = _mm512_dpbusd_epi32(zero, bias, _mm512_sub_epi8(one8, cj));
            let c = _mm512_sub_epi8(cj, one8);
            let set = b % 2;
            for r in 0..R {
                let xb = xs[r].add(XB * b);
                let (s0, s1) = scales1(w, xb);
                let s = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
                let y = ypair(xb, bias);
                let g = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, y, c));
                if set == 0 {
                    acc[r][0] = _mm512_fmadd_ps(g, s, acc[r][0]);
                } else {
                    acc[r][1] = _mm512_fmadd_ps(g, s, acc[r][1]);
                }
            }
            b += 1;
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let mut lanes = [0f32; Q2_0_LANES];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc[r][0]);
            _mm512_storeu_ps(lanes.as_mut_ptr().add(16), acc[r][1]);
            out[r] = reduce_q2_0(&lanes);
        }
        out
    }
}
