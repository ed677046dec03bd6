//! x86 AVX2 / AVX-512 dot products for the K-quant family (weights × Q8_K). Each kernel
//! computes a block's integer sums exactly (byte products with `maddubs`, sub-block scales with
//! `madd`/VNNI `dpwssd`, mins through the Q8_K `bsums`), reduces them to one i32 per block, and
//! then performs exactly the float steps of `kquants::fold_block`, so it is bitwise equal to
//! the scalar reference (see the `kquants` module doc for the order).

use crate::{DotFn, GgmlType, Isa};

pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if !super::supported(isa) {
            return None;
        }
        x86::dot(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::kquants::{
        fold_block, Q2K_BYTES, Q3K_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, Q8K_BSUMS, Q8K_BYTES,
        Q8K_QS,
    };
    use crate::{DotFn, GgmlType, Isa};

    pub(super) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
        use GgmlType::*;
        let f: DotFn = match (ty, isa) {
            (Q4_K, Isa::Avx2) => q4k_avx2,
            (Q4_K, Isa::Avx512) => q4k_avx512,
            (Q6_K, Isa::Avx2) => q6k_avx2,
            (Q6_K, Isa::Avx512) => q6k_avx512,
            (Q2_K, Isa::Avx2) => q2k_avx2,
            (Q2_K, Isa::Avx512) => q2k_avx512,
            (Q3_K, Isa::Avx2) => q3k_avx2,
            (Q3_K, Isa::Avx512) => q3k_avx512,
            (Q5_K, Isa::Avx2) => q5k_avx2,
            (Q5_K, Isa::Avx512) => q5k_avx512,
            _ => return None,
        };
        Some(f)
    }

    // Safe entry points: `dot` hands them out only after `simd::supported(isa)` said yes, and
    // every load in the kernels stays inside one `chunks_exact` block of `w` or `x`.
    macro_rules! entry {
        ($name:ident, $kernel:ident) => {
            fn $name(_n: usize, w: &[u8], x: &[u8]) -> f32 {
                // SAFETY: the CPU features were checked before this pointer was handed out;
                // the kernel reads only within whole blocks of `w` and `x`.
                unsafe { $kernel(w, x) }
            }
        };
    }
    entry!(q4k_avx2, q4k_avx2_impl);
    entry!(q4k_avx512, q4k_avx512_impl);
    entry!(q6k_avx2, q6k_avx2_impl);
    entry!(q6k_avx512, q6k_avx512_impl);
    entry!(q2k_avx2, q2k_avx2_impl);
    entry!(q2k_avx512, q2k_avx512_impl);
    entry!(q3k_avx2, q3k_avx2_impl);
    entry!(q3k_avx512, q3k_avx512_impl);
    entry!(q5k_avx2, q5k_avx2_impl);
    entry!(q5k_avx512, q5k_avx512_impl);

    // ---------------------------------------------------------------------------------------
    // Shared pieces

    /// Two adjacent f16 values at `p` as f32 (exact, as the scalar `le_f16`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x2(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// One f16 at `p` as f32 (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x1(p: *const u8) -> f32 {
        let bits = (p as *const u16).read_unaligned() as i32;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8k_d(y: *const u8) -> f32 {
        (y as *const f32).read_unaligned()
    }

    /// The wrapping sums of the 8 i32 lanes of `a` and of `b`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_pair(a: __m256i, b: __m256i) -> (i32, i32) {
        let a = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        let b = _mm_add_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        let h = _mm_hadd_epi32(a, b);
        let h = _mm_hadd_epi32(h, h);
        (_mm_cvtsi128_si32(h), _mm_extract_epi32(h, 1))
    }

    /// The wrapping sum of the 8 i32 lanes of `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(a: __m256i) -> i32 {
        let a = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        let a = _mm_add_epi32(a, _mm_unpackhi_epi64(a, a));
        let a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0b01));
        _mm_cvtsi128_si32(a)
    }

    /// Q4_K/Q5_K's 12 scale bytes as (8 six-bit scales, 8 six-bit mins), one per byte.
    #[inline(always)]
    fn unpack_k4(s: &[u8]) -> (u64, u64) {
        let w = |o: usize| u32::from_le_bytes([s[o], s[o + 1], s[o + 2], s[o + 3]]);
        let (a, b, c) = (w(0), w(4), w(8));
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const LOW2: u32 = 0x0303_0303;
        let sc_lo = a & LOW6;
        let sc_hi = (c & LOW4) | (((a >> 6) & LOW2) << 4);
        let m_lo = b & LOW6;
        let m_hi = ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4);
        (
            sc_lo as u64 | (sc_hi as u64) << 32,
            m_lo as u64 | (m_hi as u64) << 32,
        )
    }

    /// A `shuffle_epi8` control that copies i16 lane `k` (of a 128-bit lane) to every lane.
    #[inline(always)]
    fn bcast16(k: i32) -> i16 {
        (((2 * k + 1) << 8) | (2 * k)) as i16
    }

    /// Σ_j m_j · (bsum_2j + bsum_2j+1) as 8 i32 lanes, `m` one byte per sub-block of 32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mins_k4(m: u64, y: *const u8) -> __m256i {
        let m8 = _mm_cvtsi64_si128(m as i64);
        let mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        let bs = _mm256_loadu_si256(y.add(Q8K_BSUMS) as *const __m256i);
        _mm256_madd_epi16(bs, mdup)
    }

    // ---------------------------------------------------------------------------------------
    // Q4_K

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4k_avx2_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let yp = y.as_ptr();
            let mprod = mins_k4(mn, yp);
            let qs = b.as_ptr().add(16);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let xlo = _mm256_loadu_si256(qx.add(64 * c) as *const __m256i);
                let xhi = _mm256_loadu_si256(qx.add(64 * c + 32) as *const __m256i);
                let slo = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(bcast16(2 * c as i32)));
                let shi = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(bcast16(2 * c as i32 + 1)));
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), slo);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), shi);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
            }
            let (isum, msum) = hsum_pair(sumi, mprod);
            let (d, dmin) = f16x2(b.as_ptr());
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }

    /// Sums the 16 i32 lanes of `a` down to 8 (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn fold512(a: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        // 128-bit lanes 0,1 take scale 2c, lanes 2,3 scale 2c+1.
        let shuf = |c: i32| {
            let a = bcast16(2 * c) as i32 & 0xFFFF;
            let b = bcast16(2 * c + 1) as i32 & 0xFFFF;
            let (a, b) = (a | a << 16, b | b << 16);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        let sh = [shuf(0), shuf(1), shuf(2), shuf(3)];
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scz = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let yp = y.as_ptr();
            let mprod = mins_k4(mn, yp);
            let qs = b.as_ptr().add(16);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for (c, shc) in sh.iter().enumerate() {
                // Both halves hold the same 32 bytes: low nibbles (elements 64c..64c+32) below,
                // high nibbles (64c+32..64c+64) above, matching 64 contiguous activations.
                let q =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c) as *const __m256i));
                let q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4), m4);
                let xv = _mm512_loadu_si512(qx.add(64 * c) as *const _);
                let p = _mm512_maddubs_epi16(q, xv);
                sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_shuffle_epi8(scz, *shc));
            }
            let (isum, msum) = hsum_pair(fold512(sumi), mprod);
            let (d, dmin) = f16x2(b.as_ptr());
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }

    // ---------------------------------------------------------------------------------------
    // Q6_K

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k_avx2_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = 0f32;
        for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = _mm_loadu_si128(bp.add(192) as *const __m128i);
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), bs);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let ql0 = _mm256_loadu_si256(bp.add(64 * n) as *const __m256i);
                let ql1 = _mm256_loadu_si256(bp.add(64 * n + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(bp.add(128 + 32 * n) as *const __m256i);
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    ),
                ];
                for (k, qk) in q.iter().enumerate() {
                    let s = (8 * n + 2 * k) as i8;
                    let pat = _mm_setr_epi8(
                        s,
                        s,
                        s,
                        s,
                        s,
                        s,
                        s,
                        s,
                        s + 1,
                        s + 1,
                        s + 1,
                        s + 1,
                        s + 1,
                        s + 1,
                        s + 1,
                        s + 1,
                    );
                    let scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pat));
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * k) as *const __m256i);
                    let p = _mm256_maddubs_epi16(*qk, xv);
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv));
                }
            }
            let isum = hsum(_mm256_sub_epi32(sumi, _mm256_slli_epi32(corr, 5)));
            acc += (q8k_d(yp) * f16x1(bp.add(208))) * isum as f32;
        }
        acc
    }

    /// `permutexvar_epi16` controls: 128-bit lane L of control k selects i16 `4k + L`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn quad_idx(k: i32) -> __m512i {
        let v = |l: i32| (4 * k + l) | (4 * k + l) << 16;
        let (a, b, c, d) = (v(0), v(1), v(2), v(3));
        _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q6k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        // Lower half: elements 0..32 (qh bits 0,1); upper half: 32..64 (qh bits 2,3).
        let shl_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        // Lower half: elements 64..96 (qh bits 4,5); upper half: 96..128 (qh bits 6,7).
        let shr_b = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
        let mut acc = 0f32;
        for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(bp.add(192) as *const __m128i));
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let corr = _mm256_madd_epi16(sc16, bs);
            let scz = _mm512_castsi256_si512(sc16);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let ql = _mm512_loadu_si512(bp.add(64 * n) as *const _);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    bp.add(128 + 32 * n) as *const __m256i
                ));
                let ha = _mm512_and_si512(_mm512_sllv_epi16(qh, shl_a), m30);
                let hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shr_b), m30);
                // (a & b) | c
                let qa = _mm512_ternarylogic_epi32(ql, m4, ha, 0xEA);
                let qb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4, hb, 0xEA);
                let xa = _mm512_loadu_si512(qx.add(128 * n) as *const _);
                let xb = _mm512_loadu_si512(qx.add(128 * n + 64) as *const _);
                let sa = _mm512_permutexvar_epi16(idx[2 * n], scz);
                let sb = _mm512_permutexvar_epi16(idx[2 * n + 1], scz);
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(qa, xa), sa);
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(qb, xb), sb);
            }
            let isum = hsum(_mm256_sub_epi32(fold512(sumi), _mm256_slli_epi32(corr, 5)));
            acc += (q8k_d(yp) * f16x1(bp.add(208))) * isum as f32;
        }
        acc
    }

    // ---------------------------------------------------------------------------------------
    // Sub-blocks of 16 (Q2_K, Q3_K): element ranges 128n + 32j + [0, 32) hold sub-blocks
    // 8n + 2j and 8n + 2j + 1, codes in bits 2j of the 32 bytes of half n.

    /// i16 scales for sub-blocks `s` (lower 128 bits) and `s + 1` (upper), from 16 i8 scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair_scales(sc8: __m128i, s: i32) -> __m256i {
        let (a, b) = (s as i8, s as i8 + 1);
        let pat = _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pat))
    }

    /// Moves bit `from` of every byte of `v` to bit `to` (other bits: garbage for a mask).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn move_bit(v: __m256i, from: i32, to: i32) -> __m256i {
        if from <= to {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from))
        } else {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k_avx2_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let raw = _mm_loadu_si128(bp as *const __m128i);
            let sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            let mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let mprod = _mm256_madd_epi16(_mm256_cvtepu8_epi16(mn8), bs);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let q2 = _mm256_loadu_si256(bp.add(16 + 32 * n) as *const __m256i);
                for j in 0..4 {
                    let q =
                        _mm256_and_si256(_mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32)), m3);
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * j) as *const __m256i);
                    let scv = pair_scales(sc8, (8 * n + 2 * j) as i32);
                    sumi =
                        _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scv));
                }
            }
            let (isum, msum) = hsum_pair(sumi, mprod);
            let (d, dmin) = f16x2(bp.add(80));
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }

    /// Q3_K's 16 scales minus 32, one i8 per sub-block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_scales(s: *const u8) -> __m128i {
        let w = |o: usize| (s.add(o) as *const u32).read_unaligned();
        let (a, b, c) = (w(0), w(4), w(8));
        const LOW4: u32 = 0x0f0f_0f0f;
        const LOW2: u32 = 0x0303_0303;
        let v = _mm_setr_epi32(
            ((a & LOW4) | ((c & LOW2) << 4)) as i32,
            ((b & LOW4) | (((c >> 2) & LOW2) << 4)) as i32,
            (((a >> 4) & LOW4) | (((c >> 4) & LOW2) << 4)) as i32,
            (((b >> 4) & LOW4) | (((c >> 6) & LOW2) << 4)) as i32,
        );
        _mm_sub_epi8(v, _mm_set1_epi8(32))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_avx2_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let m04 = _mm256_set1_epi8(4);
        let mut acc = 0f32;
        for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = q3k_scales(bp.add(96));
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), bs);
            let hm = _mm256_loadu_si256(bp as *const __m256i);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let q2 = _mm256_loadu_si256(bp.add(32 + 32 * n) as *const __m256i);
                for j in 0..4 {
                    let lo =
                        _mm256_and_si256(_mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32)), m3);
                    let hi = _mm256_and_si256(move_bit(hm, (4 * n + j) as i32, 2), m04);
                    let q = _mm256_or_si256(lo, hi);
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * j) as *const __m256i);
                    let scv = pair_scales(sc8, (8 * n + 2 * j) as i32);
                    sumi =
                        _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scv));
                }
            }
            let isum = hsum(_mm256_sub_epi32(sumi, _mm256_slli_epi32(corr, 2)));
            acc += (q8k_d(yp) * f16x1(bp.add(108))) * isum as f32;
        }
        acc
    }

    /// A 512-bit vector of `lo` in the lower 256 bits and `hi` in the upper, per i16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn halves16(lo: i16, hi: i16) -> __m512i {
        _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1)
    }

    /// A 512-bit vector of byte `lo` in the lower 256 bits and `hi` in the upper.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn halves8(lo: u8, hi: u8) -> __m512i {
        _mm512_inserti64x4(_mm512_set1_epi8(lo as i8), _mm256_set1_epi8(hi as i8), 1)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q2k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm512_set1_epi8(3);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        // Codes for j = 0, 1 (shifts 0, 2) and j = 2, 3 (shifts 4, 6) per 64 elements.
        let shr = [halves16(0, 2), halves16(4, 6)];
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let raw = _mm_loadu_si128(bp as *const __m128i);
            let sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            let mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let mprod = _mm256_madd_epi16(_mm256_cvtepu8_epi16(mn8), bs);
            let scz = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sc8));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    bp.add(16 + 32 * n) as *const __m256i
                ));
                for (h, sh) in shr.iter().enumerate() {
                    let q = _mm512_and_si512(_mm512_srlv_epi16(q2, *sh), m3);
                    let xv = _mm512_loadu_si512(qx.add(128 * n + 64 * h) as *const _);
                    let scv = _mm512_permutexvar_epi16(idx[2 * n + h], scz);
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q, xv), scv);
                }
            }
            let (isum, msum) = hsum_pair(fold512(sumi), mprod);
            let (d, dmin) = f16x2(bp.add(80));
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q3k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm512_set1_epi8(3);
        let m04 = _mm512_set1_epi8(4);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        let shr = [halves16(0, 2), halves16(4, 6)];
        // hmask bit 4n + j for the element range of (n, j).
        let hbit = [
            [halves8(1, 2), halves8(4, 8)],
            [halves8(16, 32), halves8(64, 128)],
        ];
        let mut acc = 0f32;
        for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = q3k_scales(bp.add(96));
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let bs = _mm256_loadu_si256(yp.add(Q8K_BSUMS) as *const __m256i);
            let corr = _mm256_madd_epi16(sc16, bs);
            let scz = _mm512_castsi256_si512(sc16);
            let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(bp as *const __m256i));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    bp.add(32 + 32 * n) as *const __m256i
                ));
                for h in 0..2 {
                    let q = _mm512_and_si512(_mm512_srlv_epi16(q2, shr[h]), m3);
                    let k = _mm512_test_epi8_mask(hm, hbit[n][h]);
                    let q = _mm512_mask_add_epi8(q, k, q, m04);
                    let xv = _mm512_loadu_si512(qx.add(128 * n + 64 * h) as *const _);
                    let scv = _mm512_permutexvar_epi16(idx[2 * n + h], scz);
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q, xv), scv);
                }
            }
            let isum = hsum(_mm256_sub_epi32(fold512(sumi), _mm256_slli_epi32(corr, 2)));
            acc += (q8k_d(yp) * f16x1(bp.add(108))) * isum as f32;
        }
        acc
    }

    // ---------------------------------------------------------------------------------------
    // Q5_K: Q4_K plus bit s of qh[l] as bit 4 of element 32s + l.

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5k_avx2_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let m10 = _mm256_set1_epi8(0x10);
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q5K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let mprod = mins_k4(mn, yp);
            let qh = _mm256_loadu_si256(bp.add(16) as *const __m256i);
            let qs = bp.add(48);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                let hlo = _mm256_and_si256(move_bit(qh, 2 * c as i32, 4), m10);
                let hhi = _mm256_and_si256(move_bit(qh, 2 * c as i32 + 1, 4), m10);
                let lo = _mm256_or_si256(_mm256_and_si256(q, m4), hlo);
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), hhi);
                let xlo = _mm256_loadu_si256(qx.add(64 * c) as *const __m256i);
                let xhi = _mm256_loadu_si256(qx.add(64 * c + 32) as *const __m256i);
                let slo = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(bcast16(2 * c as i32)));
                let shi = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(bcast16(2 * c as i32 + 1)));
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), slo);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), shi);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
            }
            let (isum, msum) = hsum_pair(sumi, mprod);
            let (d, dmin) = f16x2(bp);
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q5k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m10 = _mm512_set1_epi8(0x10);
        let shuf = |c: i32| {
            let a = bcast16(2 * c) as i32 & 0xFFFF;
            let b = bcast16(2 * c + 1) as i32 & 0xFFFF;
            let (a, b) = (a | a << 16, b | b << 16);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        let sh = [shuf(0), shuf(1), shuf(2), shuf(3)];
        let hbit = [
            halves8(1, 2),
            halves8(4, 8),
            halves8(16, 32),
            halves8(64, 128),
        ];
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, y) in w.chunks_exact(Q5K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scz = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let mprod = mins_k4(mn, yp);
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(bp.add(16) as *const __m256i));
            let qs = bp.add(48);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for c in 0..4 {
                let q =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c) as *const __m256i));
                let q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4), m4);
                let k = _mm512_test_epi8_mask(qh, hbit[c]);
                let q = _mm512_mask_add_epi8(q, k, q, m10);
                let xv = _mm512_loadu_si512(qx.add(64 * c) as *const _);
                let p = _mm512_maddubs_epi16(q, xv);
                sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_shuffle_epi8(scz, sh[c]));
            }
            let (isum, msum) = hsum_pair(fold512(sumi), mprod);
            let (d, dmin) = f16x2(bp);
            fold_block(&mut acc, &mut accm, q8k_d(yp), d, dmin, isum, msum);
        }
        acc - accm
    }
}
