//! Dense causal attention on the CPU (`Backend::append_kv` / `Backend::attend_causal`): each
//! query head attends to the contiguous cached keys `0..=pos`, so there is no per-row list of
//! selected positions to build, and the inner products run over whole contiguous rows.
//!
//! With an F16 cache the rows are rounded to f16 values once, when they are appended (as a real
//! F16 cache stores them), instead of on every read; the query and the probabilities are rounded
//! too, as F16 dot products would see them. Every sum has a fixed order (eight interleaved
//! partial sums over the head dimension, then the keys in order), so a row's result does not
//! depend on the batch it came in or on the thread count.

/// `x` with every element rounded to the nearest f16 value.
pub(crate) fn round_f16(x: &mut [f32]) {
    for v in x {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// `Σ a_i b_i` in eight interleaved partial sums, combined pairwise.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, at) = (a.chunks_exact(8), a.chunks_exact(8).remainder());
    let bc = b.chunks_exact(8);
    let bt = bc.remainder();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in at.iter().zip(bt).enumerate() {
        acc[i] += x * y;
    }
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// One query head over keys `0..n` of its KV head: `k`/`v` are the caches (rows of `row_len`),
/// the head's columns start at `off`. `scores` is scratch of at least `n` values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    row_len: usize,
    off: usize,
    n: usize,
    f16: bool,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let d = q.len();
    // The rounded query on the stack for the usual head sizes, on the heap past them.
    let mut stack = [0f32; 256];
    let mut heap = Vec::new();
    let qv: &[f32] = if !f16 {
        q
    } else if d <= stack.len() {
        stack[..d].copy_from_slice(q);
        round_f16(&mut stack[..d]);
        &stack[..d]
    } else {
        heap.extend_from_slice(q);
        round_f16(&mut heap);
        &heap
    };
    let scale = 1.0 / (d as f32).sqrt();
    scores.clear();
    scores.extend((0..n).map(|t| dot(qv, &k[t * row_len + off..][..d]) * scale));
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - m).exp();
        z += *s;
    }
    let inv = 1.0 / z;
    out.iter_mut().for_each(|o| *o = 0.0);
    for (t, &p) in scores.iter().enumerate() {
        let mut w = p * inv;
        if f16 {
            w = half::f16::from_f32(w).to_f32();
        }
        for (o, &x) in out.iter_mut().zip(&v[t * row_len + off..][..d]) {
            *o += w * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook formula in f64: softmax(q·k / sqrt(d)) · v.
    fn reference(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>]) -> Vec<f64> {
        let d = q.len();
        let s: Vec<f64> = k
            .iter()
            .map(|kr| {
                q.iter()
                    .zip(kr)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..d)
            .map(|j| {
                e.iter()
                    .zip(v)
                    .map(|(p, vr)| p / z * f64::from(vr[j]))
                    .sum()
            })
            .collect()
    }

    #[test]
    fn matches_the_textbook_formula() {
        // Two KV heads of 20 dims (a tail past the 8-wide chunks), 7 keys; head 1 is read.
        let (d, heads, n) = (20usize, 2usize, 7usize);
        let val = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 37.0;
        let k: Vec<f32> = (0..n * heads * d).map(val).collect();
        let v: Vec<f32> = (0..n * heads * d).map(|i| val(i + 13)).collect();
        let q: Vec<f32> = (0..d).map(|i| val(i + 5)).collect();
        let rows = |c: &[f32]| -> Vec<Vec<f32>> {
            (0..n)
                .map(|t| c[t * heads * d + d..t * heads * d + 2 * d].to_vec())
                .collect()
        };
        let want = reference(&q, &rows(&k), &rows(&v));
        let mut out = vec![0f32; d];
        let mut scratch = Vec::new();
        causal_head(&q, &k, &v, heads * d, d, n, false, &mut scratch, &mut out);
        for (a, b) in out.iter().zip(&want) {
            assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
        }
        // F16: inputs and probabilities rounded; within f16's precision of the exact answer.
        let (mut k16, mut v16) = (k.clone(), v.clone());
        round_f16(&mut k16);
        round_f16(&mut v16);
        causal_head(
            &q,
            &k16,
            &v16,
            heads * d,
            d,
            n,
            true,
            &mut scratch,
            &mut out,
        );
        for (a, b) in out.iter().zip(&want) {
            assert!((f64::from(*a) - b).abs() < 5e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn one_key_returns_its_value() {
        let q = [0.3f32; 8];
        let k = [1.0f32; 8];
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut out = [0f32; 8];
        causal_head(&q, &k, &v, 8, 0, 1, false, &mut Vec::new(), &mut out);
        assert_eq!(out.to_vec(), v);
    }
}
