//! x86 AVX2 / AVX-512 dot products for the K-quant family (weights × Q8_K).
//!
//! Every kernel computes, per super-block, the 8 exact i32 lane sums of the `kquants` module
//! doc (byte products with `maddubs`, sub-block scales with `madd` or VNNI `dpwssd`, mins and
//! code offsets through the Q8_K `bsums`), converts them and folds them into 8 f32 lanes with
//! one fused multiply-add per accumulator, and reduces the lanes with `dot::reduce8`'s tree at
//! the end: the scalar reference's operations, so the results are bitwise equal to it.
//!
//! Lane placement comes for free: a 256-bit `maddubs` + `madd` over 32 consecutive elements
//! leaves elements `4l..4l+4` in i32 lane `l`; a 512-bit one over 64 consecutive elements
//! leaves them in lanes `l` and `l + 8`, which one exact add folds together. The 512-bit
//! kernels therefore always feed 64 consecutive activations per vector.

use crate::{DotFn, GgmlType, Isa};

/// Every kernel for `ty` on `isa` that this CPU can run, named, the one `dot` hands out
/// first; for tests and benchmarks that hold each variant to the scalar reference.
pub fn variants(ty: GgmlType, isa: Isa) -> Vec<(&'static str, DotFn)> {
    #[cfg(target_arch = "x86_64")]
    {
        if !super::supported(isa) {
            return Vec::new();
        }
        x86::variants(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        Vec::new()
    }
}

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
        Q2K_BYTES, Q3K_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, Q8K_BSUMS, Q8K_BYTES, Q8K_QS,
    };
    use crate::{DotFn, GgmlType, Isa};

    /// Every kernel of the family for `ty` on `isa`, named, preferred first. On AVX-512 a
    /// kernel is either 512-bit (`zmm`: VNNI `dpwssd`, 64 elements per vector) or the 256-bit
    /// code compiled with the AVX-512 features (`ymm`: 32 registers, EVEX encodings). On the
    /// Zen 4 this was tuned on, which runs 512-bit operations as two halves, `ymm` is 4-15%
    /// faster for Q2_K..Q5_K and `zmm` 4% faster for Q6_K; CPUs with full-width 512-bit units
    /// may prefer `zmm` throughout.
    pub(super) fn variants(ty: GgmlType, isa: Isa) -> Vec<(&'static str, DotFn)> {
        use GgmlType::*;
        let v: &[(&'static str, DotFn)] = match (ty, isa) {
            (Q2_K, Isa::Avx2) => &[("ymm", q2k_avx2)],
            (Q3_K, Isa::Avx2) => &[("ymm", q3k_avx2)],
            (Q4_K, Isa::Avx2) => &[("ymm", q4k_avx2)],
            (Q5_K, Isa::Avx2) => &[("ymm", q5k_avx2)],
            (Q6_K, Isa::Avx2) => &[("ymm", q6k_avx2)],
            (Q2_K, Isa::Avx512) => &[("ymm", q2k_ymm512), ("zmm", q2k_avx512)],
            (Q3_K, Isa::Avx512) => &[("ymm", q3k_ymm512), ("zmm", q3k_avx512)],
            (Q4_K, Isa::Avx512) => &[("ymm", q4k_ymm512), ("zmm", q4k_avx512)],
            (Q5_K, Isa::Avx512) => &[("ymm", q5k_ymm512), ("zmm", q5k_avx512)],
            (Q6_K, Isa::Avx512) => &[("zmm", q6k_avx512), ("ymm", q6k_ymm512)],
            _ => &[],
        };
        v.to_vec()
    }

    pub(super) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
        variants(ty, isa).first().map(|v| v.1)
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
    entry!(q2k_avx2, q2k_avx2_impl);
    entry!(q3k_avx2, q3k_avx2_impl);
    entry!(q4k_avx2, q4k_avx2_impl);
    entry!(q5k_avx2, q5k_avx2_impl);
    entry!(q6k_avx2, q6k_avx2_impl);
    entry!(q2k_avx512, q2k_avx512_impl);
    entry!(q3k_avx512, q3k_avx512_impl);
    entry!(q4k_avx512, q4k_avx512_impl);
    entry!(q5k_avx512, q5k_avx512_impl);
    entry!(q6k_avx512, q6k_avx512_impl);
    entry!(q2k_ymm512, q2k_ymm512_impl);
    entry!(q3k_ymm512, q3k_ymm512_impl);
    entry!(q4k_ymm512, q4k_ymm512_impl);
    entry!(q5k_ymm512, q5k_ymm512_impl);
    entry!(q6k_ymm512, q6k_ymm512_impl);

    // =========================================================================================
    // Float tail (shared by every kernel)

    /// `D = x.d * w.d` and `Dm = x.d * w.dmin` in all 8 lanes; `dm` points at the weight
    /// block's two adjacent f16 scales, `y` at the Q8_K block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales2(y: *const u8, dm: *const u8) -> (__m256, __m256) {
        let dx = _mm_set1_ps((y as *const f32).read_unaligned());
        let w = _mm_cvtph_ps(_mm_cvtsi32_si128((dm as *const i32).read_unaligned()));
        let p = _mm_mul_ps(dx, w);
        (
            _mm256_broadcastss_ps(p),
            _mm256_broadcastss_ps(_mm_movehdup_ps(p)),
        )
    }

    /// `D = x.d * w.d` in all 8 lanes; `d` points at the weight block's f16 scale.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale1(y: *const u8, d: *const u8) -> __m256 {
        let dx = _mm256_set1_ps((y as *const f32).read_unaligned());
        let w = _mm256_cvtph_ps(_mm_set1_epi16((d as *const u16).read_unaligned() as i16));
        _mm256_mul_ps(dx, w)
    }

    /// `acc[l] = D·I[l] + acc[l]`, fused.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fold(acc: __m256, d: __m256, lanes: __m256i) -> __m256 {
        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc)
    }

    /// `dot::reduce8`: (l + l+4), then (l + l+2), then (0 + 1).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn reduce8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
    }

    // =========================================================================================
    // Scale helpers

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

    /// A `shuffle_epi8` control word that copies i16 lane `k` of a 128-bit lane everywhere.
    #[inline(always)]
    fn bcast16(k: i32) -> i16 {
        (((2 * k + 1) << 8) | (2 * k)) as i16
    }

    /// 256-bit controls that put i16 `k` of a 128-bit lane in all of its lanes, k = 0..8.
    /// Opaque, so each use stays one `vpshufb` with a memory operand: LLVM otherwise rewrites
    /// a known control into two or three cheaper-looking shuffles.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bcast_ctl() -> [__m256i; 8] {
        let c = |k: i32| _mm256_set1_epi16(bcast16(k));
        std::hint::black_box([c(0), c(1), c(2), c(3), c(4), c(5), c(6), c(7)])
    }

    /// 128-bit controls: control `p` copies byte `2p` into bytes 0..8 and byte `2p + 1` into
    /// bytes 8..16, so that widening the result gives the i16 scales of sub-blocks `2p`
    /// (lower 128 bits) and `2p + 1` (upper). Opaque, as in [`bcast_ctl`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair_ctl() -> [__m128i; 8] {
        let c = |p: i8| {
            let (a, b) = (2 * p, 2 * p + 1);
            _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        std::hint::black_box([c(0), c(1), c(2), c(3), c(4), c(5), c(6), c(7)])
    }

    /// The i16 scales of 16-element sub-blocks `2p` and `2p + 1`, from 16 i8 scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair_scales(sc8: __m128i, ctl: __m128i) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, ctl))
    }

    /// Moves bit `from` of every byte of `v` to bit `to` (the other bits: garbage to mask).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn move_bit(v: __m256i, from: i32, to: i32) -> __m256i {
        if from <= to {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from))
        } else {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
        }
    }

    /// Q4_K/Q5_K mins lanes: `M[l] = m_l·(bs[2l] + bs[2l+1])`, `m` one byte per sub-block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mins_k4(m: u64, y: *const u8) -> __m256i {
        let m8 = _mm_cvtsi64_si128(m as i64);
        let mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        let bs = _mm256_loadu_si256(y.add(Q8K_BSUMS) as *const __m256i);
        _mm256_madd_epi16(bs, mdup)
    }

    /// `sc_2l·bs[2l] + sc_2l+1·bs[2l+1]` per lane, from 16 i8 scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scaled_bsums(sc8: __m128i, y: *const u8) -> __m256i {
        let bs = _mm256_loadu_si256(y.add(Q8K_BSUMS) as *const __m256i);
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), bs)
    }

    /// Defines a 256-bit kernel twice: for AVX2, and with the AVX-512 features, where the
    /// same code gets 32 vector registers and EVEX encodings.
    macro_rules! twice {
        ($avx2:ident, $avx512:ident, |$w:ident, $x:ident| $body:block) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $avx2($w: &[u8], $x: &[u8]) -> f32 $body

            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
            unsafe fn $avx512($w: &[u8], $x: &[u8]) -> f32 $body
        };
    }

    // =========================================================================================
    // AVX2 kernels (256-bit)

    twice!(q2k_avx2_impl, q2k_ymm512_impl, |w, x| {
        let m3 = _mm256_set1_epi8(3);
        let pc = pair_ctl();
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let raw = _mm_loadu_si128(bp as *const __m128i);
            let sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            let mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let q2 = _mm256_loadu_si256(bp.add(16 + 32 * n) as *const __m256i);
                for j in 0..4 {
                    let q = _mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32));
                    let q = _mm256_and_si256(q, m3);
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * j) as *const __m256i);
                    let scv = pair_scales(sc8, pc[4 * n + j]);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scv);
                    sumi = _mm256_add_epi32(sumi, p);
                }
            }
            let (d, dm) = scales2(yp, bp.add(80));
            acc = fold(acc, d, sumi);
            accm = fold(accm, dm, scaled_bsums(mn8, yp));
        }
        reduce8(acc) - reduce8(accm)
    });

    twice!(q3k_avx2_impl, q3k_ymm512_impl, |w, x| {
        let m3 = _mm256_set1_epi8(3);
        let m04 = _mm256_set1_epi8(4);
        let pc = pair_ctl();
        let mut acc = _mm256_setzero_ps();
        for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = q3k_scales(bp.add(96));
            let hm = _mm256_loadu_si256(bp as *const __m256i);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let q2 = _mm256_loadu_si256(bp.add(32 + 32 * n) as *const __m256i);
                for j in 0..4 {
                    let lo = _mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32));
                    let lo = _mm256_and_si256(lo, m3);
                    let hi = _mm256_and_si256(move_bit(hm, (4 * n + j) as i32, 2), m04);
                    let q = _mm256_or_si256(lo, hi);
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * j) as *const __m256i);
                    let scv = pair_scales(sc8, pc[4 * n + j]);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scv);
                    sumi = _mm256_add_epi32(sumi, p);
                }
            }
            let lanes = _mm256_sub_epi32(sumi, _mm256_slli_epi32(scaled_bsums(sc8, yp), 2));
            acc = fold(acc, scale1(yp, bp.add(108)), lanes);
        }
        reduce8(acc)
    });

    twice!(q4k_avx2_impl, q4k_ymm512_impl, |w, x| {
        let m4 = _mm256_set1_epi8(0x0F);
        let bc = bcast_ctl();
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let qs = bp.add(16);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let xlo = _mm256_loadu_si256(qx.add(64 * c) as *const __m256i);
                let xhi = _mm256_loadu_si256(qx.add(64 * c + 32) as *const __m256i);
                let slo = _mm256_shuffle_epi8(scv, bc[2 * c]);
                let shi = _mm256_shuffle_epi8(scv, bc[2 * c + 1]);
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), slo);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), shi);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
            }
            let (d, dm) = scales2(yp, bp);
            acc = fold(acc, d, sumi);
            accm = fold(accm, dm, mins_k4(mn, yp));
        }
        reduce8(acc) - reduce8(accm)
    });

    twice!(q5k_avx2_impl, q5k_ymm512_impl, |w, x| {
        let m4 = _mm256_set1_epi8(0x0F);
        let m10 = _mm256_set1_epi8(0x10);
        let bc = bcast_ctl();
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q5K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
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
                let slo = _mm256_shuffle_epi8(scv, bc[2 * c]);
                let shi = _mm256_shuffle_epi8(scv, bc[2 * c + 1]);
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), slo);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), shi);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
            }
            let (d, dm) = scales2(yp, bp);
            acc = fold(acc, d, sumi);
            accm = fold(accm, dm, mins_k4(mn, yp));
        }
        reduce8(acc) - reduce8(accm)
    });

    twice!(q6k_avx2_impl, q6k_ymm512_impl, |w, x| {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let pc = pair_ctl();
        let mut acc = _mm256_setzero_ps();
        for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = _mm_loadu_si128(bp.add(192) as *const __m128i);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm256_setzero_si256();
            for n in 0..2 {
                let ql0 = _mm256_loadu_si256(bp.add(64 * n) as *const __m256i);
                let ql1 = _mm256_loadu_si256(bp.add(64 * n + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(bp.add(128 + 32 * n) as *const __m256i);
                // Quarter k: low nibbles of ql0/ql1 (k = 0, 1) or high (k = 2, 3), with bits
                // 2k, 2k+1 of qh moved to bits 4, 5.
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
                    let scv = pair_scales(sc8, pc[4 * n + k]);
                    let xv = _mm256_loadu_si256(qx.add(128 * n + 32 * k) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qk, xv), scv);
                    sumi = _mm256_add_epi32(sumi, p);
                }
            }
            let lanes = _mm256_sub_epi32(sumi, _mm256_slli_epi32(scaled_bsums(sc8, yp), 5));
            acc = fold(acc, scale1(yp, bp.add(208)), lanes);
        }
        reduce8(acc)
    });

    // =========================================================================================
    // AVX-512 kernels (512-bit integer work, VNNI `dpwssd`; the float tail stays 256-bit)

    /// Sums i32 lanes `l` and `l + 8` (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn fold512(a: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
    }

    /// `permutexvar_epi16` controls: 128-bit lane L of control k selects i16 `4k + L`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn quad_idx(k: i32) -> __m512i {
        let v = |l: i32| (4 * k + l) | (4 * k + l) << 16;
        let (a, b, c, d) = (v(0), v(1), v(2), v(3));
        _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
    }

    /// `shuffle_epi8` controls for Q4_K/Q5_K: 128-bit lanes 0, 1 take i16 `2c`, lanes 2, 3
    /// i16 `2c + 1` (the scales of the two 32-element sub-blocks of 64 elements).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn k4_ctl() -> [__m512i; 4] {
        let c = |c: i32| {
            let a = bcast16(2 * c) as u16 as i32;
            let b = bcast16(2 * c + 1) as u16 as i32;
            let (a, b) = (a | a << 16, b | b << 16);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        };
        [c(0), c(1), c(2), c(3)]
    }

    /// A 512-bit vector of i16 `lo` in the lower 256 bits and `hi` in the upper.
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

    /// The 32 bytes at `p` in both halves of a 512-bit vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn bcast256(p: *const u8) -> __m512i {
        _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q2k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm512_set1_epi8(3);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        // 64 elements = the 2-bit planes j = 2h (lower half) and 2h + 1 (upper half).
        let shr = [halves16(0, 2), halves16(4, 6)];
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let raw = _mm_loadu_si128(bp as *const __m128i);
            let sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            let mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
            let scz = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sc8));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let q2 = bcast256(bp.add(16 + 32 * n));
                for h in 0..2 {
                    let q = _mm512_and_si512(_mm512_srlv_epi16(q2, shr[h]), m3);
                    let xv = _mm512_loadu_si512(qx.add(128 * n + 64 * h) as *const _);
                    let scv = _mm512_permutexvar_epi16(idx[2 * n + h], scz);
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q, xv), scv);
                }
            }
            let (d, dm) = scales2(yp, bp.add(80));
            acc = fold(acc, d, fold512(sumi));
            accm = fold(accm, dm, scaled_bsums(mn8, yp));
        }
        reduce8(acc) - reduce8(accm)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q3k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m3 = _mm512_set1_epi8(3);
        let m04 = _mm512_set1_epi8(4);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        let shr = [halves16(0, 2), halves16(4, 6)];
        // The hmask bit 4n + j of the element range (n, j), j = 2h and 2h + 1.
        let hbit = [
            [halves8(1, 2), halves8(4, 8)],
            [halves8(16, 32), halves8(64, 128)],
        ];
        let mut acc = _mm256_setzero_ps();
        for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = q3k_scales(bp.add(96));
            let scz = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
            let hm = bcast256(bp);
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let q2 = bcast256(bp.add(32 + 32 * n));
                for h in 0..2 {
                    let q = _mm512_and_si512(_mm512_srlv_epi16(q2, shr[h]), m3);
                    let k = _mm512_test_epi8_mask(hm, hbit[n][h]);
                    let q = _mm512_mask_add_epi8(q, k, q, m04);
                    let xv = _mm512_loadu_si512(qx.add(128 * n + 64 * h) as *const _);
                    let scv = _mm512_permutexvar_epi16(idx[2 * n + h], scz);
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q, xv), scv);
                }
            }
            let off = _mm256_slli_epi32(scaled_bsums(sc8, yp), 2);
            let lanes = _mm256_sub_epi32(fold512(sumi), off);
            acc = fold(acc, scale1(yp, bp.add(108)), lanes);
        }
        reduce8(acc)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let sh = k4_ctl();
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scz = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for (c, shc) in sh.iter().enumerate() {
                // Both halves hold the same 32 bytes: low nibbles (elements 64c..64c+32)
                // below, high nibbles (64c+32..64c+64) above.
                let q = bcast256(bp.add(16 + 32 * c));
                let q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4), m4);
                let xv = _mm512_loadu_si512(qx.add(64 * c) as *const _);
                let p = _mm512_maddubs_epi16(q, xv);
                sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_shuffle_epi8(scz, *shc));
            }
            let (d, dm) = scales2(yp, bp);
            acc = fold(acc, d, fold512(sumi));
            accm = fold(accm, dm, mins_k4(mn, yp));
        }
        reduce8(acc) - reduce8(accm)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q5k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m10 = _mm512_set1_epi8(0x10);
        let sh = k4_ctl();
        // qh bit 2c for the lower half (low nibbles), 2c + 1 for the upper.
        let hbit = [
            halves8(1, 2),
            halves8(4, 8),
            halves8(16, 32),
            halves8(64, 128),
        ];
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, y) in w.chunks_exact(Q5K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (sc, mn) = unpack_k4(&b[4..16]);
            let scz = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let qh = bcast256(bp.add(16));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for c in 0..4 {
                let q = bcast256(bp.add(48 + 32 * c));
                let q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4), m4);
                let k = _mm512_test_epi8_mask(qh, hbit[c]);
                let q = _mm512_mask_add_epi8(q, k, q, m10);
                let xv = _mm512_loadu_si512(qx.add(64 * c) as *const _);
                let p = _mm512_maddubs_epi16(q, xv);
                sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_shuffle_epi8(scz, sh[c]));
            }
            let (d, dm) = scales2(yp, bp);
            acc = fold(acc, d, fold512(sumi));
            accm = fold(accm, dm, mins_k4(mn, yp));
        }
        reduce8(acc) - reduce8(accm)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q6k_avx512_impl(w: &[u8], x: &[u8]) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        let idx = [quad_idx(0), quad_idx(1), quad_idx(2), quad_idx(3)];
        // Elements 0..32 take qh bits 0,1 (lower half), 32..64 bits 2,3 (upper half) ...
        let shl_a = halves16(4, 2);
        // ... and 64..96 bits 4,5 (lower), 96..128 bits 6,7 (upper).
        let shr_b = halves16(0, 2);
        let mut acc = _mm256_setzero_ps();
        for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let bp = b.as_ptr();
            let yp = y.as_ptr();
            let sc8 = _mm_loadu_si128(bp.add(192) as *const __m128i);
            let scz = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
            let qx = yp.add(Q8K_QS);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                let ql = _mm512_loadu_si512(bp.add(64 * n) as *const _);
                let qh = bcast256(bp.add(128 + 32 * n));
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
            let off = _mm256_slli_epi32(scaled_bsums(sc8, yp), 5);
            let lanes = _mm256_sub_epi32(fold512(sumi), off);
            acc = fold(acc, scale1(yp, bp.add(208)), lanes);
        }
        reduce8(acc)
    }
}
