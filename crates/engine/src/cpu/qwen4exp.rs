//! The CPU's qwen4exp operations ([`Qwen4expOps`]): the reference every other backend's
//! versions are checked against.

use rayon::prelude::*;

use super::{ops, CpuBackend, CpuBuf, CpuIds, CpuWeight};
use crate::backend::{AttnDims, Backend, DeviceWeight, KvType};
use crate::error::{EngineError, Result};
use crate::qwen4exp::ops::{GdnParams, HcWeights, QsaRule, QsaSelect, Qwen4expOps};

/// Per query row: the attended token positions, ascending.
pub struct CpuSelection(pub Vec<Vec<u32>>);

impl Qwen4expOps for CpuBackend {
    type Selection = CpuSelection;

    fn hc_mix(
        &self,
        hc: &HcWeights<'_, CpuWeight>,
        x: &CpuBuf,
    ) -> Result<(CpuBuf, Option<CpuBuf>)> {
        let s = hc.streams;
        if s == 0 || !x.cols.is_multiple_of(s) {
            return Err(EngineError::shape(
                "hc_mix",
                format!("rows of {} in {s} streams", x.cols),
            ));
        }
        let h = x.cols / s;
        // The norm's rows with their image for the down and inject products (quantized once).
        let ws: &[&CpuWeight] = match hc.inject {
            Some(wi) => &[hc.down, wi],
            None => &[hc.down],
        };
        let xp = self.rms_norm_prepared(x, hc.norm, h, hc.eps, ws)?;
        let xn = &xp.rows;
        let inv_s = 1.0 / s as f32;
        let mut a = self.matmul_prepared(hc.down, &xp)?;
        for v in a.data.iter_mut() {
            *v = ops::silu(*v * inv_s);
        }
        let g = self.matmul(hc.up, &a)?;
        Self::same_shape("hc_mix (up)", &g, xn)?;
        let mut u = vec![0f32; x.rows * h];
        for r in 0..x.rows {
            let (gr, xr) = (g.row(r), xn.row(r));
            let ur = &mut u[r * h..(r + 1) * h];
            for st in 0..s {
                for j in 0..h {
                    ur[j] += ops::sigmoid(gr[st * h + j]) * xr[st * h + j];
                }
            }
            for v in ur.iter_mut() {
                *v *= inv_s;
            }
        }
        let u = CpuBuf::new(x.rows, h, u)?;
        let inj = match hc.inject {
            Some(wi) => {
                let mut inj = self.matmul_prepared(wi, &xp)?;
                if inj.cols != s {
                    return Err(EngineError::shape(
                        "hc_mix",
                        format!("{}: {} inject weights for {s} streams", wi.name(), inj.cols),
                    ));
                }
                for v in inj.data.iter_mut() {
                    *v = 2.0 * ops::sigmoid(*v * inv_s);
                }
                Some(inj)
            }
            None => None,
        };
        Ok((u, inj))
    }

