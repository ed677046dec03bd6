//! x86 AVX2 / AVX-512 dot products for the `legacy` family (Q4_0, Q5_0, Q8_0, IQ4_NL against
//! Q8_0 activations), for one activation row or several against one pass over the weight row.
//! Each reproduces the scalar reference order of `crate::legacy` bit for bit: one block's 32
//! products fold into eight exact i32 lanes of four consecutive elements, blocks are dealt
//! round-robin to four 8-lane f32 accumulators updated by FMA with `d_w * d_x`, and the
//! accumulators are combined as `(a0 + a2) + (a1 + a3)` then halved down to one lane.
//!
//! AVX2 keeps the four accumulators in four ymm registers. AVX-512 puts two blocks in each zmm
//! (blocks 4i, 4i+1 in A; 4i+2, 4i+3 in B), so `A + B` and a 16-lane halving sum give the same
//! tree; its integer part is VNNI `vpdpbusd`, which needs the weight side unsigned, so weight
//! codes are biased (`q`, `q5`, level+128, `w^0x80`) and `bias * Σx` taken back out, exactly.

use crate::{DotFn, GgmlType, Isa};

#[cfg(target_arch = "x86_64")]
pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    use GgmlType::*;
    let f: DotFn = match (ty, isa) {
        (Q4_0, Isa::Avx2) => x86::q4_0_avx2,
        (Q5_0, Isa::Avx2) => x86::q5_0_avx2,
        (Q8_0, Isa::Avx2) => x86::q8_0_avx2,
        (IQ4_NL, Isa::Avx2) => x86::iq4_nl_avx2,
        (Q4_0, Isa::Avx512) => x86::q4_0_avx512,
        (Q5_0, Isa::Avx512) => x86::q5_0_avx512,
        (Q8_0, Isa::Avx512) => x86::q8_0_avx512,
        (IQ4_NL, Isa::Avx512) => x86::iq4_nl_avx512,
        _ => return None,
    };
    Some(f)
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn dot(_ty: GgmlType, _isa: Isa) -> Option<DotFn> {
    None
}

/// One weight row against several activation rows: `out[r] = dot(n, w, xs[r])`.
pub(crate) type RowsFn = fn(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]);

