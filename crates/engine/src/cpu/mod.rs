//! The CPU backend: the first implementation of [`Backend`] and the reference the others are
//! measured against. Buffers are plain `Vec<f32>`; weights stay in the memory-mapped file; work is
//! spread over a private rayon pool (`threads`), always by whole rows or whole dot products, so
//! results do not depend on the thread count.

mod attn;
mod matmul;
pub(crate) mod ops;

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::{GgmlType, Isa};

use crate::backend::{
    AttnDims, Backend, DeviceBuf, DeviceWeight, ExpertWeights, GdnParams, HcWeights, KvType,
    QsaRule, QsaSelect, Usage,
};
use crate::error::{EngineError, Result};

/// Element-wise operations split their work only in pieces at least this long (a prefill's
/// activations; a decode step's rows stay on one thread).
const ELEMENTWISE_MIN: usize = 1 << 15;

/// A row-major f32 buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuBuf {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl CpuBuf {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<CpuBuf> {
        if data.len() != rows * cols {
            return Err(EngineError::shape(
                "buffer",
                format!("{} values for {rows}×{cols}", data.len()),
            ));
        }
        Ok(CpuBuf { rows, cols, data })
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

impl DeviceBuf for CpuBuf {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// A weight borrowed from the mapped file (never copied), with an f32 image made on first use for
/// the small tensors that are read element-wise.
pub struct CpuWeight {
    file: Arc<GgufFile>,
    info: TensorInfo,
    ty: GgmlType,
    values: OnceLock<Vec<f32>>,
}

impl CpuWeight {
    pub fn bytes(&self) -> Result<&[u8]> {
        Ok(self.file.tensor_data(&self.info)?)
    }

    /// The whole tensor as f32 (dequantized once, then cached).
    pub fn values(&self) -> Result<&[f32]> {
        if let Some(v) = self.values.get() {
            return Ok(v);
        }
        let n = usize::try_from(self.info.n_elements).map_err(|_| {
            EngineError::shape("weight", format!("{}: too many elements", self.info.name))
        })?;
        let mut v = vec![0f32; n];
        strata_quant::dequantize(self.ty, self.bytes()?, &mut v)?;
        Ok(self.values.get_or_init(|| v))
    }

    fn row_len(&self) -> usize {
        self.info.ne(0) as usize
    }

    /// Rows of one matrix (`dims[1]`; 1 for a vector).
    fn n_rows2(&self) -> usize {
        self.info.ne(1) as usize
    }
}

impl DeviceWeight for CpuWeight {
    fn name(&self) -> &str {
        &self.info.name
    }
    fn ty(&self) -> GgmlType {
        self.ty
    }
    fn dims(&self) -> &[u64] {
        &self.info.dims
    }
}

/// How activations meet float (F16/BF16) weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FloatActivations {
    /// Rounded to the weight's own format first (FORMATS.md pairing, as llama.cpp does): the
    /// project's contract, and the default.
    #[default]
    Paired,
    /// Kept in f32 against the widened weight row: an exact mode for isolating activation
    /// rounding in tests. Block-quantized weights always use their paired format.
    F32,
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    isa: Isa,
    float_activations: FloatActivations,
}