    fn hc_combine(&self, x: &mut CpuBuf, y: &CpuBuf, inj: Option<&CpuBuf>) -> Result<()> {
        let s = match inj {
            Some(w) => w.cols,
            None => x.cols.checked_div(y.cols).unwrap_or(0),
        };
        let rows_ok = inj.is_none_or(|w| w.rows == x.rows);
        if y.rows != x.rows || !rows_ok || y.cols * s != x.cols {
            return Err(EngineError::shape(
                "hc_combine",
                format!(
                    "x {}×{}, y {}×{}, {s} streams",
                    x.rows, x.cols, y.rows, y.cols
                ),
            ));
        }
        let h = y.cols;
        for r in 0..x.rows {
            let yr = y.row(r);
            let xr = &mut x.data[r * s * h..(r + 1) * s * h];
            for st in 0..s {
                let xs = &mut xr[st * h..(st + 1) * h];
                match inj {
                    Some(w) => {
                        let w = w.row(r)[st];
                        for (xv, &yv) in xs.iter_mut().zip(yr) {
                            *xv += w * yv;
                        }
                    }
                    // Unit weights: `1·y` is `y` exactly.
                    None => {
                        for (xv, &yv) in xs.iter_mut().zip(yr) {
                            *xv += yv;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn conv1d_silu(
        &self,
        x: &CpuBuf,
        w: &CpuWeight,
        history: &mut CpuBuf,
        dilation: usize,
    ) -> Result<CpuBuf> {
        let c = x.cols;
        let k = w.row_len();
        let wv = w.values()?;
        let hist_rows = (k.max(1) - 1) * dilation;
        if wv.len() != c * k || history.cols != c || history.rows != hist_rows {
            return Err(EngineError::shape(
                "conv1d_silu",
                format!(
                    "{}: kernel {k}×{} for {c} channels, history {}×{} (expected {hist_rows} rows)",
                    w.name(),
                    wv.len() / k.max(1),
                    history.rows,
                    history.cols
                ),
            ));
        }
        let mut p = Vec::with_capacity((hist_rows + x.rows) * c);
        p.extend_from_slice(&history.data);
        p.extend_from_slice(&x.data);
        let mut out = vec![0f32; x.data.len()];
        self.pool.install(|| {
            ops::for_rows(&mut out, c, |r, o| {
                ops::conv_row(&p, c, hist_rows + r, wv, k, dilation, o)
            })
        });
        let tail = p.len() - hist_rows * c;
        history.data.copy_from_slice(&p[tail..]);
        CpuBuf::new(x.rows, c, out)
    }

    fn gdn_step(
        &self,
        p: &GdnParams<'_, CpuWeight>,
        qkv: &CpuBuf,
        z: &CpuBuf,
        a: &CpuBuf,
        b: &CpuBuf,
        state: &mut CpuBuf,
    ) -> Result<CpuBuf> {
        let d = p.dims;
        let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.head_k, d.head_v);
        let n = qkv.rows;
        let (ssm_a, dt, norm) = (p.a.values()?, p.dt_bias.values()?, p.norm.values()?);
        let ok = nk > 0
            && nv % nk == 0
            && qkv.cols == d.conv_dim()
            && z.cols == d.value_dim()
            && a.cols == nv
            && b.cols == nv
            && z.rows == n
            && a.rows == n
            && b.rows == n
            && ssm_a.len() == nv
            && dt.len() == nv
            && norm.len() == dv
            && state.rows == nv
            && state.cols == dk * dv;
        if !ok {
            return Err(EngineError::shape(
                "gdn_step",
                format!(
                    "qkv {}×{}, z {}×{}, a/b {}/{}, state {}×{} for {d:?}",
                    qkv.rows, qkv.cols, z.rows, z.cols, a.cols, b.cols, state.rows, state.cols
                ),
            ));
        }
        let mut out = vec![0f32; n * d.value_dim()];
        let qscale = 1.0 / (dk as f32).sqrt();
        self.pool.install(|| {
            for t in 0..n {
                let row = qkv.row(t);
                let mut q = row[..nk * dk].to_vec();
                let mut k = row[nk * dk..2 * nk * dk].to_vec();
                let v = &row[2 * nk * dk..];
                for hq in q.chunks_mut(dk) {
                    ops::l2_norm(hq, 1e-6);
                    for x in hq.iter_mut() {
                        *x *= qscale;
                    }
                }
                for hk in k.chunks_mut(dk) {
                    ops::l2_norm(hk, 1e-6);
                }
                let (zr, ar, br) = (z.row(t), a.row(t), b.row(t));
                let orow = &mut out[t * nv * dv..(t + 1) * nv * dv];
                state
                    .data
                    .par_chunks_mut(dk * dv)
                    .zip(orow.par_chunks_mut(dv))
                    .enumerate()
                    .for_each(|(h, (s, o))| {
                        // Tiled GGUF order: value head h reads key head h % nk.
                        let g = h % nk;
                        let beta = ops::sigmoid(br[h]);
                        let decay = (ssm_a[h] * ops::softplus(ar[h] + dt[h])).exp();
                        ops::gdn_head(
                            s,
                            &q[g * dk..(g + 1) * dk],
                            &k[g * dk..(g + 1) * dk],
                            &v[h * dv..(h + 1) * dv],
                            beta,
                            decay,
                            &zr[h * dv..(h + 1) * dv],
                            norm,
                            p.eps,
                            o,
                        );
                    });
            }
        });
        CpuBuf::new(n, d.value_dim(), out)
    }

    fn qsa_pool_blocks(&self, kraw: &CpuBuf, positions: &CpuIds, ratio: usize) -> Result<CpuBuf> {
        let d = kraw.cols;
        let mut out = vec![0f32; positions.0.len() * d];
        for (o, &p) in out.chunks_mut(d.max(1)).zip(&positions.0) {
            let p = p as usize;
            if ratio == 0 || !(p + 1).is_multiple_of(ratio) {
                if ratio == 0 {
                    return Err(EngineError::shape("qsa_pool_blocks", "block size 0"));
                }
                continue;
            }
            let b = p / ratio;
            if (b + 1) * ratio > kraw.rows {
                return Err(EngineError::shape(
                    "qsa_pool_blocks",
                    format!("block {b} of {ratio} from {} keys", kraw.rows),
                ));
            }
            for r in b * ratio..(b + 1) * ratio {
                for (a, &v) in o.iter_mut().zip(kraw.row(r)) {
                    *a += v;
                }
            }
            for a in o.iter_mut() {
                *a /= ratio as f32;
            }
        }
        CpuBuf::new(positions.0.len(), d, out)
    }

    fn qsa_select(
        &self,
        qi: &CpuBuf,
        blocks: &CpuBuf,
        positions: &CpuIds,
        sel: QsaSelect,
    ) -> Result<CpuSelection> {
        let positions = &positions.0[..];
        let d = blocks.cols;
        if d == 0 || !qi.cols.is_multiple_of(d) || positions.len() != qi.rows || sel.ratio == 0 {
            return Err(EngineError::shape(
                "qsa_select",
                format!(
                    "queries {}×{}, blocks {}×{d}, {} positions",
                    qi.rows,
                    qi.cols,
                    blocks.rows,
                    positions.len()
                ),
            ));
        }
        let scale = 1.0 / (d as f32).sqrt();
        let r = sel.ratio;
        let keep_blocks = sel.budget / r;
        let rows: Result<Vec<Vec<u32>>> = self.pool.install(|| {
            (0..qi.rows)
                .into_par_iter()
                .map(|row| {
                    let pos = positions[row] as usize;
                    let nb = (pos + 1) / r;
                    if nb > blocks.rows {
                        return Err(EngineError::shape(
                            "qsa_select",
                            format!(
                                "position {pos} needs {nb} pooled blocks, {} cached",
                                blocks.rows
                            ),
                        ));
                    }
                    let q = qi.row(row);
                    let scores: Vec<f32> = (0..nb)
                        .map(|b| {
                            let kb = blocks.row(b);
                            let s: f32 = q
                                .chunks(d)
                                .map(|qh| {
                                    qh.iter().zip(kb).map(|(x, y)| x * y).sum::<f32>().max(0.0)
                                })
                                .sum();
                            s * scale
                        })
                        .collect();
                    Ok(match sel.rule {
                        QsaRule::Reference => {
                            let mut chosen = ops::top_k_lower_index(&scores, keep_blocks.min(nb));
                            chosen.sort_unstable();
                            let mut toks: Vec<u32> = chosen
                                .iter()
                                .flat_map(|&b| (b * r..(b + 1) * r).map(|t| t as u32))
                                .collect();
                            toks.extend((nb * r..=pos).map(|t| t as u32));
                            toks
                        }
                        QsaRule::LlamaCpp => {
                            let mut tok_score = vec![1e9f32; pos + 1];
                            for (t, s) in tok_score.iter_mut().take(nb * r).enumerate() {
                                *s = scores[t / r];
                            }
                            let width = (pos + 1).min(sel.budget + r - 1);
                            let mut toks: Vec<u32> = ops::partial_sort_top_k(&tok_score, width)
                                .into_iter()
                                .map(|t| t as u32)
                                .collect();
                            toks.sort_unstable();
                            toks
                        }
                    })
                })
                .collect()
        });
        Ok(CpuSelection(rows?))
    }

    fn select_causal(&self, positions: &CpuIds) -> Result<CpuSelection> {
        Ok(CpuSelection(
            positions.0.iter().map(|&p| (0..=p).collect()).collect(),
        ))
    }

    fn attend(
        &self,
        q: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        sel: &CpuSelection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<CpuBuf> {
        let AttnDims {
            n_head,
            n_head_kv,
            head_dim,
        } = dims;
        let kv_cols = n_head_kv * head_dim;
        let ok = n_head_kv > 0
            && n_head % n_head_kv == 0
            && q.cols == n_head * head_dim
            && k_cache.cols == kv_cols
            && v_cache.cols == kv_cols
            && k_cache.rows == v_cache.rows
            && sel.0.len() == q.rows
            && sel.0.iter().flatten().all(|&t| (t as usize) < k_cache.rows);
        if !ok {
            return Err(EngineError::shape(
                "attend",
                format!(
                    "q {}×{}, caches {}×{} / {}×{}, {dims:?}",
                    q.rows, q.cols, k_cache.rows, k_cache.cols, v_cache.rows, v_cache.cols
                ),
            ));
        }
        let group = n_head / n_head_kv;
        let mut out = vec![0f32; q.data.len()];
        self.pool.install(|| {
            out.par_chunks_mut(head_dim).enumerate().for_each(|(i, o)| {
                let (row, h) = (i / n_head, i % n_head);
                let qh = &q.row(row)[h * head_dim..(h + 1) * head_dim];
                let off = (h / group) * head_dim;
                ops::attend_head(
                    qh,
                    &k_cache.data,
                    &v_cache.data,
                    kv_cols,
                    off,
                    &sel.0[row],
                    kv == KvType::F16,
                    o,
                );
            })
        });
        CpuBuf::new(q.rows, q.cols, out)
    }

    fn ple_gate(&self, k: &CpuBuf, q: &CpuBuf, v: &CpuBuf, streams: usize) -> Result<CpuBuf> {
        Self::same_shape("ple_gate", k, q)?;
        let h = v.cols;
        if v.rows != k.rows || h * streams != k.cols {
            return Err(EngineError::shape(
                "ple_gate",
                format!(
                    "K {}×{}, V {}×{h}, {streams} streams",
                    k.rows, k.cols, v.rows
                ),
            ));
        }
        let inv = 1.0 / (h as f32).sqrt();
        let mut out = vec![0f32; k.data.len()];
        for r in 0..k.rows {
            let (kr, qr, vr) = (k.row(r), q.row(r), v.row(r));
            for s in 0..streams {
                let z: f32 = kr[s * h..(s + 1) * h]
                    .iter()
                    .zip(&qr[s * h..(s + 1) * h])
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    * inv;
                let signed = if z > 0.0 {
                    z.abs().max(1e-6).sqrt()
                } else if z < 0.0 {
                    -z.abs().max(1e-6).sqrt()
                } else {
                    0.0
                };
                let gamma = ops::sigmoid(signed);
                for (o, &vv) in out[(r * streams + s) * h..][..h].iter_mut().zip(vr) {
                    *o = gamma * vv;
                }
            }
        }
        CpuBuf::new(k.rows, k.cols, out)
    }
}
