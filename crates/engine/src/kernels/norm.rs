//! The MTP norm kernels: `rms_xprep` (RMSNorm then the activation image of the next GEMV),
//! `combine_gnorm` (residual `Y_s = h_s + e` fused with the grouped RMSNorm of the next
//! hyper-connection) and `xprep` (activation preparation alone).
//!
//! The sum of squares is reduced in one fixed order, [`reduce_lanes`]: 256 lanes, lane `t`
//! adding `x[t + 256k]²` for k ascending (product rounded, then sum rounded), then each group
//! of 32 lanes halved (16, 8, 4, 2, 1 apart), then the 8 group sums halved (4, 2, 1). That is
//! what a 256-thread CUDA block with warp butterflies computes, so the CUDA kernels give these
//! exact bits. Then `r = 1/sqrt(sum/n + eps)` and `y = (x·r)·w`, where `w` is the norm weight
//! as GGUF stores it (the `1 + w` of the checkpoint already folded).
//!
//! `rms_norm` is the core RMS norm the CPU backend runs (`Backend::rms_norm`, and the GDN
//! output norm): its `baseline` sums the squares sequentially, in element order, which is the
//! order the CPU has always used and the bits every CPU golden holds. The canonical lane order
//! above is its named variant `lanes` (a GPU block's order: other bits, checked within a bound).

use strata_quant::GgmlType;

use super::actq::{self, ActFmt};
use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, invalid, KernelError};

/// Lanes of the canonical reduction (threads of one CUDA block).
pub const LANES: usize = 256;

/// The canonical combination of 256 lane sums (module doc).
pub fn reduce_lanes(l: &[f32; LANES]) -> f32 {
    let mut warp = [0f32; 8];
    for (w, out) in warp.iter_mut().enumerate() {
        let mut v = [0f32; 32];
        v.copy_from_slice(&l[32 * w..32 * w + 32]);
        let mut s = 16;
        while s > 0 {
            for i in 0..s {
                v[i] += v[i + s];
            }
            s /= 2;
        }
        *out = v[0];
    }
    let mut s = 4;
    while s > 0 {
        for i in 0..s {
            warp[i] += warp[i + s];
        }
        s /= 2;
    }
    warp[0]
}

/// Sum of squares of `x` in the canonical order, written plainly.
pub fn sumsq_baseline(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    for (i, &v) in x.iter().enumerate() {
        lanes[i % LANES] += v * v;
    }
    reduce_lanes(&lanes)
}

/// The same sum, 256 elements at a time (vectorizes; same bits).
pub fn sumsq_optimized(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in lanes.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        *a += v * v;
    }
    reduce_lanes(&lanes)
}

/// Sum of squares in element order, one accumulator (the CPU's live order: `rms_norm`'s
/// baseline).
#[inline]
pub fn sumsq_sequential(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum()
}

/// The name of `rms_norm`'s canonical-lane-order variant.
pub const LANES_VARIANT: &str = "lanes";

/// `rms_norm`: one row of `cols` values in groups of `group` (a per-head norm; `group = cols`
/// for a whole-row norm), each group scaled by [`rms_scale`] of its sum of squares, then `× w`
/// (`cols` values, or `group` broadcast over the groups): `y = (x·r)·w`. The caller has checked
/// the shapes (`group` divides `cols`; `w` holds `cols` or `group` values; `out` holds `cols`).
pub type RmsNormFn = fn(row: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]);

#[inline]
fn rms_norm_with(
    sumsq: impl Fn(&[f32]) -> f32,
    row: &[f32],
    w: &[f32],
    group: usize,
    eps: f32,
    out: &mut [f32],
) {
    for (gi, (xs, os)) in row.chunks(group).zip(out.chunks_mut(group)).enumerate() {
        let s = rms_scale(sumsq(xs), xs.len(), eps);
        let ws = if w.len() == group {
            w
        } else {
            &w[gi * group..(gi + 1) * group]
        };
        for ((o, &x), &wv) in os.iter_mut().zip(xs).zip(ws) {
            *o = x * s * wv;
        }
    }
}

/// The sequential order (the CPU's bits). It has no faster form with the same bits (a
/// sequential sum does not vectorize), so `optimized` names this function too.
pub fn rms_norm_baseline(row: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    rms_norm_with(sumsq_sequential, row, w, group, eps, out)
}

/// The canonical lane order ([`sumsq_optimized`]): what a 256-thread GPU block computes.
pub fn rms_norm_lanes(row: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    rms_norm_with(sumsq_optimized, row, w, group, eps, out)
}

