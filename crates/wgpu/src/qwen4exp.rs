//! qwen4exp's family operations ([`Qwen4expOps`]) on [`WgpuBackend`]: hyper-connection mix and
//! combine, the GDN conv and recurrence, the QSA pooling, selection and sparse attention, and
//! the PLE gate, each as `model.wgsl` entries that follow the CPU's versions
//! (`strata_engine::cpu`, the reference) operation for operation.

use std::sync::Arc;

use strata_engine::backend::{AttnDims, Backend, KvType};
use strata_engine::qwen4exp::ops::{GdnParams, HcWeights, QsaRule, QsaSelect, Qwen4expOps};
use strata_engine::Result;

use crate::backend::{shape, u32_of, Epi, Sel, WBuf, WIds, WWeight, WgpuBackend};
use crate::device::Buf;

/// QSA decisions: dense causal rows, or per row `[count, tokens ascending]` on the device.
pub enum WSelection {
    Causal(WIds),
    Sparse {
        b: Arc<Buf>,
        stride: usize,
        rows: usize,
    },
}

impl Qwen4expOps for WgpuBackend {
    type Selection = WSelection;

    fn hc_mix(&self, hc: &HcWeights<'_, WWeight>, x: &WBuf) -> Result<(WBuf, Option<WBuf>)> {
        let s = hc.streams;
        if s == 0 || !x.cols.is_multiple_of(s) {
            return Err(shape(
                "hc_mix",
                format!("rows of {} in {s} streams", x.cols),
            ));
        }
        let h = x.cols / s;
        let xn = self.rms_norm(x, hc.norm, h, hc.eps)?;
        let inv_s = 1.0 / s as f32;
        // The down and inject products share xn's activation image (one image dispatch). Fused:
        // silu(a/S) and 2σ(inj/S) are the products' epilogues; else element-wise dispatches
        // after them (the baseline; the same bits).
        let (da, di) = if self.fuse {
            (Epi(5, inv_s), Epi(6, inv_s))
        } else {
            (Epi::NONE, Epi::NONE)
        };
        let (a, inj) = match hc.inject {
            Some(wi) => {
                let [a, inj] = self.matmuls_epi([(hc.down, da), (wi, di)], &xn)?;
                (a, Some(inj))
            }
            None => {
                let [a] = self.matmuls_epi([(hc.down, da)], &xn)?;
                (a, None)
            }
        };
        if !self.fuse {
            self.model_n(
                "eltwise",
                &[u32_of("hc_mix", a.rows * a.cols)?, 5, 0, inv_s.to_bits()],
                [Some(&a.b), None, None, None, None],
                [None; 3],
                a.rows * a.cols,
            )?;
        }
        let g = self.matmul(hc.up, &a)?;
        if g.rows != xn.rows || g.cols != xn.cols {
            return Err(shape(
                "hc_mix (up)",
                format!("{}×{} vs {}×{}", g.rows, g.cols, xn.rows, xn.cols),
            ));
        }
        let u = self.buf("hc_mix", x.rows, h)?;
        self.model_n(
            "hc_u",
            &[
                u32_of("hc_mix", x.rows)?,
                u32_of("hc_mix", s)?,
                u32_of("hc_mix", h)?,
                inv_s.to_bits(),
            ],
            [Some(&g.b), Some(&xn.b), Some(&u.b), None, None],
            [None; 3],
            x.rows * h,
        )?;
        let inj = match inj {
            Some(inj) => {
                if inj.cols != s {
                    return Err(shape(
                        "hc_mix",
                        format!("{} inject weights for {s} streams", inj.cols),
                    ));
                }
                if !self.fuse {
                    self.model_n(
                        "eltwise",
                        &[u32_of("hc_mix", inj.rows * s)?, 6, 0, inv_s.to_bits()],
                        [Some(&inj.b), None, None, None, None],
                        [None; 3],
                        inj.rows * s,
                    )?;
                }
                Some(inj)
            }
            None => None,
        };
        Ok((u, inj))
    }

    fn hc_combine(&self, x: &mut WBuf, y: &WBuf, inj: Option<&WBuf>) -> Result<()> {
        let s = match inj {
            Some(w) => w.cols,
            None => x.cols.checked_div(y.cols).unwrap_or(0),
        };
        let rows_ok = inj.is_none_or(|w| w.rows == x.rows);
        if y.rows != x.rows || !rows_ok || y.cols * s != x.cols {
            return Err(shape(
                "hc_combine",
                format!(
                    "x {}×{}, y {}×{}, {s} streams",
                    x.rows, x.cols, y.rows, y.cols
                ),
            ));
        }
        let op = "hc_combine";
        self.model_n(
            "hc_combine",
            &[
                u32_of(op, x.rows)?,
                u32_of(op, s)?,
                u32_of(op, y.cols)?,
                inj.is_some() as u32,
            ],
            [Some(&x.b), Some(&y.b), inj.map(|w| &*w.b), None, None],
            [None; 3],
            x.rows * x.cols,
        )
    }

