//! The CPU backend's arithmetic on plain slices: one function per operation of the backend
//! trait, written as the spec states it, in f32, in a fixed order per row.

use rayon::prelude::*;

use crate::kernels::norm;

#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)`, switching to `x` where torch's softplus does (beta 1, threshold 20).
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Inverse frequencies `θ^(−2i/rot)` for the `rot / 2` rotated pairs.
pub(crate) fn rope_freqs(rot: usize, theta: f32) -> Vec<f64> {
    (0..rot / 2)
        .map(|i| (theta as f64).powf(-(2.0 * i as f64) / rot as f64))
        .collect()
}

/// Rotate the first `rot` dims of each `head_dim` head of `row` at position `pos` (NeoX halves:
/// dim i pairs with i + rot/2).
pub(crate) fn rope_row(row: &mut [f32], head_dim: usize, freqs: &[f64], pos: u32) {
    let half = freqs.len();
    let cs: Vec<(f32, f32)> = freqs
        .iter()
        .map(|&f| {
            let a = pos as f64 * f;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect();
    for head in row.chunks_mut(head_dim) {
        for (i, &(c, s)) in cs.iter().enumerate() {
            let x0 = head[i];
            let x1 = head[i + half];
            head[i] = x0 * c - x1 * s;
            head[i + half] = x1 * c + x0 * s;
        }
    }
}

/// One query row of causal depthwise convolution: `P` is history rows followed by input rows
/// (row-major, `c` channels), `t` the index in `P` of the current row, `w` is `[c, K]`.
pub(crate) fn conv_row(
    p: &[f32],
    c: usize,
    t: usize,
    w: &[f32],
    k: usize,
    dil: usize,
    out: &mut [f32],
) {
    for (ch, o) in out.iter_mut().enumerate() {
        let mut acc = 0f32;
        for tap in 0..k {
            let back = (k - 1 - tap) * dil;
            acc += w[ch * k + tap] * p[(t - back) * c + ch];
        }
        *o = silu(acc);
    }
}

/// One Gated DeltaNet token for one value head. `s` is the head's state `[head_k, head_v]`.
/// Kept out of line: inlined into its rayon caller it compiles to slower loops (callgrind:
/// +23 % instructions for `gdn_step` on the small fixture).
#[allow(clippy::too_many_arguments)]
#[inline(never)]
pub(crate) fn gdn_head(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    decay: f32,
    z: &[f32],
    norm: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let dv = v.len();
    for x in s.iter_mut() {
        *x *= decay;
    }
    // kS[j] = Σ_i k_i S[i][j]
    let mut ks = vec![0f32; dv];
    for (ki, srow) in k.iter().zip(s.chunks(dv)) {
        for (a, &sv) in ks.iter_mut().zip(srow) {
            *a += ki * sv;
        }
    }
    let delta: Vec<f32> = v
        .iter()
        .zip(&ks)
        .map(|(&vj, &kj)| beta * (vj - kj))
        .collect();
    for (ki, srow) in k.iter().zip(s.chunks_mut(dv)) {
        for (sv, &d) in srow.iter_mut().zip(&delta) {
            *sv += ki * d;
        }
    }
    let mut o = vec![0f32; dv];
    for (qi, srow) in q.iter().zip(s.chunks(dv)) {
        for (a, &sv) in o.iter_mut().zip(srow) {
            *a += qi * sv;
        }
    }
    // The core RMS norm's scale, in its one (sequential) order: `kernels::norm::rms_norm`.
    let sc = norm::rms_scale(norm::sumsq_sequential(&o), o.len(), eps);
    for (((dst, &ov), &wv), &zv) in out.iter_mut().zip(&o).zip(norm).zip(z) {
        *dst = ov * sc * wv * sigmoid(zv);
    }
}

/// `x · rsqrt(sum(x²) + eps)` in place.
pub(crate) fn l2_norm(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let s = 1.0 / (ss + eps).sqrt();
    for v in x {
        *v *= s;
    }
}

/// Softmax attention of one query head over selected rows of the caches. With `f16`, keys,
/// values, the query and the probabilities take F16 values first, as an F16 KV cache and its F16
/// dot products give them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_head(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    row_len: usize,
    off: usize,
    tokens: &[u32],
    f16: bool,
    out: &mut [f32],
) {
    let d = q.len();
    let r = |x: f32| {
        if f16 {
            half::f16::from_f32(x).to_f32()
        } else {
            x
        }
    };
    let q: Vec<f32> = q.iter().map(|&x| r(x)).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let scores: Vec<f32> = tokens
        .iter()
        .map(|&t| {
            let kr = &k_cache[t as usize * row_len + off..][..d];
            q.iter().zip(kr).map(|(a, &b)| a * r(b)).sum::<f32>() * scale
        })
        .collect();
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f32 = p.iter().sum();
    out.iter_mut().for_each(|o| *o = 0.0);
    for (&t, &pi) in tokens.iter().zip(&p) {
        let vr = &v_cache[t as usize * row_len + off..][..d];
        let w = r(pi / z);
        for (o, &v) in out.iter_mut().zip(vr) {
            *o += w * r(v);
        }
    }
}

/// Indices of the `k` largest values, ties to the lower index, in rank order.
pub(crate) fn top_k_lower_index(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    // A stable sort by descending value keeps equal values in index order.
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

/// libstdc++'s `std::partial_sort(idx, idx + k, idx + n, v[a] > v[b])` (heap select): which
/// indices land in the first `k` slots, ties broken exactly as llama.cpp's CPU `ggml_top_k` does.
pub(crate) fn partial_sort_top_k(v: &[f32], k: usize) -> Vec<usize> {
    let comp = |a: usize, b: usize| v[a] > v[b];
    let mut a: Vec<usize> = (0..v.len()).collect();
    let k = k.min(a.len());
    if k >= 2 {
        let mut parent = (k - 2) / 2;
        loop {
            let val = a[parent];
            adjust_heap(&mut a, parent, k, val, &comp);
            if parent == 0 {
                break;
            }
            parent -= 1;
        }
    }
    if k > 0 {
        for i in k..a.len() {
            if comp(a[i], a[0]) {
                let val = a[i];
                a[i] = a[0];
                adjust_heap(&mut a, 0, k, val, &comp);
            }
        }
    }
    a.truncate(k);
    a
}

fn push_heap(
    a: &mut [usize],
    mut hole: usize,
    top: usize,
    value: usize,
    comp: &impl Fn(usize, usize) -> bool,
) {
    while hole > top {
        let parent = (hole - 1) / 2;
        if !comp(a[parent], value) {
            break;
        }
        a[hole] = a[parent];
        hole = parent;
    }
    a[hole] = value;
}

fn adjust_heap(
    a: &mut [usize],
    mut hole: usize,
    len: usize,
    value: usize,
    comp: &impl Fn(usize, usize) -> bool,
) {
    let top = hole;
    let mut second = hole;
    while second < (len.saturating_sub(1)) / 2 {
        second = 2 * (second + 1);
        if comp(a[second], a[second - 1]) {
            second -= 1;
        }
        a[hole] = a[second];
        hole = second;
    }
    if len & 1 == 0 && len >= 2 && second == (len - 2) / 2 {
        second = 2 * (second + 1);
        a[hole] = a[second - 1];
        hole = second - 1;
    }
    push_heap(a, hole, top, value, comp);
}

/// Parallel map over rows when there are several, sequential for one (no scheduling cost).
pub(crate) fn for_rows<F>(out: &mut [f32], cols: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    if out.len() > cols {
        out.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, o)| f(r, o));
    } else {
        out.chunks_mut(cols).enumerate().for_each(|(r, o)| f(r, o));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_sort_matches_libstdcxx_on_ties() {
        // Expected slot orders from the fixture generator's port of libstdc++'s heap select
        // (gen/llamacpp_qsa.py::partial_sort_topk), on tie-heavy inputs.
        #[rustfmt::skip]
        let cases: [(&[f32], usize, &[usize]); 6] = [
            (&[5.0, 5.0, 1.0, 5.0, 1.0, 1.0], 3, &[0, 1, 3]),
            (&[0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 2.0, 0.0, 0.0, 2.0], 7, &[0, 3, 5, 11, 8, 2, 6]),
            (&[0.5, 0.25, 0.25, 0.5, 0.25, 0.5, 0.5, 0.5, 1e9, 1e9, 0.25, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25], 11, &[6, 11, 0, 7, 12, 5, 14, 3, 8, 9, 13]),
            (&[3.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 0.0, 3.0, 3.0, 0.0, 3.0, 0.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 0.0, 3.0, 3.0], 19, &[14, 21, 0, 8, 22, 12, 20, 25, 23, 9, 31, 5, 19, 6, 32, 15, 26, 17, 29]),
            (&[1.0; 9], 9, &[6, 4, 2, 8, 1, 5, 0, 7, 3]),
            (&[2.0, 1.0, 4.0, 0.0, 0.0, 0.0, 4.0, 2.0, 0.0, 0.0, 2.0, 4.0, 2.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 2.0, 1.0, 0.0, 4.0, 1.0, 2.0, 2.0, 4.0, 2.0, 1.0, 0.0, 0.0, 4.0, 4.0, 1.0, 2.0], 5, &[2, 6, 31, 11, 27]),
        ];
        for (v, k, want) in cases {
            assert_eq!(partial_sort_top_k(v, k), want, "{v:?} top {k}");
        }
    }

    #[test]
    fn top_k_prefers_lower_index() {
        assert_eq!(top_k_lower_index(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(top_k_lower_index(&[0.0, 0.0, 0.0], 2), vec![0, 1]);
    }
}