impl CpuBackend {
    /// A backend running on `threads` threads (0: one per core).
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("strata-cpu-{i}"))
            .build()
            .map_err(|e| EngineError::Input(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(CpuBackend {
            pool,
            isa: strata_quant::simd::best(),
            float_activations: FloatActivations::Paired,
        })
    }

    /// Chooses how activations meet F16/BF16 weights (default: [`FloatActivations::Paired`]).
    pub fn with_float_activations(mut self, mode: FloatActivations) -> CpuBackend {
        self.float_activations = mode;
        self
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    fn same_shape(op: &'static str, a: &CpuBuf, b: &CpuBuf) -> Result<()> {
        if a.rows != b.rows || a.cols != b.cols {
            return Err(EngineError::shape(
                op,
                format!("{}×{} vs {}×{}", a.rows, a.cols, b.rows, b.cols),
            ));
        }
        Ok(())
    }

    /// Matrix product against the `slab`-th `[m, k]` matrix of a (possibly 3-D) weight.
    fn matmul_slab(&self, w: &CpuWeight, slab: usize, x: &[f32]) -> Result<Vec<f32>> {
        self.matmul_slab_shared(w, slab, x, &mut Vec::new())
    }

    /// [`Self::matmul_slab`] with `x` quantized at most once per activation format across
    /// calls that pass the same `prepared` (which must only ever hold `x`'s rows).
    fn matmul_slab_shared(
        &self,
        w: &CpuWeight,
        slab: usize,
        x: &[f32],
        prepared: &mut Vec<matmul::Prepared>,
    ) -> Result<Vec<f32>> {
        let k = w.row_len();
        let m = w.n_rows2();
        let row_bytes = w.ty.row_bytes(k).ok_or_else(|| {
            EngineError::shape(
                "matmul",
                format!("{}: rows of {k} are not whole blocks", w.name()),
            )
        })?;
        let slab_bytes = m * row_bytes;
        let all = w.bytes()?;
        let bytes = all
            .get(slab * slab_bytes..(slab + 1) * slab_bytes)
            .ok_or_else(|| {
                EngineError::shape("matmul", format!("{}: no matrix {slab}", w.name()))
            })?;
        if self.float_activations == FloatActivations::F32
            && matches!(w.ty, GgmlType::F16 | GgmlType::BF16)
        {
            return matmul::matmul_widened(self.isa, w.ty, bytes, m, k, x, w.name());
        }
        let xty = w.ty.vec_dot_type();
        let i = match prepared.iter().position(|p| Some(p.ty) == xty && p.k == k) {
            Some(i) => i,
            None => {
                prepared.push(matmul::prepare(self.isa, w.ty, x, k, w.name())?);
                prepared.len() - 1
            }
        };
        matmul::matmul_prepared(self.isa, w.ty, bytes, m, &prepared[i], w.name())
    }

    /// A matrix weight whose rows take `x`'s rows.
    fn check_matmul(w: &CpuWeight, x: &CpuBuf) -> Result<()> {
        if w.info.dims.len() > 2 {
            return Err(EngineError::shape(
                "matmul",
                format!("{} is not a matrix", w.name()),
            ));
        }
        if x.cols != w.row_len() {
            return Err(EngineError::shape(
                "matmul",
                format!(
                    "{}: rows of {} against weight rows of {}",
                    w.name(),
                    x.cols,
                    w.row_len()
                ),
            ));
        }
        Ok(())
    }
}

/// Per query row: the attended token positions, ascending.
pub struct CpuSelection(pub Vec<Vec<u32>>);

/// Per row: `(expert, weight)` in rank order.
pub struct CpuRoutes(pub Vec<Vec<(u32, f32)>>);

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type Weight = CpuWeight;
    type Routes = CpuRoutes;
    type Selection = CpuSelection;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn supports(&self, ty: GgmlType, usage: Usage) -> bool {
        let f = strata_quant::format_fns(ty);
        match usage {
            Usage::MatMul => {
                let Some(xty) = ty.vec_dot_type() else {
                    return false;
                };
                strata_quant::dot_fn(ty, self.isa).is_some()
                    && (xty == GgmlType::F32 || strata_quant::format_fns(xty).quantize.is_some())
            }
            Usage::Rows | Usage::Values => f.dequantize.is_some(),
        }
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> Result<CpuWeight> {
        let ty = file.tensor_type(info)?;
        // Touch the bytes once so a truncated file fails here, not in the middle of a forward.
        file.tensor_data(info)?;
        Ok(CpuWeight {
            file: Arc::clone(file),
            info: info.clone(),
            ty,
            values: OnceLock::new(),
        })
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, vec![0.0; rows * cols])
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, data.to_vec())
    }

    fn download(&self, x: &CpuBuf) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn copy(&self, x: &CpuBuf) -> Result<CpuBuf> {
        Ok(x.clone())
    }

    fn reshape(&self, x: CpuBuf, rows: usize, cols: usize) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, x.data)
    }

    fn append_rows(&self, dst: &mut CpuBuf, src: &CpuBuf) -> Result<()> {
        if dst.cols != src.cols {
            return Err(EngineError::shape(
                "append_rows",
                format!("rows of {} onto rows of {}", src.cols, dst.cols),
            ));
        }
        dst.data.extend_from_slice(&src.data);
        dst.rows += src.rows;
        Ok(())
    }

    fn truncate_rows(&self, dst: &mut CpuBuf, rows: usize) -> Result<()> {
        if rows > dst.rows {
            return Err(EngineError::shape(
                "truncate_rows",
                format!("{rows} rows asked of a buffer of {}", dst.rows),
            ));
        }
        dst.rows = rows;
        dst.data.truncate(rows * dst.cols);
        Ok(())
    }

    fn slice_cols(&self, x: &CpuBuf, start: usize, len: usize) -> Result<CpuBuf> {
        if start + len > x.cols {
            return Err(EngineError::shape(
                "slice_cols",
                format!("columns {start}..{} of rows of {}", start + len, x.cols),
            ));
        }
        let mut data = Vec::with_capacity(x.rows * len);
        for r in 0..x.rows {
            data.extend_from_slice(&x.row(r)[start..start + len]);
        }
        CpuBuf::new(x.rows, len, data)
    }

    fn deinterleave(&self, x: &CpuBuf, chunk: usize, parts: usize) -> Result<Vec<CpuBuf>> {
        if chunk == 0 || parts == 0 || !x.cols.is_multiple_of(chunk * parts) {
            return Err(EngineError::shape(
                "deinterleave",
                format!("rows of {} into {parts} parts of {chunk}", x.cols),
            ));
        }
        let mut outs: Vec<Vec<f32>> = vec![Vec::with_capacity(x.data.len() / parts); parts];
        for (i, c) in x.data.chunks(chunk).enumerate() {
            outs[i % parts].extend_from_slice(c);
        }
        outs.into_iter()
            .map(|d| CpuBuf::new(x.rows, x.cols / parts, d))
            .collect()
    }

    fn add_assign(&self, x: &mut CpuBuf, y: &CpuBuf) -> Result<()> {
        Self::same_shape("add_assign", x, y)?;
        self.pool.install(|| {
            x.data
                .par_iter_mut()
                .with_min_len(ELEMENTWISE_MIN)
                .zip(y.data.par_iter())
                .for_each(|(a, b)| *a += b)
        });
        Ok(())
    }

    fn embed_rows(&self, table: &CpuWeight, ids: &[u32], copies: usize) -> Result<CpuBuf> {
        let k = table.row_len();
        let rows = table.info.n_rows() as usize;
        let row_bytes = table.ty.row_bytes(k).ok_or_else(|| {
            EngineError::shape(
                "embed_rows",
                format!("{}: rows of {k} are not whole blocks", table.name()),
            )
        })?;
        let bytes = table.bytes()?;
        let mut out = vec![0f32; ids.len() * k * copies];
        self.pool.install(|| {
            out.par_chunks_mut(k * copies)
                .zip(ids.par_iter())
                .try_for_each(|(o, &id)| -> Result<()> {
                    let id = id as usize;
                    if id >= rows {
                        return Err(EngineError::Input(format!(
                            "row {id} of '{}' asked for; it has {rows} rows",
                            table.name()
                        )));
                    }
                    let src = &bytes[id * row_bytes..(id + 1) * row_bytes];
                    let (first, rest) = o.split_at_mut(k);
                    strata_quant::dequantize(table.ty, src, first)?;
                    for c in rest.chunks_mut(k) {
                        c.copy_from_slice(first);
                    }
                    Ok(())
                })
        })?;
        CpuBuf::new(ids.len(), k * copies, out)
    }

    fn matmul(&self, w: &CpuWeight, x: &CpuBuf) -> Result<CpuBuf> {
        Self::check_matmul(w, x)?;
        let m = w.n_rows2();
        let y = self.pool.install(|| self.matmul_slab(w, 0, &x.data))?;
        CpuBuf::new(x.rows, m, y)
    }

    fn matmuls<const N: usize>(&self, ws: [&CpuWeight; N], x: &CpuBuf) -> Result<[CpuBuf; N]> {
        for w in ws {
            Self::check_matmul(w, x)?;
        }
        let ys = self.pool.install(|| -> Result<Vec<CpuBuf>> {
            let mut prepared = Vec::new();
            ws.iter()
                .map(|w| {
                    let y = self.matmul_slab_shared(w, 0, &x.data, &mut prepared)?;
                    CpuBuf::new(x.rows, w.n_rows2(), y)
                })
                .collect()
        })?;
        ys.try_into()
            .map_err(|_| EngineError::shape("matmuls", "product count"))
    }

    fn matmul_rows(&self, w: &CpuWeight, rows: &[u32], x: &CpuBuf) -> Result<CpuBuf> {
        let k = w.row_len();
        if w.info.dims.len() > 2 || x.cols != k {
            return Err(EngineError::shape(
                "matmul_rows",
                format!(
                    "{}: rows of {} against weight {:?}",
                    w.name(),
                    x.cols,
                    w.dims()
                ),
            ));
        }
        let widen = self.float_activations == FloatActivations::F32
            && matches!(w.ty, GgmlType::F16 | GgmlType::BF16);
        let y = self.pool.install(|| -> Result<Vec<f32>> {
            let xp = if widen {
                matmul::prepare_f32(&x.data, k, w.name())?
            } else {
                matmul::prepare(self.isa, w.ty, &x.data, k, w.name())?
            };
            matmul::matmul_rows(self.isa, w.ty, w.bytes()?, w.n_rows2(), rows, &xp, w.name())
        })?;
        CpuBuf::new(x.rows, rows.len(), y)
    }

    fn rms_norm(&self, x: &CpuBuf, w: &CpuWeight, group: usize, eps: f32) -> Result<CpuBuf> {
        let wv = w.values()?;
        if group == 0 || !x.cols.is_multiple_of(group) || (wv.len() != x.cols && wv.len() != group)
        {
            return Err(EngineError::shape(
                "rms_norm",
                format!(
                    "{}: {} weights, rows of {} in groups of {group}",
                    w.name(),
                    wv.len(),
                    x.cols
                ),
            ));
        }
        let mut out = vec![0f32; x.data.len()];
        self.pool.install(|| {
            ops::for_rows(&mut out, x.cols, |r, o| {
                ops::rms_norm_row(x.row(r), wv, group, eps, o)
            })
        });
        CpuBuf::new(x.rows, x.cols, out)
    }

    fn rope_neox(
        &self,
        x: &mut CpuBuf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &[u32],
    ) -> Result<()> {
        if positions.len() != x.rows
            || head_dim == 0
            || !x.cols.is_multiple_of(head_dim)
            || rot > head_dim
            || !rot.is_multiple_of(2)
        {
            return Err(EngineError::shape(
                "rope_neox",
                format!(
                    "{} positions for {} rows of {} (head {head_dim}, rot {rot})",
                    positions.len(),
                    x.rows,
                    x.cols
                ),
            ));
        }
        let freqs = ops::rope_freqs(rot, theta);
        let cols = x.cols;
        self.pool.install(|| {
            ops::for_rows(&mut x.data, cols, |r, row| {
                ops::rope_row(row, head_dim, &freqs, positions[r])
            })
        });
        Ok(())
    }

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
        let xn = self.rms_norm(x, hc.norm, h, hc.eps)?;
        let inv_s = 1.0 / s as f32;
        let mut a = self.matmul(hc.down, &xn)?;
        for v in a.data.iter_mut() {
            *v = ops::silu(*v * inv_s);
        }
        let g = self.matmul(hc.up, &a)?;
        Self::same_shape("hc_mix (up)", &g, &xn)?;
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
                let mut inj = self.matmul(wi, &xn)?;
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

    fn hc_combine(&self, x: &mut CpuBuf, y: &CpuBuf, inj: &CpuBuf) -> Result<()> {
        let s = inj.cols;
        if y.rows != x.rows || inj.rows != x.rows || y.cols * s != x.cols {
            return Err(EngineError::shape(
                "hc_combine",
                format!(
                    "x {}×{}, y {}×{}, inj {}×{}",
                    x.rows, x.cols, y.rows, y.cols, inj.rows, s
                ),
            ));
        }
        let h = y.cols;
        for r in 0..x.rows {
            let (yr, ir) = (y.row(r), inj.row(r));
            let xr = &mut x.data[r * s * h..(r + 1) * s * h];
            for (st, &w) in ir.iter().enumerate() {
                for (xv, &yv) in xr[st * h..(st + 1) * h].iter_mut().zip(yr) {
                    *xv += w * yv;
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

    fn qsa_pool_blocks(
        &self,
        kraw: &CpuBuf,
        first: usize,
        count: usize,
        ratio: usize,
    ) -> Result<CpuBuf> {
        if ratio == 0 || (first + count) * ratio > kraw.rows {
            return Err(EngineError::shape(
                "qsa_pool_blocks",
                format!(
                    "blocks {first}..{} of {ratio} from {} keys",
                    first + count,
                    kraw.rows
                ),
            ));
        }
        let d = kraw.cols;
        let mut out = vec![0f32; count * d];
        for (bi, o) in out.chunks_mut(d).enumerate() {
            let b = first + bi;
            for r in b * ratio..(b + 1) * ratio {
                for (a, &v) in o.iter_mut().zip(kraw.row(r)) {
                    *a += v;
                }
            }
            for a in o.iter_mut() {
                *a /= ratio as f32;
            }
        }
        CpuBuf::new(count, d, out)
    }

    fn qsa_select(
        &self,
        qi: &CpuBuf,
        blocks: &CpuBuf,
        positions: &[u32],
        sel: QsaSelect,
    ) -> Result<CpuSelection> {
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

    fn select_causal(&self, positions: &[u32]) -> Result<CpuSelection> {
        Ok(CpuSelection(
            positions.iter().map(|&p| (0..=p).collect()).collect(),
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

    fn mul_sigmoid(&self, x: &CpuBuf, gate: &CpuBuf) -> Result<CpuBuf> {
        Self::same_shape("mul_sigmoid", x, gate)?;
        let data = x
            .data
            .iter()
            .zip(&gate.data)
            .map(|(&a, &g)| a * ops::sigmoid(g))
            .collect();
        CpuBuf::new(x.rows, x.cols, data)
    }

    fn route(&self, logits: &CpuBuf, k: usize) -> Result<CpuRoutes> {
        if k == 0 || k > logits.cols {
            return Err(EngineError::shape(
                "route",
                format!("top {k} of {} experts", logits.cols),
            ));
        }
        Ok(CpuRoutes(
            (0..logits.rows)
                .map(|r| ops::route_row(logits.row(r), k))
                .collect(),
        ))
    }

    fn moe_experts(
        &self,
        ex: &ExpertWeights<'_, CpuWeight>,
        x: &CpuBuf,
        routes: &CpuRoutes,
    ) -> Result<CpuBuf> {
        let n_expert = ex.gate.info.ne(2) as usize;
        let hdim = x.cols;
        if routes.0.len() != x.rows
            || ex.gate.row_len() != hdim
            || ex.up.row_len() != hdim
            || ex.down.n_rows2() != hdim
            || ex.down.row_len() != ex.gate.n_rows2()
        {
            return Err(EngineError::shape(
                "moe_experts",
                format!(
                    "{} rows of {hdim} for experts {:?}/{:?}/{:?}",
                    x.rows,
                    ex.gate.dims(),
                    ex.up.dims(),
                    ex.down.dims()
                ),
            ));
        }
        // Group rows by expert so a prefill runs each expert once over all its rows; each row's
        // products are the same dot calls on the same bytes as in a batch of one.
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_expert];
        for (r, rt) in routes.0.iter().enumerate() {
            for (slot, &(e, _)) in rt.iter().enumerate() {
                let e = e as usize;
                if e >= n_expert {
                    return Err(EngineError::shape(
                        "moe_experts",
                        format!("expert {e} of {n_expert}"),
                    ));
                }
                by_expert[e].push((r, slot));
            }
        }
        let slots = routes.0.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut per_slot = vec![0f32; x.rows * slots * hdim];
        // Experts run side by side (each still splits its rows when it is large enough): a
        // decode step's few small expert products would leave threads idle one at a time.
        let outs = self.pool.install(|| -> Result<Vec<(usize, Vec<f32>)>> {
            by_expert
                .par_iter()
                .enumerate()
                .filter(|(_, members)| !members.is_empty())
                .map(|(e, members)| {
                    let mut xe = Vec::with_capacity(members.len() * hdim);
                    for &(r, _) in members {
                        xe.extend_from_slice(x.row(r));
                    }
                    let mut prepared = Vec::new();
                    let g = self.matmul_slab_shared(ex.gate, e, &xe, &mut prepared)?;
                    let u = self.matmul_slab_shared(ex.up, e, &xe, &mut prepared)?;
                    let act: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| ops::silu(a) * b).collect();
                    Ok((e, self.matmul_slab(ex.down, e, &act)?))
                })
                .collect()
        })?;
        for (e, y) in outs {
            for (i, &(r, slot)) in by_expert[e].iter().enumerate() {
                per_slot[(r * slots + slot) * hdim..][..hdim]
                    .copy_from_slice(&y[i * hdim..(i + 1) * hdim]);
            }
        }
        let mut out = vec![0f32; x.rows * hdim];
        for (r, rt) in routes.0.iter().enumerate() {
            let o = &mut out[r * hdim..(r + 1) * hdim];
            for (slot, &(_, w)) in rt.iter().enumerate() {
                let y = &per_slot[(r * slots + slot) * hdim..][..hdim];
                for (a, &b) in o.iter_mut().zip(y) {
                    *a += w * b;
                }
            }
        }
        CpuBuf::new(x.rows, hdim, out)
    }

    fn swiglu(&self, g: &CpuBuf, u: &CpuBuf) -> Result<CpuBuf> {
        Self::same_shape("swiglu", g, u)?;
        let data = self.pool.install(|| {
            g.data
                .par_iter()
                .with_min_len(ELEMENTWISE_MIN)
                .zip(u.data.par_iter())
                .map(|(&a, &b)| ops::silu(a) * b)
                .collect()
        });
        CpuBuf::new(g.rows, g.cols, data)
    }

    fn add_sigmoid_gated(&self, y: &mut CpuBuf, x: &CpuBuf, gate: &CpuBuf) -> Result<()> {
        Self::same_shape("add_sigmoid_gated", y, x)?;
        if gate.rows != y.rows || gate.cols != 1 {
            return Err(EngineError::shape(
                "add_sigmoid_gated",
                format!("gate {}×{}", gate.rows, gate.cols),
            ));
        }
        let cols = y.cols;
        for r in 0..y.rows {
            let gsig = ops::sigmoid(gate.data[r]);
            for (a, &b) in y.data[r * cols..(r + 1) * cols].iter_mut().zip(x.row(r)) {
                *a += gsig * b;
            }
        }
        Ok(())
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

    fn add_bias(&self, x: &mut CpuBuf, b: &CpuWeight) -> Result<()> {
        let bv = b.values()?;
        if bv.len() != x.cols {
            return Err(EngineError::shape(
                "add_bias",
                format!("{}: {} values for rows of {}", b.name(), bv.len(), x.cols),
            ));
        }
        if x.cols == 0 {
            return Ok(());
        }
        for row in x.data.chunks_mut(x.cols) {
            for (a, &v) in row.iter_mut().zip(bv) {
                *a += v;
            }
        }
        Ok(())
    }

    fn append_kv(&self, cache: &mut CpuBuf, x: &CpuBuf, kv: KvType) -> Result<()> {
        let start = cache.data.len();
        self.append_rows(cache, x)?;
        if kv == KvType::F16 {
            attn::round_f16(&mut cache.data[start..]);
        }
        Ok(())
    }

    fn attend_causal(
        &self,
        q: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        positions: &[u32],
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
            && positions.len() == q.rows
            && positions.iter().all(|&p| (p as usize) < k_cache.rows);
        if !ok {
            return Err(EngineError::shape(
                "attend_causal",
                format!(
                    "q {}×{}, caches {}×{} / {}×{}, {} positions, {dims:?}",
                    q.rows,
                    q.cols,
                    k_cache.rows,
                    k_cache.cols,
                    v_cache.rows,
                    v_cache.cols,
                    positions.len()
                ),
            ));
        }
        let group = n_head / n_head_kv;
        let mut out = vec![0f32; q.data.len()];
        if head_dim == 0 {
            return CpuBuf::new(q.rows, q.cols, out);
        }
        self.pool.install(|| {
            out.par_chunks_mut(head_dim)
                .enumerate()
                .for_each_init(Vec::new, |scores, (i, o)| {
                    let (row, h) = (i / n_head, i % n_head);
                    attn::causal_head(
                        &q.row(row)[h * head_dim..(h + 1) * head_dim],
                        &k_cache.data,
                        &v_cache.data,
                        kv_cols,
                        (h / group) * head_dim,
                        positions[row] as usize + 1,
                        kv == KvType::F16,
                        scores,
                        o,
                    )
                })
        });
        CpuBuf::new(q.rows, q.cols, out)
    }

    fn scoped<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