    fn conv1d_silu(
        &self,
        x: &WBuf,
        w: &WWeight,
        history: &mut WBuf,
        dilation: usize,
    ) -> Result<WBuf> {
        let op = "conv1d_silu";
        let c = x.cols;
        let k = w.row_len;
        let (wv, wn) = w.values()?;
        let hist = (k.max(1) - 1) * dilation;
        if wn != c * k || history.cols != c || history.rows != hist {
            return Err(shape(
                op,
                format!(
                    "kernel {k}×{} for {c} channels, history {}×{} (expected {hist} rows)",
                    wn / k.max(1),
                    history.rows,
                    history.cols
                ),
            ));
        }
        let out = self.buf(op, x.rows, c)?;
        let p = [
            u32_of(op, x.rows)?,
            u32_of(op, c)?,
            u32_of(op, k)?,
            u32_of(op, dilation)?,
            u32_of(op, hist)?,
        ];
        self.model_n(
            "conv_silu",
            &p,
            [Some(&x.b), Some(wv), Some(&history.b), Some(&out.b), None],
            [None; 3],
            x.rows * c,
        )?;
        if hist > 0 {
            let tail = self.buf(op, hist, c)?;
            self.model_n(
                "conv_tail",
                &p,
                [Some(&x.b), None, Some(&history.b), Some(&tail.b), None],
                [None; 3],
                hist * c,
            )?;
            self.copy_rows(&tail.b, &history.b, 1, hist * c, 0, 0, 0, 0)?;
        }
        Ok(out)
    }

