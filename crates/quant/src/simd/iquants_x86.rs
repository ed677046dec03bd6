//! x86 AVX2 / AVX-512 dot products for the I-quants with Q8_K activations. Each kernel gives the
//! same bits as the scalar reference in `iquants` (its module doc fixes the order): the i32 lane
//! `l` of a 256-bit register holds elements `4l..4l+3` of one 32-element sub-block, so the
//! `maddubs`/`madd` (AVX2) and `maddubs`/`vpdpwssd` (AVX-512) integer sums land in exactly the
//! reference's 8 lanes; AVX-512 works on two sub-blocks per 512-bit register and folds its two
//! halves (an exact integer add) before the per-block `fmadd`. Signs are applied to the Q8_K
//! codes with byte arithmetic, exact for codes in −127..=127 (what the Q8_K quantizer emits).
//! Grid tables are too large for in-register shuffles, so grid entries are loaded one by one.

use crate::{DotFn, GgmlType, Isa};

pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        use GgmlType::*;
        let f: DotFn = match (ty, isa) {
            (IQ4_XS, Isa::Avx2) => x86::iq4_xs_avx2,
            (IQ4_XS, Isa::Avx512) => x86::iq4_xs_avx512,
            (IQ3_S, Isa::Avx2) => x86::iq3_s_avx2,
            (IQ3_S, Isa::Avx512) => x86::iq3_s_avx512,
            (IQ3_XXS, Isa::Avx2) => x86::iq3_xxs_avx2,
            (IQ3_XXS, Isa::Avx512) => x86::iq3_xxs_avx512,
            (IQ2_XS, Isa::Avx2) => x86::iq2_xs_avx2,
            (IQ2_XS, Isa::Avx512) => x86::iq2_xs_avx512,
            (IQ2_S, Isa::Avx2) => x86::iq2_s_avx2,
            (IQ2_S, Isa::Avx512) => x86::iq2_s_avx512,
            (IQ1_M, Isa::Avx2) => x86::iq1_m_avx2,
            (IQ1_M, Isa::Avx512) => x86::iq1_m_avx512,
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
mod x86 {
    use std::arch::x86_64::*;

    use crate::dot::{f16_to_f32, le_u16, le_u32, reduce8};
    use crate::grids::*;
    use crate::iquants::{Q8K_BYTES, QK_K};

    /// Blocks a kernel may touch: never more than either slice holds, so a caller that breaks
    /// the `DotFn` length contract gets a short sum, not an out-of-bounds read.
    #[inline]
    fn blocks(n: usize, w: &[u8], type_size: usize, x: &[u8]) -> usize {
        (n / QK_K).min(w.len() / type_size).min(x.len() / Q8K_BYTES)
    }

    #[inline]
    fn q8_d(xb: &[u8]) -> f32 {
        f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]])
    }

    /// The 8 sign bits of a 7-bit IQ2/IQ3 sign code: bit 7 makes the count of ones even
    /// (ggml's `ksigns_iq2xs`), for four codes packed 7 bits apart.
    #[inline]
    fn ksigns4(a: u32) -> u32 {
        let x =
            (a & 0x7f) | ((a << 1) & 0x7f00) | ((a << 2) & 0x7f_0000) | ((a << 3) & 0x7f00_0000);
        let mut p = x ^ (x >> 4);
        p ^= p >> 2;
        p ^= p >> 1;
        x | ((p & 0x0101_0101) << 7)
    }

    /// The grid index of IQ1_M group `l` (0..4) of a sub-block.
    #[inline]
    fn iq1m_index(qs: &[u8], qh: &[u8], l: usize) -> usize {
        (qs[l] as usize | (((qh[l / 2] as usize) << (8 - 4 * (l % 2))) & 0x700)) & 2047
    }

    // -----------------------------------------------------------------------------------------
    // AVX2

    /// `acc + d · L` lane by lane, as the reference's `d.mul_add(L as f32, acc)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fma_block(acc: __m256, d: f32, l: __m256i) -> __m256 {
        _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn finish(acc: __m256, post: f32) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: `a` is 32 bytes, an unaligned store fits.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
        post * reduce8(a)
    }

    /// 0xFF in byte `i` where bit `i` of `bits` is set.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sign_mask32(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let rep = _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, rep), sel), sel)
    }

    /// `q` negated where `m` is all ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn neg_where(q: __m256i, m: __m256i) -> __m256i {
        _mm256_sub_epi8(_mm256_xor_si256(q, m), m)
    }

    /// Σ pairs of `u·s` (u8 × i8) times the i16 scales `sc`, into 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mul_scale(u: __m256i, s: __m256i, sc: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc)
    }

    /// Scale words for a sub-block: the low 128 bits take byte `lo` of `bytes`, the high 128
    /// bits byte `hi` (both halves of `bytes` hold the same 16 scale bytes, each below 128).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_words(bytes: __m256i, lo: usize, hi: usize) -> __m256i {
        let ctrl = _mm256_setr_m128i(
            _mm_set1_epi16((0x8000 | lo) as u16 as i16),
            _mm_set1_epi16((0x8000 | hi) as u16 as i16),
        );
        _mm256_shuffle_epi8(bytes, ctrl)
    }

    /// 16 scale nibbles (byte `k` holds nibble `k` of the little-endian `u64`), as `2s+1`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn odd_nibbles16(v: u64) -> __m128i {
        let x = _mm_cvtsi64_si128(v as i64);
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(x, m);
        let hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
        let s = _mm_unpacklo_epi8(lo, hi);
        _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_xs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let kv =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let m4 = _mm256_set1_epi8(0x0f);
        let shifts4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let shifts2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 136, x) {
            let wb = &w[b * 136..(b + 1) * 136];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            // Scales: 4 low bits from scales_l, 2 high bits from scales_h, minus 32.
            let lo = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(le_u32(wb, 4) as i32), shifts4),
                _mm256_set1_epi32(15),
            );
            let hi = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(le_u16(wb, 2) as i32), shifts2),
                _mm256_set1_epi32(3),
            );
            let ls = _mm256_sub_epi32(
                _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                _mm256_set1_epi32(32),
            );
            let ls16 = _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
            let ls16 = _mm256_broadcastsi128_si256(ls16);
            let qs = wb.as_ptr().add(8);
            let q8 = xb.as_ptr().add(4);
            // `a` gathers elements 0..16 of each sub-block (reference lanes 0..4) for sub-block
            // 2p in its low half and 2p+1 in its high half; `c` elements 16..32 (lanes 4..8).
            let mut a = _mm256_setzero_si256();
            let mut c = _mm256_setzero_si256();
            for p in 0..4 {
                let v = _mm256_loadu_si256(qs.add(32 * p) as *const __m256i);
                let klo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));
                let khi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                let base = q8.add(64 * p);
                let qlo =
                    _mm256_loadu2_m128i(base.add(32) as *const __m128i, base as *const __m128i);
                let qhi = _mm256_loadu2_m128i(
                    base.add(48) as *const __m128i,
                    base.add(16) as *const __m128i,
                );
                let sc = scale_words_i16(ls16, 2 * p, 2 * p + 1);
                a = _mm256_add_epi32(
                    a,
                    mul_scale(_mm256_abs_epi8(klo), _mm256_sign_epi8(qlo, klo), sc),
                );
                c = _mm256_add_epi32(
                    c,
                    mul_scale(_mm256_abs_epi8(khi), _mm256_sign_epi8(qhi, khi), sc),
                );
            }
            let l = _mm256_add_epi32(
                _mm256_permute2x128_si256(a, c, 0x20),
                _mm256_permute2x128_si256(a, c, 0x31),
            );
            acc = fma_block(acc, d, l);
        }
        finish(acc, 1.0)
    }

    /// As [`scale_words`] for a vector of 8 i16 scales repeated in both halves: words of
    /// scale `lo` in the low 128 bits, of scale `hi` in the high 128 bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_words_i16(ls16: __m256i, lo: usize, hi: usize) -> __m256i {
        let w = |k: usize| (((2 * k + 1) << 8) | (2 * k)) as i16;
        let ctrl = _mm256_setr_m128i(_mm_set1_epi16(w(lo)), _mm_set1_epi16(w(hi)));
        _mm256_shuffle_epi8(ls16, ctrl)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq3_s_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 110, x) {
            let wb = &w[b * 110..(b + 1) * 110];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let (qs, qh, signs) = (&wb[2..66], &wb[66..74], &wb[74..106]);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(le_u32(wb, 106) as u64));
            let q8 = xb.as_ptr().add(4);
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let h = qh[ib] as usize;
                let g = |k: usize| {
                    IQ3S_GRID[(qs[8 * ib + k] as usize | ((h >> k) & 1) << 8) & 511] as i32
                };
                let grid = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let q = _mm256_loadu_si256(q8.add(32 * ib) as *const __m256i);
                let q = neg_where(q, sign_mask32(le_u32(signs, 4 * ib)));
                l = _mm256_add_epi32(l, mul_scale(grid, q, scale_words(sb, ib, ib)));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 1.0)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq3_xxs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 98, x) {
            let wb = &w[b * 98..(b + 1) * 98];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let qs = &wb[2..66];
            let q8 = xb.as_ptr().add(4);
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let aux = le_u32(wb, 66 + 4 * ib);
                let g = |k: usize| IQ3XXS_GRID[qs[8 * ib + k] as usize] as i32;
                let grid = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let q = _mm256_loadu_si256(q8.add(32 * ib) as *const __m256i);
                let q = neg_where(q, sign_mask32(ksigns4(aux)));
                let sc = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.25)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq2_xs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 74, x) {
            let wb = &w[b * 74..(b + 1) * 74];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(u64::from_le_bytes(
                wb[66..74].try_into().unwrap_or([0; 8]),
            )));
            let q8 = xb.as_ptr().add(4);
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let qw = |k: usize| le_u16(wb, 2 + 2 * (4 * ib + k)) as u32;
                let (a0, a1, a2, a3) = (qw(0), qw(1), qw(2), qw(3));
                let g = |a: u32| IQ2XS_GRID[(a & 511) as usize] as i64;
                let grid = _mm256_setr_epi64x(g(a0), g(a1), g(a2), g(a3));
                let codes = (a0 >> 9) | ((a1 >> 9) << 7) | ((a2 >> 9) << 14) | ((a3 >> 9) << 21);
                let q = _mm256_loadu_si256(q8.add(32 * ib) as *const __m256i);
                let q = neg_where(q, sign_mask32(ksigns4(codes)));
                l = _mm256_add_epi32(l, mul_scale(grid, q, scale_words(sb, 2 * ib, 2 * ib + 1)));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq2_s_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 82, x) {
            let wb = &w[b * 82..(b + 1) * 82];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let (qs, signs, qh) = (&wb[2..34], &wb[34..66], &wb[66..74]);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(u64::from_le_bytes(
                wb[74..82].try_into().unwrap_or([0; 8]),
            )));
            let q8 = xb.as_ptr().add(4);
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let h = qh[ib] as usize;
                let g = |k: usize| {
                    IQ2S_GRID[(qs[4 * ib + k] as usize | ((h << (8 - 2 * k)) & 0x300)) & 1023]
                        as i64
                };
                let grid = _mm256_setr_epi64x(g(0), g(1), g(2), g(3));
                let q = _mm256_loadu_si256(q8.add(32 * ib) as *const __m256i);
                let q = neg_where(q, sign_mask32(le_u32(signs, 4 * ib)));
                l = _mm256_add_epi32(l, mul_scale(grid, q, scale_words(sb, 2 * ib, 2 * ib + 1)));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    /// IQ1_M's 16 scales `2s+1` as i16 words: word `k` in the low 128 bits for `k < 8`, in the
    /// high 128 bits (as word `k-8`) otherwise. Scale `k` is bits `3(k%4)..` of scale word `k/4`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq1m_scales(sc: u64) -> __m256i {
        let v = _mm256_set1_epi64x(sc as i64);
        // Word k/4 of the 64 bits into word k: bytes (2(k/4), 2(k/4)+1), per 128-bit half.
        let rep = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6,
            7, 6, 7,
        );
        let words = _mm256_shuffle_epi8(v, rep);
        // Shift field (k%4) to the top 3 bits, then down: a left shift by 13-3j is a multiply.
        let mul = _mm256_setr_epi16(
            8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16,
        );
        let s = _mm256_srli_epi16(_mm256_mullo_epi16(words, mul), 13);
        _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1))
    }

    /// The IQ1 weight table for `pshufb`: index `g & 15` (g in −1, 0, 1) gives `8g + 1`; the
    /// same index xor 4 gives `8g − 1`.
    const IQ1_W: [i8; 16] = [1, 9, 0, 0, -1, 7, 0, 0, 0, 0, 0, -9, 0, 0, 0, -7];

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq1_m_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let tw = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i));
        let m15 = _mm256_set1_epi8(15);
        let four = _mm256_set1_epi8(4);
        let rep = _mm256_setr_epi64x(0, 0, 0x0101_0101_0101_0101, 0x0101_0101_0101_0101);
        let sel = _mm256_setr_epi64x(
            0x0808_0808_0808_0808,
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
            0x8080_8080_8080_8080u64 as i64,
        );
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 56, x) {
            let wb = &w[b * 56..(b + 1) * 56];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let sc = u64::from_le_bytes(wb[48..56].try_into().unwrap_or([0; 8]));
            let sw = |k: u32| (sc >> (16 * k)) as u16;
            let bits = (sw(0) >> 12)
                | ((sw(1) >> 8) & 0x00f0)
                | ((sw(2) >> 4) & 0x0f00)
                | (sw(3) & 0xf000);
            let d = f16_to_f32(bits) * q8_d(xb);
            let scales = iq1m_scales(sc);
            let s_lo = _mm256_permute2x128_si256(scales, scales, 0x00);
            let s_hi = _mm256_permute2x128_si256(scales, scales, 0x11);
            let (qs, qh) = (&wb[0..32], &wb[32..48]);
            let q8 = xb.as_ptr().add(4);
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let (qsb, qhb) = (&qs[4 * ib..4 * ib + 4], &qh[2 * ib..2 * ib + 2]);
                let g = |k: usize| IQ1S_GRID[iq1m_index(qsb, qhb, k)] as i64;
                let grid = _mm256_setr_epi64x(g(0), g(1), g(2), g(3));
                let hv = _mm256_set1_epi16(le_u16(qhb, 0) as i16);
                let dm =
                    _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(hv, rep), sel), sel);
                let idx = _mm256_xor_si256(_mm256_and_si256(grid, m15), _mm256_and_si256(dm, four));
                let wv = _mm256_shuffle_epi8(tw, idx);
                let q = _mm256_loadu_si256(q8.add(32 * ib) as *const __m256i);
                let half = if ib < 4 { s_lo } else { s_hi };
                let sc16 = scale_words_i16(half, 2 * (ib % 4), 2 * (ib % 4) + 1);
                l = _mm256_add_epi32(
                    l,
                    mul_scale(_mm256_abs_epi8(wv), _mm256_sign_epi8(q, wv), sc16),
                );
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    // -----------------------------------------------------------------------------------------
    // AVX-512: two sub-blocks per register; `vpdpwssd` applies the i16 scales and accumulates.

    /// The per-block fold: lanes `l` and `l + 8` hold the same reference lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn fold(a: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
    }

    /// Scale words for a register of two sub-blocks: 128-bit chunk `i` takes byte `ci` of the 16
    /// scale bytes (every chunk of `bytes` holds the same 16 bytes, each below 128).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn scale_words4(bytes: __m512i, c0: usize, c1: usize, c2: usize, c3: usize) -> __m512i {
        let w = |k: usize| (0x8000 | k) as u16 as i16;
        let ctrl = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setr_m128i(
                _mm_set1_epi16(w(c0)),
                _mm_set1_epi16(w(c1)),
            )),
            _mm256_setr_m128i(_mm_set1_epi16(w(c2)), _mm_set1_epi16(w(c3))),
            1,
        );
        _mm512_shuffle_epi8(bytes, ctrl)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq4_xs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let kv = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let m4 = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        let shifts4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let shifts2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        // q8 qwords of elements 0..16 (`lo`) and 16..32 (`hi`) of four sub-blocks.
        let pick_lo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
        let pick_hi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 136, x) {
            let wb = &w[b * 136..(b + 1) * 136];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let lo = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(le_u32(wb, 4) as i32), shifts4),
                _mm256_set1_epi32(15),
            );
            let hi = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(le_u16(wb, 2) as i32), shifts2),
                _mm256_set1_epi32(3),
            );
            let ls = _mm256_sub_epi32(
                _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                _mm256_set1_epi32(32),
            );
            // i16 scale k at word k of every 128-bit chunk.
            let ls16 = _mm512_broadcast_i32x4(_mm_packs_epi32(
                _mm256_castsi256_si128(ls),
                _mm256_extracti128_si256(ls, 1),
            ));
            let qs = wb.as_ptr().add(8);
            let q8 = xb.as_ptr().add(4);
            // Chunk c of `a` holds elements 0..16 of sub-block 4g+c, of `c_` elements 16..32.
            let mut a = _mm512_setzero_si512();
            let mut c_ = _mm512_setzero_si512();
            for g in 0..2 {
                let v = _mm512_loadu_si512(qs.add(64 * g) as *const __m512i);
                let klo = _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
                let khi = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                let qa = _mm512_loadu_si512(q8.add(128 * g) as *const __m512i);
                let qb = _mm512_loadu_si512(q8.add(128 * g + 64) as *const __m512i);
                let qlo = _mm512_permutex2var_epi64(qa, pick_lo, qb);
                let qhi = _mm512_permutex2var_epi64(qa, pick_hi, qb);
                let qlo = _mm512_mask_sub_epi8(qlo, _mm512_movepi8_mask(klo), zero, qlo);
                let qhi = _mm512_mask_sub_epi8(qhi, _mm512_movepi8_mask(khi), zero, qhi);
                let wd = |k: usize| (((2 * k + 1) << 8) | (2 * k)) as i16;
                let k0 = 4 * g;
                let ctrl = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_setr_m128i(
                        _mm_set1_epi16(wd(k0)),
                        _mm_set1_epi16(wd(k0 + 1)),
                    )),
                    _mm256_setr_m128i(_mm_set1_epi16(wd(k0 + 2)), _mm_set1_epi16(wd(k0 + 3))),
                    1,
                );
                let sc = _mm512_shuffle_epi8(ls16, ctrl);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(_mm512_abs_epi8(klo), qlo), sc);
                c_ = _mm512_dpwssd_epi32(c_, _mm512_maddubs_epi16(_mm512_abs_epi8(khi), qhi), sc);
            }
            // Fold the four chunks of each into reference lanes 0..4 and 4..8.
            let a2 = fold(a);
            let c2 = fold(c_);
            let l = _mm256_add_epi32(
                _mm256_permute2x128_si256(a2, c2, 0x20),
                _mm256_permute2x128_si256(a2, c2, 0x31),
            );
            acc = fma_block(acc, d, l);
        }
        finish(acc, 1.0)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq3_s_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let zero = _mm512_setzero_si512();
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 110, x) {
            let wb = &w[b * 110..(b + 1) * 110];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let (qs, qh, signs) = (&wb[2..66], &wb[66..74], &wb[74..106]);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(le_u32(wb, 106) as u64));
            let q8 = xb.as_ptr().add(4);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let h = le_u16(qh, 2 * p) as usize;
                let g = |k: usize| {
                    IQ3S_GRID[(qs[16 * p + k] as usize | ((h >> k) & 1) << 8) & 511] as i32
                };
                let grid = _mm512_setr_epi32(
                    g(0),
                    g(1),
                    g(2),
                    g(3),
                    g(4),
                    g(5),
                    g(6),
                    g(7),
                    g(8),
                    g(9),
                    g(10),
                    g(11),
                    g(12),
                    g(13),
                    g(14),
                    g(15),
                );
                let m = u64::from_le_bytes(signs[8 * p..8 * p + 8].try_into().unwrap_or([0; 8]));
                let q = _mm512_loadu_si512(q8.add(64 * p) as *const __m512i);
                let q = _mm512_mask_sub_epi8(q, m, zero, q);
                let sc = scale_words4(sb, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 1.0)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq3_xxs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let zero = _mm512_setzero_si512();
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 98, x) {
            let wb = &w[b * 98..(b + 1) * 98];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let qs = &wb[2..66];
            let q8 = xb.as_ptr().add(4);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let a0 = le_u32(wb, 66 + 8 * p);
                let a1 = le_u32(wb, 70 + 8 * p);
                let g = |k: usize| IQ3XXS_GRID[qs[16 * p + k] as usize] as i32;
                let grid = _mm512_setr_epi32(
                    g(0),
                    g(1),
                    g(2),
                    g(3),
                    g(4),
                    g(5),
                    g(6),
                    g(7),
                    g(8),
                    g(9),
                    g(10),
                    g(11),
                    g(12),
                    g(13),
                    g(14),
                    g(15),
                );
                let m = ksigns4(a0) as u64 | (ksigns4(a1) as u64) << 32;
                let q = _mm512_loadu_si512(q8.add(64 * p) as *const __m512i);
                let q = _mm512_mask_sub_epi8(q, m, zero, q);
                let sc = _mm512_inserti64x4(
                    _mm512_set1_epi16((2 * (a0 >> 28) + 1) as i16),
                    _mm256_set1_epi16((2 * (a1 >> 28) + 1) as i16),
                    1,
                );
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.25)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq2_xs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let zero = _mm512_setzero_si512();
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 74, x) {
            let wb = &w[b * 74..(b + 1) * 74];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(u64::from_le_bytes(
                wb[66..74].try_into().unwrap_or([0; 8]),
            )));
            let q8 = xb.as_ptr().add(4);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let qw = |k: usize| le_u16(wb, 2 + 2 * (8 * p + k)) as u32;
                let aw: [u32; 8] = std::array::from_fn(qw);
                let g = |k: usize| IQ2XS_GRID[(aw[k] & 511) as usize] as i64;
                let grid = _mm512_setr_epi64(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let codes = |o: usize| {
                    (aw[o] >> 9)
                        | ((aw[o + 1] >> 9) << 7)
                        | ((aw[o + 2] >> 9) << 14)
                        | ((aw[o + 3] >> 9) << 21)
                };
                let m = ksigns4(codes(0)) as u64 | (ksigns4(codes(4)) as u64) << 32;
                let q = _mm512_loadu_si512(q8.add(64 * p) as *const __m512i);
                let q = _mm512_mask_sub_epi8(q, m, zero, q);
                let sc = scale_words4(sb, 4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq2_s_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let zero = _mm512_setzero_si512();
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 82, x) {
            let wb = &w[b * 82..(b + 1) * 82];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16_to_f32(le_u16(wb, 0)) * q8_d(xb);
            let (qs, signs, qh) = (&wb[2..34], &wb[34..66], &wb[66..74]);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(u64::from_le_bytes(
                wb[74..82].try_into().unwrap_or([0; 8]),
            )));
            let q8 = xb.as_ptr().add(4);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let g = |k: usize| {
                    let h = qh[2 * p + k / 4] as usize;
                    IQ2S_GRID[(qs[8 * p + k] as usize | ((h << (8 - 2 * (k % 4))) & 0x300)) & 1023]
                        as i64
                };
                let grid = _mm512_setr_epi64(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let m = u64::from_le_bytes(signs[8 * p..8 * p + 8].try_into().unwrap_or([0; 8]));
                let q = _mm512_loadu_si512(q8.add(64 * p) as *const __m512i);
                let q = _mm512_mask_sub_epi8(q, m, zero, q);
                let sc = scale_words4(sb, 4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq1_m_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let tw = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i));
        let m15 = _mm512_set1_epi8(15);
        let four = _mm512_set1_epi8(4);
        let zero = _mm512_setzero_si512();
        // Chunk c (16 elements, groups 2c and 2c+1) reads qh byte c: bit 3, then bit 7.
        let rep = _mm512_setr_epi64(
            0,
            0,
            0x0101_0101_0101_0101,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
            0x0303_0303_0303_0303,
        );
        let sel = _mm512_broadcast_i32x4(_mm_set_epi64x(
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
        ));
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 56, x) {
            let wb = &w[b * 56..(b + 1) * 56];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let sc = u64::from_le_bytes(wb[48..56].try_into().unwrap_or([0; 8]));
            let sw = |k: u32| (sc >> (16 * k)) as u16;
            let bits = (sw(0) >> 12)
                | ((sw(1) >> 8) & 0x00f0)
                | ((sw(2) >> 4) & 0x0f00)
                | (sw(3) & 0xf000);
            let d = f16_to_f32(bits) * q8_d(xb);
            // Scale k at i16 word k (words past 16 unused).
            let s16 = _mm512_castsi256_si512(iq1m_scales(sc));
            let (qs, qh) = (&wb[0..32], &wb[32..48]);
            let q8 = xb.as_ptr().add(4);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let g = |k: usize| {
                    let sub = 2 * p + k / 4;
                    IQ1S_GRID
                        [iq1m_index(&qs[4 * sub..4 * sub + 4], &qh[2 * sub..2 * sub + 2], k % 4)]
                        as i64
                };
                let grid = _mm512_setr_epi64(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let hv = _mm512_set1_epi32(le_u32(qh, 4 * p) as i32);
                let dm = _mm512_test_epi8_mask(_mm512_shuffle_epi8(hv, rep), sel);
                let idx = _mm512_and_si512(grid, m15);
                let idx = _mm512_xor_si512(idx, _mm512_maskz_mov_epi8(dm, four));
                let wv = _mm512_shuffle_epi8(tw, idx);
                let q = _mm512_loadu_si512(q8.add(64 * p) as *const __m512i);
                let q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(wv), zero, q);
                let k0 = 4 * p;
                let widx = |k: usize| k as i16;
                let perm = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_setr_m128i(
                        _mm_set1_epi16(widx(k0)),
                        _mm_set1_epi16(widx(k0 + 1)),
                    )),
                    _mm256_setr_m128i(_mm_set1_epi16(widx(k0 + 2)), _mm_set1_epi16(widx(k0 + 3))),
                    1,
                );
                let sc16 = _mm512_permutexvar_epi16(perm, s16);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(_mm512_abs_epi8(wv), q), sc16);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    // -----------------------------------------------------------------------------------------
    // Safe entry points: `dot` hands them out only for an ISA that `simd::supported` accepted.

    macro_rules! entry {
        ($name:ident, $imp:ident) => {
            pub(super) fn $name(n: usize, w: &[u8], x: &[u8]) -> f32 {
                // SAFETY: only reachable through `lib::dot_fn`, after `simd::supported(isa)`
                // confirmed the CPU features the kernel enables; the kernel reads only whole
                // blocks that both slices hold (`blocks`).
                unsafe { $imp(n, w, x) }
            }
        };
    }

    entry!(iq4_xs_avx2, iq4_xs_avx2_impl);
    entry!(iq4_xs_avx512, iq4_xs_avx512_impl);
    entry!(iq3_s_avx2, iq3_s_avx2_impl);
    entry!(iq3_s_avx512, iq3_s_avx512_impl);
    entry!(iq3_xxs_avx2, iq3_xxs_avx2_impl);
    entry!(iq3_xxs_avx512, iq3_xxs_avx512_impl);
    entry!(iq2_xs_avx2, iq2_xs_avx2_impl);
    entry!(iq2_xs_avx512, iq2_xs_avx512_impl);
    entry!(iq2_s_avx2, iq2_s_avx2_impl);
    entry!(iq2_s_avx512, iq2_s_avx512_impl);
    entry!(iq1_m_avx2, iq1_m_avx2_impl);
    entry!(iq1_m_avx512, iq1_m_avx512_impl);

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn ksigns4_matches_table() {
            for c in 0..128u32 {
                let packed =
                    c | (((c + 1) & 127) << 7) | (((c + 2) & 127) << 14) | (((c + 3) & 127) << 21);
                let want = (0..4).fold(0u32, |s, l| {
                    s | (KSIGNS_IQ2XS[((c + l) & 127) as usize] as u32) << (8 * l)
                });
                assert_eq!(ksigns4(packed), want, "code {c}");
            }
        }
    }
}
