//! `gemv`: `y[t][r] = W[r] · x_t` for a few activation rows (1–8: decode and verify windows),
//! with the weights in their file format and each activation row already in the weight's
//! paired format (see [`super::actq`]). The baseline is the scalar reference dot product of
//! `strata_quant`; the optimized variant uses the best ISA of the CPU (bitwise equal to the
//! scalar reference by `strata_quant`'s contract) over row stripes in parallel.

use rayon::prelude::*;
use strata_quant::{GgmlType, Isa};

use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, invalid, KernelError};

/// `w`: `rows` rows of `k` elements of `ty`; `xq`: `nt` activation rows of `k` elements in
/// `ty.vec_dot_type()`; `y`: `nt · rows` values, token-major.
pub type GemvFn = fn(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    k: usize,
    xq: &[u8],
    y: &mut [f32],
) -> Result<(), KernelError>;

/// Checks shapes; returns (weight row bytes, activation row bytes, nt).
pub fn gemv_check(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    k: usize,
    xq: &[u8],
    y: &[f32],
) -> Result<(usize, usize, usize), KernelError> {
    let xt = ty
        .vec_dot_type()
        .ok_or_else(|| invalid("gemv", format!("{ty} has no dot product")))?;
    let wb = ty
        .row_bytes(k)
        .ok_or_else(|| invalid("gemv", format!("row length {k} is not whole {ty} blocks")))?;
    let xb = xt
        .row_bytes(k)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("gemv", format!("row length {k} is not whole {xt} blocks")))?;
    check_len("gemv", "weight bytes", w.len(), rows * wb)?;
    if !xq.len().is_multiple_of(xb) {
        return Err(invalid(
            "gemv",
            format!("activations of {} bytes are not whole {xt} rows", xq.len()),
        ));
    }
    let nt = xq.len() / xb;
    check_len("gemv", "output", y.len(), nt * rows)?;
    Ok((wb, xb, nt))
}

fn dot(ty: GgmlType, isa: Isa, k: usize, w: &[u8], x: &[u8]) -> Result<f32, KernelError> {
    strata_quant::vec_dot_isa(ty, isa, k, w, x).map_err(|source| KernelError::Quant {
        kernel: "gemv",
        source,
    })
}

pub fn gemv_baseline(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    k: usize,
    xq: &[u8],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (wb, xb, nt) = gemv_check(ty, w, rows, k, xq, y)?;
    for t in 0..nt {
        for r in 0..rows {
            y[t * rows + r] = dot(
                ty,
                Isa::Scalar,
                k,
                &w[r * wb..(r + 1) * wb],
                &xq[t * xb..(t + 1) * xb],
            )?;
        }
    }
    Ok(())
}

pub fn gemv_optimized(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    k: usize,
    xq: &[u8],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (wb, xb, nt) = gemv_check(ty, w, rows, k, xq, y)?;
    let isa = strata_quant::simd::best();
    // Stripes of 64 rows: every weight row is read once for all nt activation rows.
    const STRIPE: usize = 64;
    let stripes: Vec<Result<Vec<f32>, KernelError>> = w
        .par_chunks(STRIPE * wb)
        .map(|ws| {
            let n = ws.len() / wb;
            let mut part = vec![0f32; n * nt];
            for (r, wr) in ws.chunks_exact(wb).enumerate() {
                for t in 0..nt {
                    part[t * n + r] = dot(ty, isa, k, wr, &xq[t * xb..(t + 1) * xb])?;
                }
            }
            Ok(part)
        })
        .collect();
    for (s, part) in stripes.into_iter().enumerate() {
        let part = part?;
        let n = part.len() / nt.max(1);
        for t in 0..nt {
            y[t * rows + s * STRIPE..t * rows + s * STRIPE + n]
                .copy_from_slice(&part[t * n..(t + 1) * n]);
        }
    }
    Ok(())
}

pub static GEMV: Op<GemvFn> = Op {
    name: "gemv",
    variants: &[
        Variant {
            name: BASELINE,
            f: gemv_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: gemv_optimized,
        },
    ],
};

/// The weight formats of the GEMV catalogue (each with its paired activation).
pub const GEMV_FORMATS: [GgmlType; 9] = [
    GgmlType::Q2_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::BF16,
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::actq::{quantize_row, ActFmt};
    use crate::kernels::testdata::{weight_blocks, Rng};

    #[test]
    fn variants_bitwise_and_close_to_f64() {
        let mut rng = Rng::new(31);
        let (rows, k) = (130usize, 512usize);
        for (i, &ty) in GEMV_FORMATS.iter().enumerate() {
            if strata_quant::dot_fn(ty, Isa::Scalar).is_none() {
                eprintln!("skipping {ty}: strata_quant has no dot product for it yet");
                continue;
            }
            let w = weight_blocks(ty, rows * k / ty.block_size(), 40 + i as u64);
            let fmt = ActFmt::for_weight(ty).unwrap();
            let nt = 1 + rng.below(8);
            let x = rng.f32_vec(nt * k, 1.0);
            let mut xq = vec![0u8; nt * fmt.row_bytes(k).unwrap()];
            quantize_row(fmt, &x, &mut xq);
            let mut a = vec![0f32; nt * rows];
            let mut b = vec![1f32; nt * rows];
            gemv_baseline(ty, &w, rows, k, &xq, &mut a).unwrap();
            gemv_optimized(ty, &w, rows, k, &xq, &mut b).unwrap();
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{ty}"
            );
            // Row 7 of the last token against the f64 dot of the dequantized operands.
            let wb = ty.row_bytes(k).unwrap();
            let xb = fmt.row_bytes(k).unwrap();
            let mut wd = vec![0f32; k];
            let mut xd = vec![0f32; k];
            strata_quant::dequantize(ty, &w[7 * wb..8 * wb], &mut wd).unwrap();
            strata_quant::dequantize(fmt.ggml_type(), &xq[(nt - 1) * xb..nt * xb], &mut xd)
                .unwrap();
            let r: f64 = wd.iter().zip(&xd).map(|(&p, &q)| p as f64 * q as f64).sum();
            let mag: f64 = wd
                .iter()
                .zip(&xd)
                .map(|(&p, &q)| (p as f64 * q as f64).abs())
                .sum();
            let got = a[(nt - 1) * rows + 7] as f64;
            assert!((got - r).abs() <= 1e-5 * mag + 1e-30, "{ty}: {got} vs {r}");
        }
    }
}