    fn gdn_step(
        &self,
        p: &GdnParams<'_, WWeight>,
        qkv: &WBuf,
        z: &WBuf,
        a: &WBuf,
        b: &WBuf,
        state: &mut WBuf,
    ) -> Result<WBuf> {
        let op = "gdn_step";
        let d = p.dims;
        let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.head_k, d.head_v);
        let n = qkv.rows;
        let ((av, an), (dtv, dtn), (nw, nn)) =
            (p.a.values()?, p.dt_bias.values()?, p.norm.values()?);
        let ok = nk > 0
            && nv % nk == 0
            && qkv.cols == d.conv_dim()
            && z.cols == d.value_dim()
            && a.cols == nv
            && b.cols == nv
            && z.rows == n
            && a.rows == n
            && b.rows == n
            && an == nv
            && dtn == nv
            && nn == dv
            && state.rows == nv
            && state.cols == dk * dv
            && dk <= 256
            && dv <= 256;
        if !ok {
            return Err(shape(
                op,
                format!(
                    "qkv {}×{}, z {}×{}, a/b {}/{}, state {}×{} for {d:?} (heads up to 256)",
                    qkv.rows, qkv.cols, z.rows, z.cols, a.cols, b.cols, state.rows, state.cols
                ),
            ));
        }
        let out = self.buf(op, n, d.value_dim())?;
        if n == 0 {
            return Ok(out);
        }
        let gates = self.buf(op, n, 2 * nv)?;
        self.model_n(
            "gdn_gates",
            &[u32_of(op, n)?, u32_of(op, nv)?],
            [Some(&a.b), Some(&b.b), Some(av), Some(dtv), Some(&gates.b)],
            [None; 3],
            n * nv,
        )?;
        let (entry, nt) = if self.seq_wg() {
            ("gdn_wg", 128)
        } else {
            ("gdn", 64)
        };
        // The rows in order, a range a dispatch where the adapter is a CPU (lavapipe's loop
        // limiter, docs/WGPU.md: one invocation runs every row of its dispatch), the state
        // carried in place between dispatches: the same operations in the same order.
        let span = if self.g.is_cpu() {
            crate::backend::gdn_rows(dk, dv, nt)
        } else {
            n
        };
        let mut r0 = 0;
        while r0 < n {
            let r1 = (r0 + span).min(n);
            self.model(
                entry,
                &[
                    u32_of(op, r1)?,
                    u32_of(op, nk)?,
                    u32_of(op, nv)?,
                    u32_of(op, dk)?,
                    u32_of(op, dv)?,
                    p.eps.to_bits(),
                    u32_of(op, r0)?,
                ],
                [
                    Some(&qkv.b),
                    Some(&z.b),
                    Some(&gates.b),
                    Some(&state.b),
                    Some(&out.b),
                ],
                [Some(nw), None, None],
                (u32_of(op, nv)?, 1, 1),
            )?;
            r0 = r1;
        }
        Ok(out)
    }

    fn qsa_pool_blocks(&self, kraw: &WBuf, positions: &WIds, ratio: usize) -> Result<WBuf> {
        let op = "qsa_pool_blocks";
        if ratio == 0 {
            return Err(shape(op, "block size 0"));
        }
        let d = kraw.cols;
        let out = self.buf(op, positions.len, d)?;
        // Part by part in row order (one part unless the store is split); the sum is carried
        // in `out` between parts.
        let parts = kraw.row_parts();
        let last = parts.len() - 1;
        for (j, (kb, row0, rows)) in parts.into_iter().enumerate() {
            self.model_n(
                "qsa_pool",
                &[
                    u32_of(op, positions.len)?,
                    u32_of(op, d)?,
                    u32_of(op, ratio)?,
                    u32_of(op, kraw.rows)?,
                    u32_of(op, positions.off)?,
                    u32_of(op, row0)?,
                    u32_of(op, rows)?,
                    (j == 0) as u32,
                    (j == last) as u32,
                ],
                [Some(kb), Some(&out.b), None, None, None],
                [Some(&positions.b), None, None],
                positions.len * d,
            )?;
        }
        Ok(out)
    }

    fn qsa_select(
        &self,
        qi: &WBuf,
        blocks: &WBuf,
        positions: &WIds,
        sel: QsaSelect,
    ) -> Result<WSelection> {
        let op = "qsa_select";
        let d = blocks.cols;
        if d == 0 || !qi.cols.is_multiple_of(d) || positions.len != qi.rows || sel.ratio == 0 {
            return Err(shape(
                op,
                format!(
                    "queries {}×{}, blocks {}×{d}, {} positions",
                    qi.rows, qi.cols, blocks.rows, positions.len
                ),
            ));
        }
        let rows = qi.rows;
        let stride = sel.budget + sel.ratio;
        let nb_cap = blocks.rows.max(1);
        // Heap indices and flags: blocks (reference rule) or every visible token (llama.cpp's).
        let idx = match sel.rule {
            QsaRule::Reference => nb_cap,
            QsaRule::LlamaCpp => (nb_cap + 1) * sel.ratio,
        };
        let out = self.alloc("qsa selection", rows.max(1) * stride)?;
        let scores = self.alloc("qsa scores", rows.max(1) * nb_cap)?;
        // Heap indices and flags, then the selection's saved state (8 words).
        let scratch = self.alloc("qsa scratch", rows.max(1) * (2 * idx + 8))?;
        let rule = match sel.rule {
            QsaRule::Reference => 0,
            QsaRule::LlamaCpp => 1,
        };
        // Each part's blocks scored in turn (one part unless the store is split); the last
        // dispatch selects.
        let parts = blocks.row_parts();
        let mut p = vec![
            u32_of(op, rows)?,
            u32_of(op, qi.cols)?,
            u32_of(op, d)?,
            u32_of(op, sel.ratio)?,
            u32_of(op, sel.budget)?,
            rule,
            u32_of(op, stride)?,
            u32_of(op, blocks.rows)?,
            u32_of(op, positions.off)?,
            u32_of(op, nb_cap)?,
            u32_of(op, idx)?,
            0,
            0,
            0,
            0,
        ];
        if self.seq_wg() && qi.cols / d <= 256 {
            // The scores by a workgroup per (row, block), part by part; then one dispatch
            // selects (p12 = 0: it scores nothing).
            for (bb, row0, prows) in parts {
                let (gx, gy) = crate::backend::item_grid(rows * prows);
                p[11] = u32_of(op, row0)?;
                p[12] = u32_of(op, prows)?;
                p[14] = gx;
                self.model(
                    "qsa_score",
                    &p,
                    [Some(&qi.b), Some(bb), Some(&scores), None, None],
                    [Some(&positions.b), None, None],
                    (gx, gy, 1),
                )?;
            }
            self.qsa_selecting(
                &mut p,
                &qi.b,
                &scores,
                positions,
                &out,
                &scratch,
                sel,
                blocks.rows,
            )?;
            return Ok(WSelection::Sparse {
                b: out,
                stride,
                rows,
            });
        }
        // Where the adapter is a CPU, at most `qsa_blocks` blocks a dispatch (lavapipe's loop
        // limiter: one invocation scores every block of its dispatch for its row), the blocks
        // in order; a split scoring selects in a dispatch of its own (p12 = 0).
        let span = if self.g.is_cpu() {
            crate::backend::qsa_blocks(qi.cols / d, d)
        } else {
            usize::MAX
        };
        let mut ranges = Vec::new();
        for (bb, row0, prows) in parts {
            let mut lo = 0;
            loop {
                let n = (prows - lo).min(span);
                ranges.push((bb, row0, row0 + lo, n));
                lo += n;
                if lo >= prows {
                    break;
                }
            }
        }
        // A CPU adapter selects in dispatches of its own (their loop iterations bounded).
        let one = ranges.len() == 1 && !self.g.is_cpu();
        for (j, &(bb, part0, lo, n)) in ranges.iter().enumerate() {
            p[11] = u32_of(op, lo)?;
            p[12] = u32_of(op, n)?;
            p[13] = (one && j == 0) as u32;
            p[14] = u32_of(op, part0)?;
            self.model_n(
                "qsa_select",
                &p,
                [Some(&qi.b), Some(bb), Some(&scores), None, None],
                [Some(&positions.b), Some(&out), Some(&scratch)],
                rows,
            )?;
        }
        if !one {
            self.qsa_selecting(
                &mut p,
                &qi.b,
                &scores,
                positions,
                &out,
                &scratch,
                sel,
                blocks.rows,
            )?;
        }
        Ok(WSelection::Sparse {
            b: out,
            stride,
            rows,
        })
    }

    fn select_causal(&self, positions: &WIds) -> Result<WSelection> {
        Ok(WSelection::Causal(positions.clone()))
    }

    fn attend(
        &self,
        q: &WBuf,
        k_cache: &WBuf,
        v_cache: &WBuf,
        sel: &WSelection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<WBuf> {
        let s = match sel {
            WSelection::Causal(p) => Sel::Causal(p),
            WSelection::Sparse { b, stride, rows } => Sel::Sparse {
                b,
                stride: *stride,
                rows: *rows,
            },
        };
        self.attention(q, k_cache, v_cache, s, dims, kv, false)
    }

    fn ple_gate(&self, k: &WBuf, q: &WBuf, v: &WBuf, streams: usize) -> Result<WBuf> {
        let op = "ple_gate";
        let h = v.cols;
        if k.rows != q.rows || k.cols != q.cols || v.rows != k.rows || h * streams != k.cols {
            return Err(shape(
                op,
                format!(
                    "K {}×{}, V {}×{h}, {streams} streams",
                    k.rows, k.cols, v.rows
                ),
            ));
        }
        let out = self.buf(op, k.rows, k.cols)?;
        let inv = 1.0 / (h as f32).sqrt();
        self.model_n(
            "ple_gate",
            &[
                u32_of(op, k.rows)?,
                u32_of(op, streams)?,
                u32_of(op, h)?,
                inv.to_bits(),
            ],
            [Some(&k.b), Some(&q.b), Some(&v.b), Some(&out.b), None],
            [None; 3],
            k.rows * streams,
        )?;
        Ok(out)
    }
}