pub static RMS_NORM: Op<RmsNormFn> = Op {
    name: "rms_norm",
    variants: &[
        Variant {
            name: BASELINE,
            f: rms_norm_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: rms_norm_baseline,
        },
        Variant {
            name: LANES_VARIANT,
            f: rms_norm_lanes,
        },
    ],
};

/// `1/sqrt(sum/n + eps)`.
#[inline]
pub fn rms_scale(sumsq: f32, n: usize, eps: f32) -> f32 {
    1.0 / (sumsq / n as f32 + eps).sqrt()
}

fn check_fmt(kernel: &'static str, fmt: ActFmt, n: usize) -> Result<usize, KernelError> {
    fmt.row_bytes(n).ok_or_else(|| {
        invalid(
            kernel,
            format!(
                "row length {n} is not a whole number of {} blocks",
                fmt.name()
            ),
        )
    })
}

fn rows_of(kernel: &'static str, len: usize, n: usize) -> Result<usize, KernelError> {
    if n == 0 || !len.is_multiple_of(n) {
        return Err(invalid(
            kernel,
            format!("input of {len} values is not whole rows of {n}"),
        ));
    }
    Ok(len / n)
}

/// `rms_xprep`: each row of `x` (`nt` rows of `n`) normalized with `w` (`n` values) and written
/// to `out` as its activation image in `fmt` (`nt · row_bytes(n)` bytes). The report's `xp_n`
/// view (rows of 2560 for the shared `fc_hidden`) is the same bytes, since 2560 is a whole
/// number of blocks of every format.
pub type RmsXprepFn = fn(
    x: &[f32],
    w: &[f32],
    n: usize,
    eps: f32,
    fmt: ActFmt,
    out: &mut [u8],
) -> Result<(), KernelError>;

fn rms_xprep_check(
    x: &[f32],
    w: &[f32],
    n: usize,
    fmt: ActFmt,
    out: &[u8],
) -> Result<(usize, usize), KernelError> {
    let nt = rows_of("rms_xprep", x.len(), n)?;
    check_len("rms_xprep", "weight", w.len(), n)?;
    let rb = check_fmt("rms_xprep", fmt, n)?;
    check_len("rms_xprep", "output bytes", out.len(), nt * rb)?;
    Ok((nt, rb))
}

pub fn rms_xprep_baseline(
    x: &[f32],
    w: &[f32],
    n: usize,
    eps: f32,
    fmt: ActFmt,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (_, rb) = rms_xprep_check(x, w, n, fmt, out)?;
    let mut y = vec![0f32; n];
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(rb)) {
        let r = rms_scale(sumsq_baseline(xr), n, eps);
        for i in 0..n {
            y[i] = (xr[i] * r) * w[i];
        }
        strata_quant::quantize(fmt.ggml_type(), &y, o).map_err(|source| KernelError::Quant {
            kernel: "rms_xprep",
            source,
        })?;
    }
    Ok(())
}

/// Normalizes and quantizes one block at a time from a stack buffer.
pub fn rms_xprep_optimized(
    x: &[f32],
    w: &[f32],
    n: usize,
    eps: f32,
    fmt: ActFmt,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (_, rb) = rms_xprep_check(x, w, n, fmt, out)?;
    let bs = fmt.block();
    let bb = fmt.row_bytes(bs).unwrap_or(0);
    let mut buf = [0f32; 256];
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(rb)) {
        let r = rms_scale(sumsq_optimized(xr), n, eps);
        // Whole 256-element stretches for the element formats, one block otherwise.
        let step = if bs == 1 { 256.min(n) } else { bs };
        let ob = if bs == 1 { bb * step } else { bb };
        let mut i = 0;
        for oc in o.chunks_mut(ob) {
            let len = step.min(n - i);
            for j in 0..len {
                buf[j] = (xr[i + j] * r) * w[i + j];
            }
            actq::quantize_row(fmt, &buf[..len], oc);
            i += len;
        }
    }
    Ok(())
}

pub static RMS_XPREP: Op<RmsXprepFn> = Op {
    name: "rms_xprep",
    variants: &[
        Variant {
            name: BASELINE,
            f: rms_xprep_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: rms_xprep_optimized,
        },
    ],
};

/// `combine_gnorm`: per token, `r_s = h_s + e` for each of `streams` streams (the residual
/// `Y_s = fc_hidden·hn_s + e`), and `o = RMSg(r; w)`, each stream normalized on its own.
/// `h`, `r`, `o`: `nt · streams · n`; `e`: `nt · n`; `w`: `streams · n`.
pub type CombineGnormFn = fn(
    h: &[f32],
    e: &[f32],
    w: &[f32],
    n: usize,
    streams: usize,
    eps: f32,
    r: &mut [f32],
    o: &mut [f32],
) -> Result<(), KernelError>;