/// The multi-row kernel for `ty` on `isa`, bitwise equal to the single-row one per row. The
/// caller checks `simd::supported(isa)` and the slice sizes.
#[cfg(target_arch = "x86_64")]
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<RowsFn> {
    use GgmlType::*;
    let f: RowsFn = match (ty, isa) {
        (Q4_0, Isa::Avx2) => x86::q4_0_rows_avx2,
        (Q5_0, Isa::Avx2) => x86::q5_0_rows_avx2,
        (Q8_0, Isa::Avx2) => x86::q8_0_rows_avx2,
        (IQ4_NL, Isa::Avx2) => x86::iq4_nl_rows_avx2,
        (Q4_0, Isa::Avx512) => x86::q4_0_rows_avx512,
        (Q5_0, Isa::Avx512) => x86::q5_0_rows_avx512,
        (Q8_0, Isa::Avx512) => x86::q8_0_rows_avx512,
        (IQ4_NL, Isa::Avx512) => x86::iq4_nl_rows_avx512,
        _ => return None,
    };
    Some(f)
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn dot_rows(_ty: GgmlType, _isa: Isa) -> Option<RowsFn> {
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use crate::legacy::IQ4NL_VALUES;

    /// Weight kinds, as const-generic tags so that one driver serves every type.
    const Q4_0: u8 = 0;
    const Q5_0: u8 = 1;
    const Q8_0: u8 = 2;
    const IQ4_NL: u8 = 3;

    /// Bytes per weight block of kind `k`.
    const fn wsize(k: u8) -> usize {
        match k {
            Q4_0 | IQ4_NL => 18,
            Q5_0 => 22,
            _ => 34,
        }
    }

    /// Activation (Q8_0) block size in bytes.
    const XS: usize = 34;

    /// Panics unless `w` and every `x` hold `n / 32` whole blocks and `out` has a slot per
    /// row; the kernels read through raw pointers, so this keeps a wrong-sized call from
    /// reading out of bounds.
    fn check(n: usize, w: &[u8], xs: &[&[u8]], out: &[f32], ws: usize) -> usize {
        let nb = n / 32;
        assert!(
            n.is_multiple_of(32)
                && w.len() >= nb * ws
                && xs.iter().all(|x| x.len() >= nb * XS)
                && out.len() == xs.len(),
            "legacy dot: {n} elements need {} weight and {} activation bytes per row",
            nb * ws,
            nb * XS,
        );
        nb
    }

    /// The f16 at `p` (unaligned).
    #[inline(always)]
    unsafe fn rd16(p: *const u8) -> i16 {
        (p as *const i16).read_unaligned()
    }

    /// Sum of 8 lanes in the order of `dot::reduce8`: (l + l+4), (l + l+2), (0 + 1).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn reduce8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
    }

    /// The four f16 scales of blocks at `p`, `p + stride`, .. as f32. Gathered through a
    /// general register: vector loads that overlap the blocks' data invite LLVM to rebuild the
    /// data loads from shuffles of them, which costs more than it saves.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scales4_gpr(p: *const u8, stride: usize) -> __m128 {
        let h = |i: usize| (p.add(i * stride) as *const u16).read_unaligned() as u64;
        let packed = h(0) | (h(1) << 16) | (h(2) << 32) | (h(3) << 48);
        _mm_cvtph_ps(_mm_cvtsi64_si128(packed as i64))
    }

    /// `f16(w.d) * f16(x.d)` for one block.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scale1(w: *const u8, x: *const u8) -> f32 {
        let wd = _mm_cvtph_ps(_mm_cvtsi32_si128(rd16(w) as u16 as i32));
        let xd = _mm_cvtph_ps(_mm_cvtsi32_si128(rd16(x) as u16 as i32));
        _mm_cvtss_f32(_mm_mul_ss(wd, xd))
    }

    /// 16 packed bytes at `p` as 32 nibbles: element j (low nibble of byte j) in byte j,
    /// element j+16 (high nibble) in byte j+16.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
    }

    /// Q5_0's bit 4 of each code (`qh` bit j for element j) as 0x00 where set and 0xF0 where
    /// clear, so `nibble | this` is the signed code `q - 16`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q5_high(qh: u32) -> __m256i {
        // Byte j takes byte j/8 of qh, then every bit but bit j%8 is forced on: the byte is
        // all ones exactly when bit j of qh is set.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            ),
        );
        let probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64));
        let set = _mm256_cmpeq_epi8(probe, _mm256_set1_epi8(-1));
        _mm256_andnot_si256(set, _mm256_set1_epi8(0xf0_u8 as i8))
    }

    /// The signed weight codes (i8, never -128) of a Q4_0, Q5_0 or IQ4_NL block at `wb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn signed_codes<const K: u8>(wb: *const u8) -> __m256i {
        match K {
            Q4_0 => _mm256_sub_epi8(nibbles(wb.add(2)), _mm256_set1_epi8(8)),
            Q5_0 => {
                let qh = (wb.add(2) as *const u32).read_unaligned();
                _mm256_or_si256(nibbles(wb.add(6)), q5_high(qh))
            }
            _ => {
                let t = _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i);
                _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles(wb.add(2)))
            }
        }
    }

    /// A weight block's codes, unpacked once for every activation row: signed i8 codes (never
    /// -128) in `.0`, or for Q8_0, whose weights can be -128, the two halves widened to i16.
    #[derive(Clone, Copy)]
    struct Codes(__m256i, __m256i);

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn codes_avx2<const K: u8>(wb: *const u8) -> Codes {
        if K == Q8_0 {
            let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(2) as *const __m128i));
            let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(18) as *const __m128i));
            return Codes(w0, w1);
        }
        Codes(signed_codes::<K>(wb), _mm256_setzero_si256())
    }

    /// Eight i32 lane sums of a weight block · activation block `xb` (lane l: elements
    /// 4l..4l+3). `|x|` goes on the unsigned side of `maddubs` and the sign moves to the weight
    /// code, exact for every activation byte (even -128) because those codes are never -128
    /// and pair sums stay below 2^15; Q8_0 multiplies in i16 instead.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn lanes_avx2<const K: u8>(c: Codes, xb: *const u8) -> __m256i {
        if K == Q8_0 {
            let x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xb.add(2) as *const __m128i));
            let x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xb.add(18) as *const __m128i));
            // Pairs (2k, 2k+1); hadd forms quads in the order L0 L1 L4 L5 | L2 L3 L6 L7.
            let h = _mm256_hadd_epi32(_mm256_madd_epi16(c.0, x0), _mm256_madd_epi16(c.1, x1));
            return _mm256_permute4x64_epi64(h, 0b11_01_10_00);
        }
        let xv = _mm256_loadu_si256(xb.add(2) as *const __m256i);
        let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(c.0, xv));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    /// `R` activation rows against one weight row, four blocks per step, AVX2.
    // Rows and block slots index parallel arrays (pointers, accumulators, scales).
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_avx2<const K: u8, const R: usize>(
        nb: usize,
        w: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let ws = wsize(K);
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mut b = 0;
        while b + 4 <= nb {
            let wp = w.add(b * ws);
            let wd = scales4_gpr(wp, ws);
            let c = [
                codes_avx2::<K>(wp),
                codes_avx2::<K>(wp.add(ws)),
                codes_avx2::<K>(wp.add(2 * ws)),
                codes_avx2::<K>(wp.add(3 * ws)),
            ];
            for r in 0..R {
                let xp = xs[r].add(b * XS);
                let d = _mm_mul_ps(wd, scales4_gpr(xp, XS));
                let d = core::mem::transmute::<__m128, [f32; 4]>(d);
                for j in 0..4 {
                    let p = _mm256_cvtepi32_ps(lanes_avx2::<K>(c[j], xp.add(j * XS)));
                    acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), p, acc[r][j]);
                }
            }
            b += 4;
        }
        // The last nb % 4 blocks keep their round-robin slots 0, 1, 2.
        for slot in 0..nb - b {
            let wp = w.add((b + slot) * ws);
            let c = codes_avx2::<K>(wp);
            for r in 0..R {
                let xp = xs[r].add((b + slot) * XS);
                let p = _mm256_cvtepi32_ps(lanes_avx2::<K>(c, xp));
                acc[r][slot] = _mm256_fmadd_ps(_mm256_set1_ps(scale1(wp, xp)), p, acc[r][slot]);
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let [a0, a1, a2, a3] = acc[r];
            out[r] = reduce8(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
        }
        out
    }

    // ---- AVX-512 on whole zmm registers: blocks (4i, 4i+1) share accumulator A, blocks
    // (4i+2, 4i+3) share B, one block per 256-bit half, which is the reference's slot layout.

    /// 32 + 32 activation bytes of two consecutive Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn x_pair(xb: *const u8) -> __m512i {
        let a = _mm256_loadu_si256(xb.add(2) as *const __m256i);
        let b = _mm256_loadu_si256(xb.add(XS + 2) as *const __m256i);
        _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)
    }

    /// Nibbles of two blocks whose 16 packed bytes sit at `p` and `p + stride`: bytes 0..32 are
    /// the first block's elements in order, bytes 32..64 the second's.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn nibbles_pair(p: *const u8, stride: usize) -> __m512i {
        let a = _mm_loadu_si128(p as *const __m128i);
        let b = _mm_loadu_si128(p.add(stride) as *const __m128i);
        // 128-bit lanes [a, a, b, b], then the second copy of each shifted to its high nibbles.
        let dup = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(a), 0xff00, b);
        let sh = _mm512_srlv_epi64(dup, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
        _mm512_and_si512(sh, _mm512_set1_epi8(0x0f))
    }

    /// Unsigned weight codes of two consecutive blocks at `wb` and the bias that makes them
    /// signed (`code - bias`): Q4_0 `q` and 8, Q5_0 `q` and 16, IQ4_NL level + 128 and 128,
    /// Q8_0 `w ^ 0x80` and 128. `vpdpbusd` wants its first factor unsigned.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn codes_pair<const K: u8>(wb: *const u8) -> (__m512i, i8) {
        let ws = wsize(K);
        match K {
            Q4_0 => (nibbles_pair(wb.add(2), ws), 8),
            Q5_0 => {
                let qh0 = (wb.add(2) as *const u32).read_unaligned() as u64;
                let qh1 = (wb.add(ws + 2) as *const u32).read_unaligned() as u64;
                let nib = nibbles_pair(wb.add(6), ws);
                let high = _cvtu64_mask64(qh0 | (qh1 << 32));
                (
                    _mm512_mask_add_epi8(nib, high, nib, _mm512_set1_epi8(16)),
                    16,
                )
            }
            Q8_0 => {
                let a = _mm256_loadu_si256(wb.add(2) as *const __m256i);
                let b = _mm256_loadu_si256(wb.add(ws + 2) as *const __m256i);
                let w = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
                (_mm512_xor_si512(w, _mm512_set1_epi8(0x80_u8 as i8)), -128)
            }
            _ => {
                let t = _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i);
                let t = _mm_xor_si128(t, _mm_set1_epi8(0x80_u8 as i8));
                let table = _mm512_broadcast_i32x4(t);
                (
                    _mm512_shuffle_epi8(table, nibbles_pair(wb.add(2), ws)),
                    -128,
                )
            }
        }
    }

    /// One block's eight lane sums on ymm with VNNI (the AVX-512 kernels' tail): as
    /// [`lanes_avx2`], with `vpdpbusd` summing each quad straight into its i32 lane, and Q8_0
    /// weights biased to `w + 128` with `128 * Σx` taken back out.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn lanes_avx512<const K: u8>(wb: *const u8, xb: *const u8) -> __m256i {
        let xv = _mm256_loadu_si256(xb.add(2) as *const __m256i);
        let zero = _mm256_setzero_si256();
        if K == Q8_0 {
            let wv = _mm256_loadu_si256(wb.add(2) as *const __m256i);
            let bias = _mm256_set1_epi8(0x80_u8 as i8);
            let biased = _mm256_dpbusd_epi32(zero, _mm256_xor_si256(wv, bias), xv);
            return _mm256_sub_epi32(biased, _mm256_dpbusd_epi32(zero, bias, xv));
        }
        let wv = signed_codes::<K>(wb);
        _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv))
    }

    /// 16 exact i32 lane sums of two consecutive blocks: `Σ code*x - bias*Σ x` per quad.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn lanes_pair(u: __m512i, bias: __m512i, xb: *const u8) -> __m512i {
        let x = x_pair(xb);
        let zero = _mm512_setzero_si512();
        let dot = _mm512_dpbusd_epi32(zero, u, x);
        _mm512_sub_epi32(dot, _mm512_dpbusd_epi32(zero, bias, x))
    }

    /// Low (`i == 0`) or high 256-bit half of `v`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn half(v: __m512, i: usize) -> __m256 {
        let v = _mm512_castps_pd(v);
        _mm256_castpd_ps(if i == 0 {
            _mm512_castpd512_pd256(v)
        } else {
            _mm512_extractf64x4_pd(v, 1)
        })
    }

    /// `R` activation rows against one weight row, four blocks per step, AVX-512.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn rows_avx512<const K: u8, const R: usize>(
        nb: usize,
        w: *const u8,
        xs: [*const u8; R],
    ) -> [f32; R] {
        let ws = wsize(K);
        let mut a = [_mm512_setzero_ps(); R];
        let mut bacc = [_mm512_setzero_ps(); R];
        let lo2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let hi2 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        let mut b = 0;
        while b + 4 <= nb {
            let wp = w.add(b * ws);
            let wd = scales4_gpr(wp, ws);
            let (u01, bias) = codes_pair::<K>(wp);
            let (u23, _) = codes_pair::<K>(wp.add(2 * ws));
            let bias = _mm512_set1_epi8(bias);
            for r in 0..R {
                let xp = xs[r].add(b * XS);
                let d = _mm512_castps128_ps512(_mm_mul_ps(wd, scales4_gpr(xp, XS)));
                let p01 = _mm512_cvtepi32_ps(lanes_pair(u01, bias, xp));
                let p23 = _mm512_cvtepi32_ps(lanes_pair(u23, bias, xp.add(2 * XS)));
                a[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo2, d), p01, a[r]);
                bacc[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi2, d), p23, bacc[r]);
            }
            b += 4;
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let mut acc = [
                half(a[r], 0),
                half(a[r], 1),
                half(bacc[r], 0),
                half(bacc[r], 1),
            ];
            // The last nb % 4 blocks keep their round-robin slots 0, 1, 2.
            for (slot, acc) in acc.iter_mut().enumerate().take(nb - b) {
                let wp = w.add((b + slot) * ws);
                let xp = xs[r].add((b + slot) * XS);
                let p = _mm256_cvtepi32_ps(lanes_avx512::<K>(wp, xp));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(scale1(wp, xp)), p, *acc);
            }
            let [a0, a1, a2, a3] = acc;
            out[r] = reduce8(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
        }
        out
    }

    /// Rows in chunks of at most 8, each chunk through the `R`-row kernel of its size.
    macro_rules! rows_dispatch {
        ($kernel:ident, $k:ident, $nb:expr, $w:expr, $xs:expr, $out:expr) => {
            for (xc, oc) in $xs.chunks(8).zip($out.chunks_mut(8)) {
                macro_rules! go {
                    ($r:literal) => {{
                        let p: [*const u8; $r] = core::array::from_fn(|i| xc[i].as_ptr());
                        // SAFETY: handed out only after `simd::supported` confirmed the
                        // kernel's CPU features; `check` proved every slice holds `nb` blocks.
                        oc.copy_from_slice(&unsafe { $kernel::<$k, $r>($nb, $w.as_ptr(), p) });
                    }};
                }
                match xc.len() {
                    1 => go!(1),
                    2 => go!(2),
                    3 => go!(3),
                    4 => go!(4),
                    5 => go!(5),
                    6 => go!(6),
                    7 => go!(7),
                    _ => go!(8),
                }
            }
        };
    }

    macro_rules! wrappers {
        ($($one:ident, $rows:ident = $kernel:ident :: <$k:ident>;)*) => {$(
            pub(crate) fn $one(n: usize, w: &[u8], x: &[u8]) -> f32 {
                let nb = check(n, w, &[x], &[0.0], wsize($k));
                // SAFETY: `dot` hands this out only after `simd::supported` confirmed the CPU
                // features of the kernel, and `check` proved both slices hold `nb` blocks.
                let [d] = unsafe { $kernel::<$k, 1>(nb, w.as_ptr(), [x.as_ptr()]) };
                d
            }

            pub(crate) fn $rows(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]) {
                let nb = check(n, w, xs, out, wsize($k));
                rows_dispatch!($kernel, $k, nb, w, xs, out);
            }
        )*};
    }

    wrappers! {
        q4_0_avx2, q4_0_rows_avx2 = rows_avx2::<Q4_0>;
        q5_0_avx2, q5_0_rows_avx2 = rows_avx2::<Q5_0>;
        q8_0_avx2, q8_0_rows_avx2 = rows_avx2::<Q8_0>;
        iq4_nl_avx2, iq4_nl_rows_avx2 = rows_avx2::<IQ4_NL>;
        q4_0_avx512, q4_0_rows_avx512 = rows_avx512::<Q4_0>;
        q5_0_avx512, q5_0_rows_avx512 = rows_avx512::<Q5_0>;
        q8_0_avx512, q8_0_rows_avx512 = rows_avx512::<Q8_0>;
        iq4_nl_avx512, iq4_nl_rows_avx512 = rows_avx512::<IQ4_NL>;
    }
}