impl WgpuBackend {
    /// `qsa_select`'s selection after its scores (p12 = 0: it scores nothing): one dispatch,
    /// or where the adapter is a CPU as many as the selection's steps need at
    /// [`crate::backend::ATTEND_LOOP_BUDGET`] iterations a dispatch (lavapipe's loop
    /// limiter), each resuming the rows' saved state; a row already done returns at once.
    #[allow(clippy::too_many_arguments)]
    fn qsa_selecting(
        &self,
        p: &mut Vec<u32>,
        qi: &Buf,
        scores: &Buf,
        positions: &WIds,
        out: &Buf,
        scratch: &Buf,
        sel: QsaSelect,
        nblocks: usize,
    ) -> Result<()> {
        let rows = p[0] as usize;
        p.resize(16, 0);
        p[11] = 0;
        p[12] = 0;
        p[14] = 0;
        let (dispatches, fuel) = if self.g.is_cpu() {
            let fuel = crate::backend::ATTEND_LOOP_BUDGET;
            let (r, nb) = (sel.ratio, nblocks);
            let keep = (sel.budget / r).min(nb);
            let total = (nb + 1) * r;
            let k = total.min(sel.budget + r - 1);
            let step = 2 * (usize::BITS - k.max(1).leading_zeros()) as usize + 4;
            // Every step's iterations as the kernel charges them (a bound: the rows' blocks
            // are at most the store's), and a dispatch's least progress.
            let (work, least) = match sel.rule {
                QsaRule::Reference => (
                    3 * (nb + 1) + keep * (nb + 1) + keep * r + 2 * r + 4,
                    fuel - 4,
                ),
                QsaRule::LlamaCpp => {
                    let steps = 3 * (total + 1) + (k + 2) + (k / 2 + total + 2);
                    (5 * steps + (k / 2 + total + 2) * step, fuel - step - 13)
                }
            };
            (work.div_ceil(least) + 1, fuel as u32)
        } else {
            (1, 0)
        };
        for j in 0..dispatches {
            p[13] = if j == 0 { 1 } else { 2 };
            p[15] = fuel;
            self.model_n(
                "qsa_select",
                p,
                [Some(qi), Some(self.unused_f32()), Some(scores), None, None],
                [Some(&positions.b), Some(out), Some(scratch)],
                rows,
            )?;
        }
        Ok(())
    }
}