fn combine_check(
    h: &[f32],
    e: &[f32],
    w: &[f32],
    n: usize,
    streams: usize,
    r: &[f32],
    o: &[f32],
) -> Result<usize, KernelError> {
    let k = "combine_gnorm";
    if streams == 0 {
        return Err(invalid(k, "zero streams"));
    }
    let nt = rows_of(k, e.len(), n)?;
    check_len(k, "h", h.len(), nt * streams * n)?;
    check_len(k, "weight", w.len(), streams * n)?;
    check_len(k, "residual output", r.len(), nt * streams * n)?;
    check_len(k, "normed output", o.len(), nt * streams * n)?;
    Ok(nt)
}

#[allow(clippy::too_many_arguments)]
pub fn combine_gnorm_baseline(
    h: &[f32],
    e: &[f32],
    w: &[f32],
    n: usize,
    streams: usize,
    eps: f32,
    r: &mut [f32],
    o: &mut [f32],
) -> Result<(), KernelError> {
    let nt = combine_check(h, e, w, n, streams, r, o)?;
    for t in 0..nt {
        for s in 0..streams {
            let base = (t * streams + s) * n;
            for i in 0..n {
                r[base + i] = h[base + i] + e[t * n + i];
            }
            let sc = rms_scale(sumsq_baseline(&r[base..base + n]), n, eps);
            for i in 0..n {
                o[base + i] = (r[base + i] * sc) * w[s * n + i];
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn combine_gnorm_optimized(
    h: &[f32],
    e: &[f32],
    w: &[f32],
    n: usize,
    streams: usize,
    eps: f32,
    r: &mut [f32],
    o: &mut [f32],
) -> Result<(), KernelError> {
    combine_check(h, e, w, n, streams, r, o)?;
    let rows = h.chunks_exact(streams * n).zip(e.chunks_exact(n)).zip(
        r.chunks_exact_mut(streams * n)
            .zip(o.chunks_exact_mut(streams * n)),
    );
    for ((ht, et), (rt, ot)) in rows {
        for (((hs, rs), os), ws) in ht
            .chunks_exact(n)
            .zip(rt.chunks_exact_mut(n))
            .zip(ot.chunks_exact_mut(n))
            .zip(w.chunks_exact(n))
        {
            for ((rv, &hv), &ev) in rs.iter_mut().zip(hs).zip(et) {
                *rv = hv + ev;
            }
            let sc = rms_scale(sumsq_optimized(rs), n, eps);
            for ((ov, &rv), &wv) in os.iter_mut().zip(rs.iter()).zip(ws) {
                *ov = (rv * sc) * wv;
            }
        }
    }
    Ok(())
}

pub static COMBINE_GNORM: Op<CombineGnormFn> = Op {
    name: "combine_gnorm",
    variants: &[
        Variant {
            name: BASELINE,
            f: combine_gnorm_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: combine_gnorm_optimized,
        },
    ],
};

/// `xprep`: rows of `n` values to their activation image in `fmt`.
pub type XprepFn = fn(x: &[f32], n: usize, fmt: ActFmt, out: &mut [u8]) -> Result<(), KernelError>;

fn xprep_check(
    x: &[f32],
    n: usize,
    fmt: ActFmt,
    out: &[u8],
) -> Result<(usize, usize), KernelError> {
    let nt = rows_of("xprep", x.len(), n)?;
    let rb = check_fmt("xprep", fmt, n)?;
    check_len("xprep", "output bytes", out.len(), nt * rb)?;
    Ok((nt, rb))
}

/// All rows at once through the block quantizers of [`actq`], the transcription the GPU
/// kernels mirror operation for operation (its tests bind it to `strata_quant::quantize`, the
/// reference): the named oracle.
pub fn xprep_baseline(x: &[f32], n: usize, fmt: ActFmt, out: &mut [u8]) -> Result<(), KernelError> {
    xprep_check(x, n, fmt, out)?;
    actq::quantize_row(fmt, x, out);
    Ok(())
}

/// Row by row through `strata_quant`'s quantizer for the best ISA of this CPU (the SIMD Q8_0
/// quantizer where there is one, bitwise the reference; F32 as a plain copy): the CPU
/// backend's live activation quantizer (`cpu::matmul::prepare` calls it for these formats).
pub fn xprep_optimized(
    x: &[f32],
    n: usize,
    fmt: ActFmt,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (_, rb) = xprep_check(x, n, fmt, out)?;
    if fmt == ActFmt::F32 {
        out.copy_from_slice(bytemuck::cast_slice(x));
        return Ok(());
    }
    let q = strata_quant::quantize_fn(fmt.ggml_type(), strata_quant::simd::best())
        .ok_or_else(|| invalid("xprep", format!("{} has no quantizer", fmt.name())))?;
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(rb)) {
        q(xr, o);
    }
    Ok(())
}

pub static XPREP: Op<XprepFn> = Op {
    name: "xprep",
    variants: &[
        Variant {
            name: BASELINE,
            f: xprep_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: xprep_optimized,
        },
    ],
};

/// `xprep_pair`: rows of `n` values to the activation image of a pairing outside the four
/// catalogue formats (`ty`: F16 for F16 weights, Q8_1 for Q4_1/Q5_1). No GPU kernel mirrors
/// these, so the baseline is `strata_quant`'s scalar reference quantizer (the named oracle) and
/// the optimized variant its quantizer for this CPU's best ISA (the CPU's live one); both give
/// the same bytes (`xprep_pair_variants_agree`).
pub type XprepPairFn =
    fn(ty: GgmlType, x: &[f32], n: usize, out: &mut [u8]) -> Result<(), KernelError>;

/// Quantizes whole rows of `n` with `q` (rows and bytes checked first).
fn xprep_pair_with(
    ty: GgmlType,
    q: Option<strata_quant::QuantFn>,
    x: &[f32],
    n: usize,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let q = q.ok_or_else(|| invalid("xprep_pair", format!("{ty} has no quantizer")))?;
    let nt = rows_of("xprep_pair", x.len(), n)?;
    let rb = ty.row_bytes(n).ok_or_else(|| {
        invalid(
            "xprep_pair",
            format!("rows of {n} are not whole {ty} blocks"),
        )
    })?;
    check_len("xprep_pair", "output bytes", out.len(), nt * rb)?;
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(rb)) {
        q(xr, o);
    }
    Ok(())
}

pub fn xprep_pair_baseline(
    ty: GgmlType,
    x: &[f32],
    n: usize,
    out: &mut [u8],
) -> Result<(), KernelError> {
    xprep_pair_with(ty, strata_quant::format_fns(ty).quantize, x, n, out)
}

pub fn xprep_pair_optimized(
    ty: GgmlType,
    x: &[f32],
    n: usize,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let q = strata_quant::quantize_fn(ty, strata_quant::simd::best());
    xprep_pair_with(ty, q, x, n, out)
}

pub static XPREP_PAIR: Op<XprepPairFn> = Op {
    name: "xprep_pair",
    variants: &[
        Variant {
            name: BASELINE,
            f: xprep_pair_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: xprep_pair_optimized,
        },
    ],
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::Rng;

    #[test]
    fn xprep_pair_variants_agree() {
        let mut rng = Rng::new(0x9a1e);
        for ty in [GgmlType::F16, GgmlType::Q8_1] {
            for n in [32usize, 64, 256, 896] {
                for rows in [1usize, 3] {
                    let mut x = rng.f32_vec_special(rows * n, 4.0);
                    // A zero row part and huge values: the scale's edge cases.
                    x[..n.min(32)].fill(0.0);
                    let rb = ty.row_bytes(n).unwrap();
                    let (mut a, mut b) = (vec![0u8; rows * rb], vec![1u8; rows * rb]);
                    xprep_pair_baseline(ty, &x, n, &mut a).unwrap();
                    xprep_pair_optimized(ty, &x, n, &mut b).unwrap();
                    assert_eq!(a, b, "{ty} n={n} rows={rows}");
                }
            }
        }
        let mut out = vec![0u8; 10];
        assert!(xprep_pair_optimized(GgmlType::Q8_1, &[0.0; 33], 33, &mut out).is_err());
    }

    #[test]
    fn reduce_order_is_the_warp_tree() {
        // Values whose sum depends on the order: the tree must pair lane i with lane i+16
        // first inside each warp.
        let mut l = [0f32; LANES];
        l[0] = 1e8;
        l[16] = -1e8;
        l[1] = 1.0;
        assert_eq!(reduce_lanes(&l), 1.0);
        let mut l2 = [0f32; LANES];
        l2[0] = 1e8;
        l2[1] = 1.0;
        l2[16] = -1e8;
        l2[17] = 0.0;
        // (1e8 + -1e8) + (1 + 0) = 1: pairs are (0,16) and (1,17).
        assert_eq!(reduce_lanes(&l2), 1.0);
        // Same numbers paired as (0,1) first would lose the 1.
        assert_ne!((1e8f32 + 1.0) + (-1e8f32), 1.0);
    }

    #[test]
    fn sumsq_matches_f64_and_variants_agree() {
        let mut rng = Rng::new(5);
        for n in [2560usize, 10240, 300] {
            let x = rng.f32_vec(n, 1.0);
            let a = sumsq_baseline(&x);
            let b = sumsq_optimized(&x);
            assert_eq!(a.to_bits(), b.to_bits());
            let r: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            assert!(((a as f64 - r) / r).abs() < 1e-5, "{a} vs {r}");
        }
    }

    #[test]
    fn rms_xprep_variants_bitwise() {
        let mut rng = Rng::new(7);
        for (n, nt) in [(2560usize, 1usize), (2560, 3), (10240, 2)] {
            let x = rng.f32_vec_special(nt * n, 0.5);
            let w = rng.f32_vec(n, 1.0);
            for fmt in ActFmt::ALL {
                let rb = fmt.row_bytes(n).unwrap();
                let mut a = vec![0u8; nt * rb];
                let mut b = vec![1u8; nt * rb];
                rms_xprep_baseline(&x, &w, n, 1e-6, fmt, &mut a).unwrap();
                rms_xprep_optimized(&x, &w, n, 1e-6, fmt, &mut b).unwrap();
                assert_eq!(a, b, "n={n} nt={nt} {fmt:?}");
            }
        }
        // The F32 image is the normalized row itself: check it against f64.
        let n = 2560;
        let x = rng.f32_vec(n, 3.0);
        let w = rng.f32_vec(n, 1.0);
        let mut out = vec![0u8; 4 * n];
        rms_xprep_optimized(&x, &w, n, 1e-6, ActFmt::F32, &mut out).unwrap();
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
        let r = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..n {
            let got =
                f32::from_le_bytes([out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]]);
            let want = x[i] as f64 * r * w[i] as f64;
            assert!(
                (got as f64 - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "{i}: {got} {want}"
            );
        }
    }

    #[test]
    fn rms_xprep_rejects_bad_shapes() {
        let x = vec![0f32; 2560];
        let w = vec![0f32; 2560];
        let mut out = vec![0u8; 10];
        assert!(matches!(
            rms_xprep_optimized(&x, &w, 2560, 1e-6, ActFmt::Q8_0, &mut out),
            Err(KernelError::Length { .. })
        ));
        assert!(rms_xprep_baseline(&x, &w[..100], 2560, 1e-6, ActFmt::Q8_0, &mut out).is_err());
        assert!(rms_xprep_baseline(&x[..100], &w, 2560, 1e-6, ActFmt::Q8_0, &mut out).is_err());
    }

    #[test]
    fn combine_gnorm_variants_bitwise_and_correct() {
        let mut rng = Rng::new(9);
        let (n, s, nt) = (2560usize, 4usize, 3usize);
        let h = rng.f32_vec_special(nt * s * n, 1.0);
        let e = rng.f32_vec_special(nt * n, 1.0);
        let w = rng.f32_vec(s * n, 1.0);
        let mut r1 = vec![0f32; nt * s * n];
        let mut o1 = r1.clone();
        let mut r2 = vec![1f32; nt * s * n];
        let mut o2 = r2.clone();
        combine_gnorm_baseline(&h, &e, &w, n, s, 1e-6, &mut r1, &mut o1).unwrap();
        combine_gnorm_optimized(&h, &e, &w, n, s, 1e-6, &mut r2, &mut o2).unwrap();
        assert!(r1.iter().zip(&r2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Stream 2 of token 1 against f64.
        let base = (s + 2) * n;
        let ms: f64 = (0..n).map(|i| (r1[base + i] as f64).powi(2)).sum::<f64>() / n as f64;
        let sc = 1.0 / (ms + 1e-6).sqrt();
        for i in (0..n).step_by(97) {
            assert_eq!(r1[base + i], h[base + i] + e[n + i]);
            let want = r1[base + i] as f64 * sc * w[2 * n + i] as f64;
            assert!((o1[base + i] as f64 - want).abs() <= 1e-5 * want.abs().max(1e-6));
        }
    }

    #[test]
    fn xprep_variants_bitwise() {
        let mut rng = Rng::new(13);
        for nt in 1..=8usize {
            let n = 2560;
            let x = rng.f32_vec_special(nt * n, 2.0);
            for fmt in ActFmt::ALL {
                let rb = fmt.row_bytes(n).unwrap();
                let mut a = vec![0u8; nt * rb];
                let mut b = vec![1u8; nt * rb];
                xprep_baseline(&x, n, fmt, &mut a).unwrap();
                xprep_optimized(&x, n, fmt, &mut b).unwrap();
                assert_eq!(a, b, "nt={nt} {fmt:?}");
            }
        }
    }
}
