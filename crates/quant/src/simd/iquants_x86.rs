//! x86 AVX2 / AVX-512 dot products for the I-quants with Q8_K activations. Each kernel gives the
//! same bits as the scalar reference in `iquants` (its module doc fixes the order): the i32 lane
//! `l` of a 256-bit register holds elements `4l..4l+3` of one 32-element sub-block, so the
//! `maddubs`/`madd` (AVX2) and `maddubs`/`vpdpwssd` (AVX-512) integer sums land in exactly the
//! reference's 8 lanes; AVX-512 works on two sub-blocks per 512-bit register and folds its two
//! halves (an exact integer add) before the per-block `fmadd` (IQ3_S's AVX-512 kernel stays at
//! 256 bits, see there). Signs are applied to the Q8_K codes with byte arithmetic, exact for
//! codes in −127..=127 (what the Q8_K quantizer emits).
//!
//! The grids are too large for in-register shuffles, so grid entries are loaded one by one;
//! everything else about a block (grid indices, sign bytes, scales) is unpacked for the whole
//! block at once with vector code first, which is what keeps the scalar work per element low.

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
            (IQ2_XXS, Isa::Avx2) => x86::iq2_xxs_avx2,
            (IQ2_XXS, Isa::Avx512) => x86::iq2_xxs_avx512,
            (IQ1_M, Isa::Avx2) => x86::iq1_m_avx2,
            (IQ1_M, Isa::Avx512) => x86::iq1_m_avx512,
            (IQ1_S, Isa::Avx2) => x86::iq1_s_avx2,
            (IQ1_S, Isa::Avx512) => x86::iq1_s_avx512,
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
// Sub-block loops index several tables and buffers by the same counter; iterators would hide it.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use crate::dot::{le_u16, le_u32, reduce8};
    use crate::grids::*;
    use crate::iquants::{Q8K_BYTES, QK_K};

    // -----------------------------------------------------------------------------------------
    // Shuffle controls (`pshufb` works inside each 128-bit lane; 0x80 writes a zero byte).

    const Z: u8 = 0x80;

    /// The byte pair `lo` repeated over the low 128 bits, `hi` over the high 128 bits.
    const fn pairs(lo: [u8; 2], hi: [u8; 2]) -> [u8; 32] {
        let mut c = [0u8; 32];
        let mut i = 0;
        while i < 8 {
            c[2 * i] = lo[0];
            c[2 * i + 1] = lo[1];
            c[16 + 2 * i] = hi[0];
            c[16 + 2 * i + 1] = hi[1];
            i += 1;
        }
        c
    }

    /// Byte pair `p[c]` repeated over 128-bit chunk `c` of a 512-bit register.
    const fn quads(p: [[u8; 2]; 4]) -> [u8; 64] {
        let mut c = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            c[k] = p[k / 16][k % 2];
            k += 1;
        }
        c
    }

    /// Scale bytes `2i` (low half) and `2i+1` (high half) as i16 words.
    static SC_HALVES: [[u8; 32]; 8] = {
        let mut t = [[0u8; 32]; 8];
        let mut i = 0;
        while i < 8 {
            t[i] = pairs([2 * i as u8, Z], [2 * i as u8 + 1, Z]);
            i += 1;
        }
        t
    };

    /// Scale byte `i` as i16 words over both halves.
    static SC_WHOLE: [[u8; 32]; 8] = {
        let mut t = [[0u8; 32]; 8];
        let mut i = 0;
        while i < 8 {
            t[i] = pairs([i as u8, Z], [i as u8, Z]);
            i += 1;
        }
        t
    };

    /// Scale bytes `2p` (low 256 bits) and `2p + 1` (high 256 bits) as i16 words: the scales
    /// of a 512-bit register holding two sub-blocks.
    static SC_WHOLE_PAIRS: [[u8; 64]; 4] = {
        let mut t = [[0u8; 64]; 4];
        let mut p = 0;
        while p < 4 {
            let (lo, hi) = (SC_WHOLE[2 * p], SC_WHOLE[2 * p + 1]);
            let mut i = 0;
            while i < 32 {
                t[p][i] = lo[i];
                t[p][32 + i] = hi[i];
                i += 1;
            }
            p += 1;
        }
        t
    };

    /// i16 words `2j` (low half) and `2j+1` (high half) of a lane holding 8 words.
    static W16_HALVES: [[u8; 32]; 4] = {
        let mut t = [[0u8; 32]; 4];
        let mut j = 0;
        while j < 4 {
            let b = 4 * j as u8;
            t[j] = pairs([b, b + 1], [b + 2, b + 3]);
            j += 1;
        }
        t
    };

    /// The low byte of i32 `j` of a lane as i16 words over both halves.
    static D32_WHOLE: [[u8; 32]; 4] = {
        let mut t = [[0u8; 32]; 4];
        let mut j = 0;
        while j < 4 {
            t[j] = pairs([4 * j as u8, Z], [4 * j as u8, Z]);
            j += 1;
        }
        t
    };

    /// Bytes `4j..4j+4` of a lane, each repeated 8 times: one byte per group of 8 elements.
    static REP8: [[u8; 32]; 4] = {
        let mut t = [[0u8; 32]; 4];
        let mut j = 0;
        while j < 4 {
            let mut k = 0;
            while k < 32 {
                t[j][k] = (4 * j + k / 8) as u8;
                k += 1;
            }
            j += 1;
        }
        t
    };

    /// Byte `2i` over all 32 bytes (the low byte of i16 word `i`).
    static BYTE_WHOLE: [[u8; 32]; 8] = {
        let mut t = [[0u8; 32]; 8];
        let mut i = 0;
        while i < 8 {
            t[i] = pairs([2 * i as u8, 2 * i as u8], [2 * i as u8, 2 * i as u8]);
            i += 1;
        }
        t
    };

    /// AVX-512, two scales per sub-block: chunk `c` of pair `p` takes scale byte `4p + c`.
    static SC4_QUARTERS: [[u8; 64]; 4] = {
        let mut t = [[0u8; 64]; 4];
        let mut p = 0;
        while p < 4 {
            let b = 4 * p as u8;
            t[p] = quads([[b, Z], [b + 1, Z], [b + 2, Z], [b + 3, Z]]);
            p += 1;
        }
        t
    };

    /// AVX-512, i16 scales (8 words per chunk): chunk `c` of group `g` takes word `4g + c`.
    static W16_QUARTERS: [[u8; 64]; 2] = {
        let mut t = [[0u8; 64]; 2];
        let mut g = 0;
        while g < 2 {
            let b = 8 * g as u8;
            t[g] = quads([[b, b + 1], [b + 2, b + 3], [b + 4, b + 5], [b + 6, b + 7]]);
            g += 1;
        }
        t
    };

    /// AVX-512, i16 values per sub-block (8 words per chunk): chunks 0, 1 take word `2p`,
    /// chunks 2, 3 word `2p+1`.
    static W16_PAIRS: [[u8; 64]; 4] = {
        let mut t = [[0u8; 64]; 4];
        let mut p = 0;
        while p < 4 {
            let b = 4 * p as u8;
            t[p] = quads([[b, b + 1], [b, b + 1], [b + 2, b + 3], [b + 2, b + 3]]);
            p += 1;
        }
        t
    };

    /// AVX-512: of a repeated u64, chunk `c` takes byte `2c` for 8 bytes then `2c+1` for 8.
    static REP8_Z: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            t[k] = (2 * (k / 16) + (k % 16) / 8) as u8;
            k += 1;
        }
        t
    };

    /// AVX-512 IQ1_M: `vpermw` indices, chunk `c` of pair `p` takes scale word `4p + c`.
    static IQ1M_PERM: [[u16; 32]; 4] = {
        let mut t = [[0u16; 32]; 4];
        let mut p = 0;
        while p < 4 {
            let mut k = 0;
            while k < 32 {
                t[p][k] = (4 * p + k / 8) as u16;
                k += 1;
            }
            p += 1;
        }
        t
    };

    /// The IQ1 weight table for `pshufb`: index `g & 15` (g in −1, 0, 1) gives `8g + 1`; the
    /// same index xor 4 gives `8g − 1`.
    static IQ1_W: [i8; 16] = [1, 9, 0, 0, -1, 7, 0, 0, 0, 0, 0, -9, 0, 0, 0, -7];

    // -----------------------------------------------------------------------------------------
    // Helpers

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

    /// IEEE half to f32 (exact, as `dot::f16_to_f32`).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn f16(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn ctrl(t: &[u8; 32]) -> __m256i {
        // SAFETY: `t` is 32 readable bytes.
        unsafe { _mm256_loadu_si256(t.as_ptr() as *const __m256i) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn ctrl512(t: &[u8; 64]) -> __m512i {
        // SAFETY: `t` is 64 readable bytes.
        unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load256(b: &[u8], o: usize) -> __m256i {
        let s = &b[o..o + 32];
        // SAFETY: `s` is 32 readable bytes.
        unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load128(b: &[u8], o: usize) -> __m128i {
        let s = &b[o..o + 16];
        // SAFETY: `s` is 16 readable bytes.
        unsafe { _mm_loadu_si128(s.as_ptr() as *const __m128i) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load512(b: &[u8], o: usize) -> __m512i {
        let s = &b[o..o + 64];
        // SAFETY: `s` is 64 readable bytes.
        unsafe { _mm512_loadu_si512(s.as_ptr() as *const __m512i) }
    }

    #[inline]
    fn le_u64(b: &[u8], o: usize) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    }

    /// Store 16 u16 lanes into `out[o..o + 16]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn store_u16(out: &mut [u16], o: usize, v: __m256i) {
        let s = &mut out[o..o + 16];
        // SAFETY: `s` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(s.as_mut_ptr() as *mut __m256i, v) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn store_u8(out: &mut [u8; 32], v: __m256i) {
        // SAFETY: `out` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v) }
    }

    /// Grid entries `t[i[0..4]]` of a u32 grid as one 128-bit vector. Built four at a time so
    /// that few indices are live at once.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn quad32<const N: usize>(t: &[u32; N], i: &[u16]) -> __m128i {
        let g = |k: usize| t[i[k] as usize] as i32;
        _mm_setr_epi32(g(0), g(1), g(2), g(3))
    }

    /// Grid entries `t[i[0..2]]` of a u64 grid as one 128-bit vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pair64<const N: usize>(t: &[u64; N], i: &[u16]) -> __m128i {
        _mm_set_epi64x(t[i[1] as usize] as i64, t[i[0] as usize] as i64)
    }

    /// Eight u32 grid entries (one sub-block of IQ3_S).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn grid8x32<const N: usize>(t: &[u32; N], i: &[u16]) -> __m256i {
        _mm256_setr_m128i(quad32(t, &i[0..4]), quad32(t, &i[4..8]))
    }

    /// Four u64 grid entries (one sub-block of the IQ2/IQ1 types).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn grid4x64<const N: usize>(t: &[u64; N], i: &[u16]) -> __m256i {
        _mm256_setr_m128i(pair64(t, &i[0..2]), pair64(t, &i[2..4]))
    }

    /// Eight u64 grid entries `t[i[o..o + 8]]` (two sub-blocks) by one gather.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn gather8x64<const N: usize>(t: &[u64; N], i: &[u16; 32], o: usize) -> __m512i {
        // SAFETY: `i[o..o + 8]` is 16 readable bytes (o ≤ 24), and every index a caller stores
        // is below N.
        unsafe {
            let v = _mm_loadu_si128(i[o..o + 8].as_ptr() as *const __m128i);
            _mm512_i32gather_epi64::<8>(_mm256_cvtepu16_epi32(v), t.as_ptr() as *const i64)
        }
    }

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
        // SAFETY: `a` is 32 writable bytes.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
        post * reduce8(a)
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

    /// Both 128-bit lanes of `v` set to its low lane, and to its high lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes(v: __m256i) -> (__m256i, __m256i) {
        (
            _mm256_permute2x128_si256(v, v, 0x00),
            _mm256_permute2x128_si256(v, v, 0x11),
        )
    }

    /// Sign masks of sub-block `ib` from 32 sign bytes (byte `4ib + l`: group `l`), given as
    /// the lane pair of [`lanes`]: 0xFF where the element is negative.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sign_mask(halves: (__m256i, __m256i), ib: usize) -> __m256i {
        let h = if ib < 4 { halves.0 } else { halves.1 };
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let rep = _mm256_shuffle_epi8(h, ctrl(&REP8[ib % 4]));
        _mm256_cmpeq_epi8(_mm256_and_si256(rep, sel), sel)
    }

    /// Eight i32 lanes each holding four 7-bit sign codes (bits 0..28) to four sign bytes: the
    /// code and, in bit 7, its parity (ggml's `ksigns_iq2xs`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn ksign_bytes(a: __m256i) -> __m256i {
        let m = |v: i32| _mm256_set1_epi32(v);
        let x = _mm256_or_si256(
            _mm256_or_si256(
                _mm256_and_si256(a, m(0x7f)),
                _mm256_and_si256(_mm256_slli_epi32(a, 1), m(0x7f00)),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_slli_epi32(a, 2), m(0x7f_0000)),
                _mm256_and_si256(_mm256_slli_epi32(a, 3), m(0x7f00_0000)),
            ),
        );
        // Bit 0 of each byte ends up the parity of that byte's bits.
        let p = _mm256_xor_si256(x, _mm256_srli_epi32(x, 4));
        let p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
        let p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
        _mm256_or_si256(x, _mm256_slli_epi32(_mm256_and_si256(p, m(0x0101_0101)), 7))
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

    /// The per-block fold of a 512-bit accumulator: lanes `l` and `l + 8` hold the same
    /// reference lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn fold(a: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
    }

    /// The 512-bit register of sub-blocks `2p`, `2p+1` from two 256-bit halves.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// `q` negated where bit `i` of `m` is set.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn neg_mask(q: __m512i, m: u64) -> __m512i {
        _mm512_mask_sub_epi8(q, m, _mm512_setzero_si512(), q)
    }

    // -----------------------------------------------------------------------------------------
    // IQ4_XS

    /// The 8 sub-block scales `ls − 32` as i16 words, repeated in both 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq4_xs_scales(wb: &[u8]) -> __m128i {
        let shifts4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let shifts2 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
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
        _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq4_xs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
        let kv = _mm256_broadcastsi128_si256(unsafe {
            _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i)
        });
        let m4 = _mm256_set1_epi8(0x0f);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 136, x) {
            let wb = &w[b * 136..(b + 1) * 136];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let ls16 = _mm256_broadcastsi128_si256(iq4_xs_scales(wb));
            // `a` takes elements 0..16 of each sub-block (reference lanes 0..4), sub-block 2p
            // in its low half and 2p+1 in its high half; `c` elements 16..32 (lanes 4..8).
            let mut a = _mm256_setzero_si256();
            let mut c = _mm256_setzero_si256();
            for p in 0..4 {
                let v = load256(wb, 8 + 32 * p);
                let klo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));
                let khi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                let o = 4 + 64 * p;
                let qlo = _mm256_setr_m128i(load128(xb, o), load128(xb, o + 32));
                let qhi = _mm256_setr_m128i(load128(xb, o + 16), load128(xb, o + 48));
                let sc = _mm256_shuffle_epi8(ls16, ctrl(&W16_HALVES[p]));
                let pa = mul_scale(_mm256_abs_epi8(klo), _mm256_sign_epi8(qlo, klo), sc);
                let pc = mul_scale(_mm256_abs_epi8(khi), _mm256_sign_epi8(qhi, khi), sc);
                a = _mm256_add_epi32(a, pa);
                c = _mm256_add_epi32(c, pc);
            }
            let l = _mm256_add_epi32(
                _mm256_permute2x128_si256(a, c, 0x20),
                _mm256_permute2x128_si256(a, c, 0x31),
            );
            acc = fma_block(acc, d, l);
        }
        finish(acc, 1.0)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq4_xs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
        let kv = _mm512_broadcast_i32x4(unsafe {
            _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i)
        });
        let m4 = _mm512_set1_epi8(0x0f);
        // q8 qwords of elements 0..16 (`lo`) and 16..32 (`hi`) of four sub-blocks.
        let pick_lo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
        let pick_hi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 136, x) {
            let wb = &w[b * 136..(b + 1) * 136];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let ls16 = _mm512_broadcast_i32x4(iq4_xs_scales(wb));
            // Chunk c of `a` holds elements 0..16 of sub-block 4g+c, of `c_` elements 16..32.
            let mut a = _mm512_setzero_si512();
            let mut c_ = _mm512_setzero_si512();
            for g in 0..2 {
                let v = load512(wb, 8 + 64 * g);
                let klo = _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
                let khi = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                let qa = load512(xb, 4 + 128 * g);
                let qb = load512(xb, 4 + 128 * g + 64);
                let qlo = _mm512_permutex2var_epi64(qa, pick_lo, qb);
                let qhi = _mm512_permutex2var_epi64(qa, pick_hi, qb);
                let qlo = neg_mask(qlo, _mm512_movepi8_mask(klo));
                let qhi = neg_mask(qhi, _mm512_movepi8_mask(khi));
                let sc = _mm512_shuffle_epi8(ls16, ctrl512(&W16_QUARTERS[g]));
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(_mm512_abs_epi8(klo), qlo), sc);
                c_ = _mm512_dpwssd_epi32(c_, _mm512_maddubs_epi16(_mm512_abs_epi8(khi), qhi), sc);
            }
            // Chunks of `a` are reference lanes 0..4, of `c_` lanes 4..8: fold each to 128 bits.
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

    // -----------------------------------------------------------------------------------------
    // IQ3_S: 9-bit indices (qs byte, one qh bit each), explicit sign bits, one scale per 32.

    /// The 64 grid indices of a block.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq3_s_indices(wb: &[u8], idx: &mut [u16; 64]) {
        let bits = _mm256_setr_epi16(
            1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768,
        );
        let bit8 = _mm256_set1_epi16(256);
        for p in 0..4 {
            let lo = _mm256_cvtepu8_epi16(load128(wb, 2 + 16 * p));
            let h = _mm256_set1_epi16(le_u16(wb, 66 + 2 * p) as i16);
            let hi = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, bits), bits), bit8);
            store_u16(idx, 16 * p, _mm256_or_si256(lo, hi));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq3_s_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 64];
        for b in 0..blocks(n, w, 110, x) {
            let wb = &w[b * 110..(b + 1) * 110];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(le_u32(wb, 106) as u64));
            iq3_s_indices(wb, &mut idx);
            let signs = lanes(load256(wb, 74));
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let grid = grid8x32(&IQ3S_GRID, &idx[8 * ib..8 * ib + 8]);
                let q = neg_where(load256(xb, 4 + 32 * ib), sign_mask(signs, ib));
                let sc = _mm256_shuffle_epi8(sb, ctrl(&SC_WHOLE[ib]));
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 1.0)
    }

    /// Sixteen grid entries (sub-blocks `2p` and `2p + 1`) by one gather: index `j` is
    /// `qs[16p + j]` with bit `j` of the little-endian `qh[2p..2p + 2]` as its ninth bit.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn iq3_s_gather16(wb: &[u8], p: usize) -> __m512i {
        let lo = _mm512_cvtepu8_epi32(load128(wb, 2 + 16 * p));
        let idx = _mm512_mask_or_epi32(lo, le_u16(wb, 66 + 2 * p), lo, _mm512_set1_epi32(0x100));
        // SAFETY: every index is below 512, the grid's length.
        unsafe { _mm512_i32gather_epi32::<4>(idx, IQ3S_GRID.as_ptr() as *const i32) }
    }

    /// Two sub-blocks per 512-bit register: one 16-entry gather, the signs as a mask register,
    /// the scale multiply-add by `vpdpwssd`; the halves fold onto the reference's 8 lanes once
    /// per block (exact integer sums, so the result is the scalar reference's bit for bit).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn iq3_s_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 110, x) {
            let wb = &w[b * 110..(b + 1) * 110];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(le_u32(wb, 106) as u64));
            let mut l = _mm512_setzero_si512();
            for p in 0..4 {
                let grid = iq3_s_gather16(wb, p);
                let q = load512(xb, 4 + 64 * p);
                let q = _mm512_mask_sub_epi8(q, le_u64(wb, 74 + 8 * p), _mm512_setzero_si512(), q);
                let sc = _mm512_shuffle_epi8(sb, ctrl512(&SC_WHOLE_PAIRS[p]));
                l = _mm512_dpwssd_epi32(l, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(l));
        }
        finish(acc, 1.0)
    }

    // -----------------------------------------------------------------------------------------
    // IQ3_XXS and IQ2_XXS: byte indices, 7-bit sign codes and a 4-bit scale in one u32 per 32.

    /// Sign bytes (byte `4ib + l`) and scales `2s+1` (i32 lane `ib`) from the 8 u32 words that
    /// hold four sign codes and a scale each.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn xxs_signs_scales(aux: __m256i) -> (__m256i, __m256i) {
        let s = _mm256_srli_epi32(aux, 28);
        (
            ksign_bytes(aux),
            _mm256_add_epi32(_mm256_add_epi32(s, s), _mm256_set1_epi32(1)),
        )
    }

    /// IQ2_XXS keeps (4 index bytes, sign/scale word) pairs: the 8 sign/scale words.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq2_xxs_aux(wb: &[u8]) -> __m256i {
        let odd = _mm256_setr_epi32(1, 3, 5, 7, 0, 2, 4, 6);
        let t0 = _mm256_permutevar8x32_epi32(load256(wb, 2), odd);
        let t1 = _mm256_permutevar8x32_epi32(load256(wb, 34), odd);
        _mm256_permute2x128_si256(t0, t1, 0x20)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq3_xxs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 98, x) {
            let wb = &w[b * 98..(b + 1) * 98];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (sgn, ls) = xxs_signs_scales(load256(wb, 66));
            let (signs, ls) = (lanes(sgn), lanes(ls));
            let qs = &wb[2..66];
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let g = |k: usize| IQ3XXS_GRID[qs[8 * ib + k] as usize] as i32;
                let grid = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let q = neg_where(load256(xb, 4 + 32 * ib), sign_mask(signs, ib));
                let half = if ib < 4 { ls.0 } else { ls.1 };
                let sc = _mm256_shuffle_epi8(half, ctrl(&D32_WHOLE[ib % 4]));
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.25)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq3_xxs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut sgn = [0u8; 32];
        for b in 0..blocks(n, w, 98, x) {
            let wb = &w[b * 98..(b + 1) * 98];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (s, ls) = xxs_signs_scales(load256(wb, 66));
            store_u8(&mut sgn, s);
            // Every chunk holds the 8 scales as i16 words.
            let ls = _mm512_broadcast_i32x4(_mm_packs_epi32(
                _mm256_castsi256_si128(ls),
                _mm256_extracti128_si256(ls, 1),
            ));
            let qs = &wb[2..66];
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let g = |k: usize| IQ3XXS_GRID[qs[16 * p + k] as usize] as i32;
                let grid = join(
                    _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)),
                    _mm256_setr_epi32(g(8), g(9), g(10), g(11), g(12), g(13), g(14), g(15)),
                );
                let q = neg_mask(load512(xb, 4 + 64 * p), le_u64(&sgn, 8 * p));
                let sc = _mm512_shuffle_epi8(ls, ctrl512(&W16_PAIRS[p]));
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.25)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq2_xxs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks(n, w, 66, x) {
            let wb = &w[b * 66..(b + 1) * 66];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (sgn, ls) = xxs_signs_scales(iq2_xxs_aux(wb));
            let (signs, ls) = (lanes(sgn), lanes(ls));
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let g = |k: usize| IQ2XXS_GRID[wb[2 + 8 * ib + k] as usize] as i64;
                let grid = _mm256_setr_epi64x(g(0), g(1), g(2), g(3));
                let q = neg_where(load256(xb, 4 + 32 * ib), sign_mask(signs, ib));
                let half = if ib < 4 { ls.0 } else { ls.1 };
                let sc = _mm256_shuffle_epi8(half, ctrl(&D32_WHOLE[ib % 4]));
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq2_xxs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut sgn = [0u8; 32];
        for b in 0..blocks(n, w, 66, x) {
            let wb = &w[b * 66..(b + 1) * 66];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (s, ls) = xxs_signs_scales(iq2_xxs_aux(wb));
            store_u8(&mut sgn, s);
            // Every chunk holds the 8 scales as i16 words.
            let ls = _mm512_broadcast_i32x4(_mm_packs_epi32(
                _mm256_castsi256_si128(ls),
                _mm256_extracti128_si256(ls, 1),
            ));
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let g =
                    |k: usize| IQ2XXS_GRID[wb[2 + 16 * p + 8 * (k / 4) + k % 4] as usize] as i64;
                let grid = _mm512_setr_epi64(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
                let q = neg_mask(load512(xb, 4 + 64 * p), le_u64(&sgn, 8 * p));
                let sc = _mm512_shuffle_epi8(ls, ctrl512(&W16_PAIRS[p]));
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    // -----------------------------------------------------------------------------------------
    // IQ2_XS: u16 per 8 elements (9-bit index, 7-bit sign code); IQ2_S: 10-bit indices and
    // explicit sign bytes. Both have one scale nibble per 16 elements.

    /// IQ2_XS grid indices (into `idx`) and sign bytes (byte `k`: group `k`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq2_xs_prep(wb: &[u8], idx: &mut [u16; 32]) -> __m256i {
        let v0 = load256(wb, 2);
        let v1 = load256(wb, 34);
        let m511 = _mm256_set1_epi16(511);
        store_u16(idx, 0, _mm256_and_si256(v0, m511));
        store_u16(idx, 16, _mm256_and_si256(v1, m511));
        let signs = |v: __m256i| {
            let c = _mm256_srli_epi16(v, 9);
            let p = _mm256_xor_si256(c, _mm256_srli_epi16(c, 4));
            let p = _mm256_xor_si256(p, _mm256_srli_epi16(p, 2));
            let p = _mm256_xor_si256(p, _mm256_srli_epi16(p, 1));
            _mm256_or_si256(
                c,
                _mm256_slli_epi16(_mm256_and_si256(p, _mm256_set1_epi16(1)), 7),
            )
        };
        // packus interleaves 64-bit quarters per lane; put them back in order.
        _mm256_permute4x64_epi64(_mm256_packus_epi16(signs(v0), signs(v1)), 0xd8)
    }

    /// IQ2_S grid indices: the qs byte and 2 bits of the sub-block's qh byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq2_s_indices(wb: &[u8], idx: &mut [u16; 32]) {
        let qh = _mm_cvtsi64_si128(le_u64(wb, 66) as i64);
        let rep0 = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let rep1 = _mm_setr_epi8(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
        // Bits 2l..2l+2 of the qh byte go to bits 8..10 of index l.
        let mask = _mm256_setr_epi16(
            3, 12, 48, 192, 3, 12, 48, 192, 3, 12, 48, 192, 3, 12, 48, 192,
        );
        let mul = _mm256_setr_epi16(
            256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4,
        );
        for (h, rep) in [(0, rep0), (1, rep1)] {
            let hb = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(qh, rep));
            let hi = _mm256_mullo_epi16(_mm256_and_si256(hb, mask), mul);
            let lo = _mm256_cvtepu8_epi16(load128(wb, 2 + 16 * h));
            store_u16(idx, 16 * h, _mm256_or_si256(lo, hi));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq2_xs_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 74, x) {
            let wb = &w[b * 74..(b + 1) * 74];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(le_u64(wb, 66)));
            let signs = lanes(iq2_xs_prep(wb, &mut idx));
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let grid = grid4x64(&IQ2XS_GRID, &idx[4 * ib..4 * ib + 4]);
                let q = neg_where(load256(xb, 4 + 32 * ib), sign_mask(signs, ib));
                let sc = _mm256_shuffle_epi8(sb, ctrl(&SC_HALVES[ib]));
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq2_xs_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        let mut sgn = [0u8; 32];
        for b in 0..blocks(n, w, 74, x) {
            let wb = &w[b * 74..(b + 1) * 74];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(le_u64(wb, 66)));
            store_u8(&mut sgn, iq2_xs_prep(wb, &mut idx));
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let grid = gather8x64(&IQ2XS_GRID, &idx, 8 * p);
                let q = neg_mask(load512(xb, 4 + 64 * p), le_u64(&sgn, 8 * p));
                let sc = _mm512_shuffle_epi8(sb, ctrl512(&SC4_QUARTERS[p]));
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq2_s_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 82, x) {
            let wb = &w[b * 82..(b + 1) * 82];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm256_broadcastsi128_si256(odd_nibbles16(le_u64(wb, 74)));
            iq2_s_indices(wb, &mut idx);
            let signs = lanes(load256(wb, 34));
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let grid = grid4x64(&IQ2S_GRID, &idx[4 * ib..4 * ib + 4]);
                let q = neg_where(load256(xb, 4 + 32 * ib), sign_mask(signs, ib));
                let sc = _mm256_shuffle_epi8(sb, ctrl(&SC_HALVES[ib]));
                l = _mm256_add_epi32(l, mul_scale(grid, q, sc));
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq2_s_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 82, x) {
            let wb = &w[b * 82..(b + 1) * 82];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let sb = _mm512_broadcast_i32x4(odd_nibbles16(le_u64(wb, 74)));
            iq2_s_indices(wb, &mut idx);
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let grid = join(
                    grid4x64(&IQ2S_GRID, &idx[8 * p..8 * p + 4]),
                    grid4x64(&IQ2S_GRID, &idx[8 * p + 4..8 * p + 8]),
                );
                let q = neg_mask(load512(xb, 4 + 64 * p), le_u64(wb, 34 + 8 * p));
                let sc = _mm512_shuffle_epi8(sb, ctrl512(&SC4_QUARTERS[p]));
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(grid, q), sc);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    // -----------------------------------------------------------------------------------------
    // IQ1_M and IQ1_S: 11-bit indices into a grid of −1/0/+1, weights `8g ± 1`.

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

    /// IQ1_M grid indices (into `idx`) and the per-group delta flags: byte `k` is 4 where group
    /// `k`'s delta is negative, else 0 (the xor that turns `8g+1` into `8g-1` in [`IQ1_W`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq1_m_prep(wb: &[u8], idx: &mut [u16; 32]) -> __m256i {
        let qh = load128(wb, 32);
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(qh, m);
        let hi = _mm_and_si128(_mm_srli_epi16(qh, 4), m);
        // Nibble k of qh (low nibble first) belongs to group k.
        let nib = _mm256_setr_m128i(_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
        let top = _mm256_and_si256(nib, _mm256_set1_epi8(7));
        for h in 0..2 {
            let t = if h == 0 {
                _mm256_castsi256_si128(top)
            } else {
                _mm256_extracti128_si256(top, 1)
            };
            let v = _mm256_or_si256(
                _mm256_cvtepu8_epi16(load128(wb, 16 * h)),
                _mm256_slli_epi16(_mm256_cvtepu8_epi16(t), 8),
            );
            store_u16(idx, 16 * h, v);
        }
        _mm256_srli_epi16(_mm256_and_si256(nib, _mm256_set1_epi8(8)), 1)
    }

    /// IQ1_M's f16 super-scale, spread over the top nibbles of its four scale words.
    #[inline]
    fn iq1m_d_bits(sc: u64) -> u16 {
        let sw = |k: u32| (sc >> (16 * k)) as u16;
        (sw(0) >> 12) | ((sw(1) >> 8) & 0x00f0) | ((sw(2) >> 4) & 0x0f00) | (sw(3) & 0xf000)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq1_m_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: IQ1_W is 16 readable bytes.
        let tw = _mm256_broadcastsi128_si256(unsafe {
            _mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i)
        });
        let m15 = _mm256_set1_epi8(15);
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 56, x) {
            let wb = &w[b * 56..(b + 1) * 56];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let sc = le_u64(wb, 48);
            let d = f16(iq1m_d_bits(sc)) * q8_d(xb);
            let scales = lanes(iq1m_scales(sc));
            let delta = lanes(iq1_m_prep(wb, &mut idx));
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let grid = grid4x64(&IQ1S_GRID, &idx[4 * ib..4 * ib + 4]);
                let dh = if ib < 4 { delta.0 } else { delta.1 };
                let dx = _mm256_shuffle_epi8(dh, ctrl(&REP8[ib % 4]));
                let wv = _mm256_shuffle_epi8(tw, _mm256_xor_si256(_mm256_and_si256(grid, m15), dx));
                let q = load256(xb, 4 + 32 * ib);
                let sh = if ib < 4 { scales.0 } else { scales.1 };
                let sc16 = _mm256_shuffle_epi8(sh, ctrl(&W16_HALVES[ib % 4]));
                let p = mul_scale(_mm256_abs_epi8(wv), _mm256_sign_epi8(q, wv), sc16);
                l = _mm256_add_epi32(l, p);
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq1_m_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: IQ1_W is 16 readable bytes.
        let tw =
            _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i) });
        let m15 = _mm512_set1_epi8(15);
        let rep = ctrl512(&REP8_Z);
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        let mut dl = [0u8; 32];
        for b in 0..blocks(n, w, 56, x) {
            let wb = &w[b * 56..(b + 1) * 56];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let sc = le_u64(wb, 48);
            let d = f16(iq1m_d_bits(sc)) * q8_d(xb);
            // Scale k at i16 word k.
            let s16 = _mm512_castsi256_si512(iq1m_scales(sc));
            store_u8(&mut dl, iq1_m_prep(wb, &mut idx));
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let grid = join(
                    grid4x64(&IQ1S_GRID, &idx[8 * p..8 * p + 4]),
                    grid4x64(&IQ1S_GRID, &idx[8 * p + 4..8 * p + 8]),
                );
                let dx = _mm512_shuffle_epi8(_mm512_set1_epi64(le_u64(&dl, 8 * p) as i64), rep);
                let wv = _mm512_shuffle_epi8(tw, _mm512_xor_si512(_mm512_and_si512(grid, m15), dx));
                let q = neg_mask(load512(xb, 4 + 64 * p), _mm512_movepi8_mask(wv));
                // SAFETY: IQ1M_PERM[p] is 64 readable bytes.
                let perm = unsafe { _mm512_loadu_si512(IQ1M_PERM[p].as_ptr() as *const __m512i) };
                let sc16 = _mm512_permutexvar_epi16(perm, s16);
                a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(_mm512_abs_epi8(wv), q), sc16);
            }
            acc = fma_block(acc, d, fold(a));
        }
        finish(acc, 0.125)
    }

    /// IQ1_S grid indices (into `idx`), and per sub-block (i16 word `ib`) the scale `2s+1` and
    /// the delta flag (4 when negative).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq1_s_prep(wb: &[u8], idx: &mut [u16; 32]) -> (__m128i, __m128i) {
        let qh = load128(wb, 34);
        // Word k/4 of qh into word k, then its 3-bit field k%4 to the top and down to bit 8.
        let mul = _mm256_setr_epi16(
            8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16,
        );
        let rep0 = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6,
            7, 6, 7,
        );
        let rep1 = _mm256_add_epi8(rep0, _mm256_set1_epi8(8));
        for (h, rep) in [(0, rep0), (1, rep1)] {
            // Words 0..8 of qh in both lanes, so that the high lane reads words 2..4 (or 6..8).
            let words = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(qh), rep);
            let hi = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_mullo_epi16(words, mul), 13), 8);
            let lo = _mm256_cvtepu8_epi16(load128(wb, 2 + 16 * h));
            store_u16(idx, 16 * h, _mm256_or_si256(lo, hi));
        }
        let s = _mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7));
        let ls = _mm_add_epi16(_mm_add_epi16(s, s), _mm_set1_epi16(1));
        let neg = _mm_slli_epi16(_mm_srli_epi16(qh, 15), 2);
        (ls, neg)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn iq1_s_avx2_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: IQ1_W is 16 readable bytes.
        let tw = _mm256_broadcastsi128_si256(unsafe {
            _mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i)
        });
        let m15 = _mm256_set1_epi8(15);
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 50, x) {
            let wb = &w[b * 50..(b + 1) * 50];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (ls, neg) = iq1_s_prep(wb, &mut idx);
            let (ls, neg) = (
                _mm256_broadcastsi128_si256(ls),
                _mm256_broadcastsi128_si256(neg),
            );
            let mut l = _mm256_setzero_si256();
            for ib in 0..8 {
                let grid = grid4x64(&IQ1S_GRID, &idx[4 * ib..4 * ib + 4]);
                let dx = _mm256_shuffle_epi8(neg, ctrl(&BYTE_WHOLE[ib]));
                let wv = _mm256_shuffle_epi8(tw, _mm256_xor_si256(_mm256_and_si256(grid, m15), dx));
                let q = load256(xb, 4 + 32 * ib);
                let sc16 = _mm256_shuffle_epi8(ls, ctrl(&W16_HALVES_SAME[ib]));
                let p = mul_scale(_mm256_abs_epi8(wv), _mm256_sign_epi8(q, wv), sc16);
                l = _mm256_add_epi32(l, p);
            }
            acc = fma_block(acc, d, l);
        }
        finish(acc, 0.125)
    }

    /// i16 word `i` (of 8) over both halves.
    static W16_HALVES_SAME: [[u8; 32]; 8] = {
        let mut t = [[0u8; 32]; 8];
        let mut i = 0;
        while i < 8 {
            let b = 2 * i as u8;
            t[i] = pairs([b, b + 1], [b, b + 1]);
            i += 1;
        }
        t
    };

    /// AVX-512: byte `2(2p + c/2)` (the low byte of i16 word `2p + c/2`) over chunk `c`.
    static BYTE_PAIRS: [[u8; 64]; 4] = {
        let mut t = [[0u8; 64]; 4];
        let mut p = 0;
        while p < 4 {
            let b = 4 * p as u8;
            t[p] = quads([[b, b], [b, b], [b + 2, b + 2], [b + 2, b + 2]]);
            p += 1;
        }
        t
    };

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn iq1_s_avx512_impl(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: IQ1_W is 16 readable bytes.
        let tw =
            _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(IQ1_W.as_ptr() as *const __m128i) });
        let m15 = _mm512_set1_epi8(15);
        let mut acc = _mm256_setzero_ps();
        let mut idx = [0u16; 32];
        for b in 0..blocks(n, w, 50, x) {
            let wb = &w[b * 50..(b + 1) * 50];
            let xb = &x[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
            let d = f16(le_u16(wb, 0)) * q8_d(xb);
            let (ls, neg) = iq1_s_prep(wb, &mut idx);
            let (ls, neg) = (_mm512_broadcast_i32x4(ls), _mm512_broadcast_i32x4(neg));
            let mut a = _mm512_setzero_si512();
            for p in 0..4 {
                let grid = join(
                    grid4x64(&IQ1S_GRID, &idx[8 * p..8 * p + 4]),
                    grid4x64(&IQ1S_GRID, &idx[8 * p + 4..8 * p + 8]),
                );
                let dx = _mm512_shuffle_epi8(neg, ctrl512(&BYTE_PAIRS[p]));
                let wv = _mm512_shuffle_epi8(tw, _mm512_xor_si512(_mm512_and_si512(grid, m15), dx));
                let q = neg_mask(load512(xb, 4 + 64 * p), _mm512_movepi8_mask(wv));
                let sc16 = _mm512_shuffle_epi8(ls, ctrl512(&W16_PAIRS[p]));
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
                // confirmed the CPU features the kernel enables. Its memory accesses are
                // bounds-checked slices (`blocks` never exceeds either slice).
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
    entry!(iq2_xxs_avx2, iq2_xxs_avx2_impl);
    entry!(iq2_xxs_avx512, iq2_xxs_avx512_impl);
    entry!(iq2_xs_avx2, iq2_xs_avx2_impl);
    entry!(iq2_xs_avx512, iq2_xs_avx512_impl);
    entry!(iq2_s_avx2, iq2_s_avx2_impl);
    entry!(iq2_s_avx512, iq2_s_avx512_impl);
    entry!(iq1_m_avx2, iq1_m_avx2_impl);
    entry!(iq1_m_avx512, iq1_m_avx512_impl);
    entry!(iq1_s_avx2, iq1_s_avx2_impl);
    entry!(iq1_s_avx512, iq1_s_avx512_impl);

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn ksign_bytes_match_table() {
            if !crate::simd::supported(crate::Isa::Avx2) {
                eprintln!("SKIPPED: no AVX2 on this CPU");
                return;
            }
            let code = |c: u32, l: u32| (c + 37 * l) & 127;
            let words: [u32; 8] = std::array::from_fn(|i| i as u32);
            for c in (0..128).step_by(8) {
                let aux: [u32; 8] =
                    words.map(|i| (0..4).fold(0xf000_0000, |a, l| a | code(c + i, l) << (7 * l)));
                let mut got = [0u8; 32];
                // SAFETY: AVX2 is supported (checked above); `aux` is 32 readable bytes.
                unsafe {
                    let v = _mm256_loadu_si256(aux.as_ptr() as *const __m256i);
                    store_u8(&mut got, ksign_bytes(v));
                }
                for i in 0..8 {
                    for l in 0..4 {
                        let want = KSIGNS_IQ2XS[code(c + i as u32, l as u32) as usize];
                        assert_eq!(
                            got[4 * i + l],
                            want,
                            "code {}",
                            code(c + i as u32, l as u32)
                        );
                    }
                }
            }
        }
    }
}
