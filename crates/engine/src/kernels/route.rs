//! `route`: the MoE router body (the report's `route_body`, SPEC §8): fp32 softmax over the
//! expert logits of each row, top-k by value with ties to the lower expert id, and the chosen
//! probabilities renormalised to sum to one.
//!
//! Float contract: `m = max(logits)`, `e_i = exp(l_i − m)`, `s = Σ e_i` in expert order,
//! `p_i = e_i / s`; the selection compares `p`; `w_k = p_k / Σ_{rank} p` summed in rank order.
//! The CUDA kernel sums `s` in its own order and uses the device `expf`, so the backends agree
//! within a tolerance on weights and exactly on ids except where two probabilities are within
//! that tolerance of each other (a real tie).

use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, invalid, KernelError};

/// Largest k the kernels support (the register-resident top-k of the CUDA kernel).
pub const MAX_K: usize = 16;

/// `logits`: `nt · n_exp`; `ids`, `weights`: `nt · k`, rank order.
pub type RouteFn = fn(
    logits: &[f32],
    n_exp: usize,
    k: usize,
    ids: &mut [i32],
    weights: &mut [f32],
) -> Result<(), KernelError>;

fn route_check(
    logits: &[f32],
    n_exp: usize,
    k: usize,
    ids: &[i32],
    weights: &[f32],
) -> Result<usize, KernelError> {
    if n_exp == 0 || !logits.len().is_multiple_of(n_exp) {
        return Err(invalid(
            "route",
            format!("{} logits are not whole rows of {n_exp}", logits.len()),
        ));
    }
    if k == 0 || k > n_exp || k > MAX_K {
        return Err(invalid(
            "route",
            format!("k = {k} must be in 1..={}", MAX_K.min(n_exp)),
        ));
    }
    let nt = logits.len() / n_exp;
    check_len("route", "ids", ids.len(), nt * k)?;
    check_len("route", "weights", weights.len(), nt * k)?;
    Ok(nt)
}

/// Softmax probabilities of one row (the contract's order).
pub fn softmax_row(l: &[f32], p: &mut [f32]) {
    let m = l
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let mut s = 0f32;
    for (pi, &li) in p.iter_mut().zip(l) {
        *pi = (li - m).exp();
        s += *pi;
    }
    for pi in p.iter_mut() {
        *pi /= s;
    }
}

/// Repeated argmax with a mask (the report's algorithm).
pub fn route_baseline(
    logits: &[f32],
    n_exp: usize,
    k: usize,
    ids: &mut [i32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    let nt = route_check(logits, n_exp, k, ids, weights)?;
    let mut p = vec![0f32; n_exp];
    let mut taken = vec![false; n_exp];
    for t in 0..nt {
        softmax_row(&logits[t * n_exp..(t + 1) * n_exp], &mut p);
        taken.fill(false);
        for r in 0..k {
            let mut best: Option<usize> = None;
            for e in 0..n_exp {
                if taken[e] {
                    continue;
                }
                match best {
                    None => best = Some(e),
                    Some(b) if p[e] > p[b] => best = Some(e),
                    _ => {}
                }
            }
            let b = best.unwrap_or(0);
            taken[b] = true;
            ids[t * k + r] = b as i32;
            weights[t * k + r] = p[b];
        }
        renormalise(&mut weights[t * k..(t + 1) * k]);
    }
    Ok(())
}

fn renormalise(w: &mut [f32]) {
    let mut s = 0f32;
    for &v in w.iter() {
        s += v;
    }
    for v in w.iter_mut() {
        *v /= s;
    }
}

/// One pass keeping a sorted top-k list (a later equal value never displaces an earlier one,
/// which is the repeated argmax's tie rule).
pub fn route_optimized(
    logits: &[f32],
    n_exp: usize,
    k: usize,
    ids: &mut [i32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    let nt = route_check(logits, n_exp, k, ids, weights)?;
    let mut p = vec![0f32; n_exp];
    for t in 0..nt {
        softmax_row(&logits[t * n_exp..(t + 1) * n_exp], &mut p);
        let mut tv = [0f32; MAX_K];
        let mut ti = [0usize; MAX_K];
        let mut len = 0usize;
        for (e, &v) in p.iter().enumerate() {
            // NaN never enters a full list, as in the repeated argmax.
            if len == k && v.partial_cmp(&tv[k - 1]) != Some(std::cmp::Ordering::Greater) {
                continue;
            }
            let mut pos = len.min(k - 1);
            while pos > 0 && v > tv[pos - 1] {
                tv[pos] = tv[pos - 1];
                ti[pos] = ti[pos - 1];
                pos -= 1;
            }
            tv[pos] = v;
            ti[pos] = e;
            len = (len + 1).min(k);
        }
        for r in 0..k {
            ids[t * k + r] = ti[r] as i32;
            weights[t * k + r] = tv[r];
        }
        renormalise(&mut weights[t * k..(t + 1) * k]);
    }
    Ok(())
}

pub static ROUTE: Op<RouteFn> = Op {
    name: "route",
    variants: &[
        Variant {
            name: BASELINE,
            f: route_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: route_optimized,
        },
    ],
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::Rng;

    #[test]
    fn variants_bitwise_with_ties() {
        let mut rng = Rng::new(41);
        for &(ne, k) in &[(512usize, 10usize), (256, 8), (64, 16)] {
            for nt in 1..=8usize {
                let mut l = rng.f32_vec_special(nt * ne, 2.0);
                // Plant exact ties among large values, and -0.0/+0.0 pairs.
                for t in 0..nt {
                    let a = rng.below(ne);
                    let b = rng.below(ne);
                    l[t * ne + a] = 9.0;
                    l[t * ne + b] = 9.0;
                }
                l[0] = -0.0;
                l[1] = 0.0;
                let (mut i1, mut w1) = (vec![0i32; nt * k], vec![0f32; nt * k]);
                let (mut i2, mut w2) = (vec![-1i32; nt * k], vec![1f32; nt * k]);
                route_baseline(&l, ne, k, &mut i1, &mut w1).unwrap();
                route_optimized(&l, ne, k, &mut i2, &mut w2).unwrap();
                assert_eq!(i1, i2);
                assert!(w1.iter().zip(&w2).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn picks_top_k_and_renormalises() {
        let l = [1.0f32, 5.0, 3.0, 5.0, -2.0, 4.0];
        let (mut ids, mut w) = (vec![0i32; 3], vec![0f32; 3]);
        route_optimized(&l, 6, 3, &mut ids, &mut w).unwrap();
        assert_eq!(ids, vec![1, 3, 5]);
        let e: Vec<f64> = [5.0f64, 5.0, 4.0]
            .iter()
            .map(|v| (v - 5.0f64).exp())
            .collect();
        let s: f64 = e.iter().sum();
        for (got, want) in w.iter().zip(e.iter().map(|v| v / s)) {
            assert!((*got as f64 - want).abs() < 1e-6);
        }
        assert!(route_optimized(&l, 6, 7, &mut ids, &mut w).is_err());
    }
}
