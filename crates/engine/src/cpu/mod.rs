//! The CPU backend: the first implementation of [`Backend`] and the reference the others are
//! measured against. Buffers are plain `Vec<f32>`; weights stay in the memory-mapped file; work is
//! spread over a private rayon pool (`threads`), always by whole rows or whole dot products, so
//! results do not depend on the thread count.

mod attn;
mod matmul;
pub(crate) mod ops;
mod qwen4exp;

pub use qwen4exp::CpuSelection;

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::{GgmlType, Isa};

use crate::backend::{
    AttnDims, Backend, DeviceBuf, DeviceIds, DevicePick, DeviceWeight, ExpertWeights, KvType,
    Prepared, StepKey, Usage,
};
use crate::error::{EngineError, Result};
use crate::kernels;
use crate::kernels::embed::EmbedFn;
use crate::kernels::norm::{RmsNormFn, XprepFn, XprepPairFn};
use crate::kernels::pick::PickFn;
use crate::kernels::registry::Chosen;
use crate::kernels::route::RouteFn;
use crate::kernels::slop::SlopFn;

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

/// Step inputs: u32 values in host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuIds(pub Vec<u32>);

impl DeviceIds for CpuIds {
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A weight borrowed from the mapped file (never copied), with an f32 image made on first use for
/// the small tensors that are read element-wise.
pub struct CpuWeight {
    file: Arc<GgufFile>,
    info: TensorInfo,
    ty: GgmlType,
    values: OnceLock<Vec<f32>>,
    /// The backend's `embed` variant: the one dequantizer of every weight read as values.
    embed: Chosen<EmbedFn>,
}

impl CpuWeight {
    pub fn bytes(&self) -> Result<&[u8]> {
        Ok(self.file.tensor_data(&self.info)?)
    }

    /// The whole tensor as f32 (dequantized once by the catalogue's `embed`, every row of it,
    /// then cached).
    pub fn values(&self) -> Result<&[f32]> {
        if let Some(v) = self.values.get() {
            return Ok(v);
        }
        let n = usize::try_from(self.info.n_elements).map_err(|_| {
            EngineError::shape("weight", format!("{}: too many elements", self.info.name))
        })?;
        if n == 0 {
            return Ok(self.values.get_or_init(Vec::new));
        }
        let k = self.row_len();
        let rows = n.checked_div(k).unwrap_or(0);
        let ids = (0..rows)
            .map(|r| {
                u32::try_from(r).map_err(|_| {
                    EngineError::shape("weight", format!("{}: too many rows", self.info.name))
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        let mut v = vec![0f32; n];
        (self.embed.get())(self.ty, self.bytes()?, k, &ids, &mut v)?;
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

/// The catalogue kernels the CPU runs, each in the variant the registry selected when the
/// backend was created (`STRATA_KERNELS`, or `kernels::registry::select` before creation):
/// resolved once, so an operation makes no registry lookup.
#[derive(Clone, Copy, Debug)]
pub struct CpuKernels {
    pub route: Chosen<RouteFn>,
    pub embed: Chosen<EmbedFn>,
    pub xprep: Chosen<XprepFn>,
    pub xprep_pair: Chosen<XprepPairFn>,
    pub rms_norm: Chosen<RmsNormFn>,
    pub pick: Chosen<PickFn>,
    pub slop_pen: Chosen<SlopFn>,
}

impl CpuKernels {
    /// The registry's current selection.
    pub fn selected() -> Result<CpuKernels> {
        Ok(CpuKernels {
            route: kernels::route::ROUTE.resolve()?,
            embed: kernels::embed::EMBED.resolve()?,
            xprep: kernels::norm::XPREP.resolve()?,
            xprep_pair: kernels::norm::XPREP_PAIR.resolve()?,
            rms_norm: kernels::norm::RMS_NORM.resolve()?,
            pick: kernels::pick::PICK.resolve()?,
            slop_pen: kernels::slop::SLOP_PEN.resolve()?,
        })
    }

    /// The ops not in their default (`optimized`) variant, as `op=variant, …`; None when every
    /// op runs its default (what `-v` prints beside the backend).
    pub fn non_default(&self) -> Option<String> {
        let all = [
            (self.route.op, self.route.name),
            (self.embed.op, self.embed.name),
            (self.xprep.op, self.xprep.name),
            (self.rms_norm.op, self.rms_norm.name),
            (self.pick.op, self.pick.name),
            (self.xprep_pair.op, self.xprep_pair.name),
            (self.slop_pen.op, self.slop_pen.name),
        ];
        let v: Vec<String> = all
            .iter()
            .filter(|(_, n)| *n != kernels::OPTIMIZED)
            .map(|(o, n)| format!("{o}={n}"))
            .collect();
        (!v.is_empty()).then(|| v.join(", "))
    }
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    isa: Isa,
    float_activations: FloatActivations,
    /// Boxed: six resolved kernels would make the backend value large to move around.
    kernels: Box<CpuKernels>,
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
            kernels: Box::new(CpuKernels::selected()?),
        })
    }

    /// The catalogue variants this backend runs.
    pub fn kernels(&self) -> &CpuKernels {
        &self.kernels
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
        self.matmul_slab_shared(w, slab, x, &[] as &[matmul::Prepared], &mut Vec::new())
    }

    /// The `slab`-th `[m, k]` matrix of a (possibly 3-D) weight as bytes, with `m` and `k`.
    fn slab(w: &CpuWeight, slab: usize) -> Result<(&[u8], usize, usize)> {
        let k = w.row_len();
        let m = w.n_rows2();
        let row_bytes = w.ty.row_bytes(k).ok_or_else(|| {
            EngineError::shape(
                "matmul",
                format!("{}: rows of {k} are not whole blocks", w.name()),
            )
        })?;
        let slab_bytes = m * row_bytes;
        let bytes = w
            .bytes()?
            .get(slab * slab_bytes..(slab + 1) * slab_bytes)
            .ok_or_else(|| {
                EngineError::shape("matmul", format!("{}: no matrix {slab}", w.name()))
            })?;
        Ok((bytes, m, k))
    }

    /// Whether products with `w` meet f32 activations (the widened mode) instead of an image.
    fn widened(&self, w: &CpuWeight) -> bool {
        self.float_activations == FloatActivations::F32
            && matches!(w.ty, GgmlType::F16 | GgmlType::BF16)
    }

    /// The image of `x` as rows of `k` in the format products with `w` read: one of `have`
    /// or of `made` (both made from these rows), or a new one quantized by the catalogue's
    /// `xprep` and kept in `made`.
    fn image<'a>(
        &self,
        w: &CpuWeight,
        x: &[f32],
        k: usize,
        have: &'a [impl std::borrow::Borrow<matmul::Prepared>],
        made: &'a mut Vec<matmul::Prepared>,
    ) -> Result<&'a matmul::Prepared> {
        let n = x.len().checked_div(k).unwrap_or(0);
        let xty = w.ty.vec_dot_type();
        let fits = |p: &matmul::Prepared| Some(p.ty) == xty && p.k == k && p.n == n;
        if let Some(p) = have.iter().map(|p| p.borrow()).find(|p| fits(p)) {
            return Ok(p);
        }
        let i = match made.iter().position(fits) {
            Some(i) => i,
            None => {
                made.push(matmul::prepare(
                    &self.kernels.xprep_pair,
                    &self.kernels.xprep,
                    w.ty,
                    x,
                    k,
                    w.name(),
                )?);
                made.len() - 1
            }
        };
        Ok(&made[i])
    }

    /// [`Self::matmul_slab`] with `x` quantized at most once per activation format: an image in
    /// `have` or `made` (which must only ever hold `x`'s rows) is read, a new one kept in `made`.
    fn matmul_slab_shared(
        &self,
        w: &CpuWeight,
        slab: usize,
        x: &[f32],
        have: &[impl std::borrow::Borrow<matmul::Prepared>],
        made: &mut Vec<matmul::Prepared>,
    ) -> Result<Vec<f32>> {
        let (bytes, m, k) = Self::slab(w, slab)?;
        if self.widened(w) {
            let embed = self.kernels.embed.get();
            return matmul::matmul_widened(self.isa, embed, w.ty, bytes, m, k, x, w.name());
        }
        let p = self.image(w, x, k, have, made)?;
        matmul::matmul_prepared(self.isa, w.ty, bytes, m, p, w.name())
    }

    /// The products of `ws` with `x`, reading the images of `x` in `have`.
    fn matmuls_with<const N: usize>(
        &self,
        ws: [&CpuWeight; N],
        x: &CpuBuf,
        have: &[matmul::Prepared],
    ) -> Result<[CpuBuf; N]> {
        for w in ws {
            Self::check_matmul(w, x)?;
        }
        let ys = self.pool.install(|| -> Result<Vec<CpuBuf>> {
            let mut made = Vec::new();
            ws.iter()
                .map(|w| {
                    let y = self.matmul_slab_shared(w, 0, &x.data, have, &mut made)?;
                    CpuBuf::new(x.rows, w.n_rows2(), y)
                })
                .collect()
        })?;
        ys.try_into()
            .map_err(|_| EngineError::shape("matmuls", "product count"))
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

    /// [`Backend::moe_experts`] reading the images of `x` in `have` (made here for the formats
    /// `have` lacks): each expert's gate and up products read its members' rows of one image
    /// of `x`, so a row is quantized once, not once per expert it is routed to.
    fn moe_experts_with(
        &self,
        ex: &ExpertWeights<'_, CpuWeight>,
        x: &CpuBuf,
        have: &[matmul::Prepared],
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
        // The images of every row of `x` the experts' gate and up products read, made once.
        let mut made = Vec::new();
        self.pool.install(|| -> Result<()> {
            for w in [ex.gate, ex.up] {
                if !self.widened(w) {
                    self.image(w, &x.data, hdim, have, &mut made)?;
                }
            }
            Ok(())
        })?;
        let images: Vec<&matmul::Prepared> = have.iter().chain(made.iter()).collect();
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
                    // The members' rows of each image (a row's image is that row's alone).
                    let mine: Vec<matmul::Prepared> = images
                        .iter()
                        .map(|p| p.gather(members.iter().map(|&(r, _)| r)))
                        .collect();
                    // Their f32 rows only for a product that reads f32 (the widened mode).
                    let mut xe: Option<Vec<f32>> = None;
                    let mut made = Vec::new();
                    let mut product = |w: &CpuWeight| -> Result<Vec<f32>> {
                        let xty = w.ty.vec_dot_type();
                        let img = mine.iter().find(|p| Some(p.ty) == xty && p.k == hdim);
                        if let (false, Some(p)) = (self.widened(w), img) {
                            let (bytes, m, _) = Self::slab(w, e)?;
                            return matmul::matmul_prepared(self.isa, w.ty, bytes, m, p, w.name());
                        }
                        let xe = xe.get_or_insert_with(|| {
                            members
                                .iter()
                                .flat_map(|&(r, _)| x.row(r))
                                .copied()
                                .collect()
                        });
                        self.matmul_slab_shared(w, e, xe, &mine, &mut made)
                    };
                    let g = product(ex.gate)?;
                    let u = product(ex.up)?;
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
}

/// Per row: `(expert, weight)` in rank order.
pub struct CpuRoutes(pub Vec<Vec<(u32, f32)>>);

/// A buffer's activation images, one per activation format (the CPU's half of
/// [`Prepared`]): made by the catalogue's `xprep`, read by every product of those rows.
#[derive(Default)]
pub struct CpuImages(Vec<matmul::Prepared>);

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type Weight = CpuWeight;
    type Ids = CpuIds;
    type Routes = CpuRoutes;
    type Images = CpuImages;

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
            embed: self.kernels.embed,
        })
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, vec![0.0; rows * cols])
    }

    /// Rows are committed as they are written: a store starts empty and grows to the highest
    /// row written (never beyond what the model's [`RowStore`](crate::backend::RowStore)
    /// allows), so a long context costs memory only once it is used.
    fn store(&self, _cap: usize, cols: usize) -> Result<CpuBuf> {
        CpuBuf::new(0, cols, Vec::new())
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, data.to_vec())
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<CpuIds> {
        Ok(CpuIds(ids.to_vec()))
    }

    fn ids_range(&self, ids: &CpuIds, start: usize, len: usize) -> Result<CpuIds> {
        ids.0
            .get(start..start + len)
            .map(|s| CpuIds(s.to_vec()))
            .ok_or_else(|| {
                EngineError::shape(
                    "ids_range",
                    format!("{start}..{} of {} ids", start + len, ids.0.len()),
                )
            })
    }

    fn download(&self, x: &CpuBuf) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn download_ids(&self, ids: &CpuIds) -> Result<Vec<u32>> {
        Ok(ids.0.clone())
    }

    fn copy(&self, x: &CpuBuf) -> Result<CpuBuf> {
        Ok(x.clone())
    }

    fn copy_into(&self, dst: &mut CpuBuf, src: &CpuBuf) -> Result<()> {
        Self::same_shape("copy_into", dst, src)?;
        dst.data.copy_from_slice(&src.data);
        Ok(())
    }

    fn write_rows(&self, store: &mut CpuBuf, x: &CpuBuf, at: &CpuIds) -> Result<()> {
        if store.cols != x.cols || at.0.len() != x.rows {
            return Err(EngineError::shape(
                "write_rows",
                format!(
                    "{} rows of {} at {} positions into rows of {}",
                    x.rows,
                    x.cols,
                    at.0.len(),
                    store.cols
                ),
            ));
        }
        let cols = store.cols;
        for (r, &slot) in at.0.iter().enumerate() {
            if slot == u32::MAX {
                continue;
            }
            let slot = slot as usize;
            if slot >= store.rows {
                store.data.resize((slot + 1) * cols, 0.0);
                store.rows = slot + 1;
            }
            store.data[slot * cols..(slot + 1) * cols].copy_from_slice(x.row(r));
        }
        Ok(())
    }

    fn write_kv(&self, cache: &mut CpuBuf, x: &CpuBuf, at: &CpuIds, kv: KvType) -> Result<()> {
        self.write_rows(cache, x, at)?;
        if kv == KvType::F16 {
            // Round the rows just written, in place (no copy of the step's rows).
            let cols = cache.cols;
            for &slot in at.0.iter().filter(|&&s| s != u32::MAX) {
                let r = slot as usize * cols;
                attn::round_f16(&mut cache.data[r..r + cols]);
            }
        }
        Ok(())
    }

    fn step<R: Send>(&self, _key: StepKey, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        self.pool.install(f)
    }

    /// Every operation is row by row, so a batch's rows are just more rows.
    fn batches_sequences(&self) -> bool {
        true
    }

    fn reshape(&self, x: CpuBuf, rows: usize, cols: usize) -> Result<CpuBuf> {
        CpuBuf::new(rows, cols, x.data)
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

    fn embed_rows(&self, table: &CpuWeight, ids: &CpuIds, copies: usize) -> Result<CpuBuf> {
        let ids = &ids.0[..];
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
        // The catalogue's `embed` (its `optimized` variant is `strata_quant::dequantize`).
        let embed = self.kernels.embed.get();
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
                    embed(table.ty, src, k, &[0], first)?;
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
        self.matmuls_with(ws, x, &[])
    }

    /// One image per activation format among `ws` (the catalogue's `xprep`); none for the
    /// weights the widened mode meets in f32.
    fn prepare_images(&self, x: &CpuBuf, ws: &[&CpuWeight]) -> Result<CpuImages> {
        let mut made = Vec::new();
        self.pool.install(|| -> Result<()> {
            for w in ws {
                // Matrices or expert stacks whose rows are `x`'s rows or a part of them (a
                // product of the rows reshaped, `reshape_prepared`).
                let k = w.row_len();
                if w.info.dims.len() > 3 || k == 0 || !x.cols.is_multiple_of(k) {
                    return Err(EngineError::shape(
                        "prepare",
                        format!(
                            "{}: rows of {} against weight {:?}",
                            w.name(),
                            x.cols,
                            w.dims()
                        ),
                    ));
                }
                // An image of rows of `x.cols` is also one of rows of `k` when `k` is whole
                // blocks of the format (the blocks are the same); otherwise none is made.
                let aligned = w.ty.vec_dot_type().and_then(|t| t.row_bytes(k)).is_some();
                if !self.widened(w) && aligned {
                    self.image(w, &x.data, x.cols, &[] as &[matmul::Prepared], &mut made)?;
                }
            }
            Ok(())
        })?;
        Ok(CpuImages(made))
    }

    /// Images that are also whole rows of `cols` (block-aligned rows: an image is its rows'
    /// blocks in order, so the same bytes are the image of the reshaped rows) come along; the
    /// others are dropped.
    fn reshape_prepared(
        &self,
        x: Prepared<Self>,
        rows: usize,
        cols: usize,
    ) -> Result<Prepared<Self>> {
        let reshaped = self.reshape(x.rows, rows, cols)?;
        let images = x
            .images
            .0
            .into_iter()
            .filter_map(|p| {
                let rb = p.ty.row_bytes(cols)?;
                (rb * rows == p.bytes.len()).then_some(matmul::Prepared {
                    k: cols,
                    n: rows,
                    row_bytes: rb,
                    ..p
                })
            })
            .collect();
        Ok(Prepared {
            rows: reshaped,
            images: CpuImages(images),
        })
    }

    fn matmul_prepared(&self, w: &CpuWeight, x: &Prepared<Self>) -> Result<CpuBuf> {
        let [y] = self.matmuls_with([w], &x.rows, &x.images.0)?;
        Ok(y)
    }

    fn matmuls_prepared<const N: usize>(
        &self,
        ws: [&CpuWeight; N],
        x: &Prepared<Self>,
    ) -> Result<[CpuBuf; N]> {
        self.matmuls_with(ws, &x.rows, &x.images.0)
    }

    fn matmul_rows(&self, w: &CpuWeight, rows: &CpuIds, x: &CpuBuf) -> Result<CpuBuf> {
        let rows = &rows.0[..];
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
                matmul::prepare(
                    &self.kernels.xprep_pair,
                    &self.kernels.xprep,
                    w.ty,
                    &x.data,
                    k,
                    w.name(),
                )?
            };
            let embed = self.kernels.embed.get();
            let (ty, bytes, m) = (w.ty, w.bytes()?, w.n_rows2());
            matmul::matmul_rows(self.isa, embed, ty, bytes, m, rows, &xp, w.name())
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
        let norm = self.kernels.rms_norm.get();
        self.pool
            .install(|| ops::for_rows(&mut out, x.cols, |r, o| norm(x.row(r), wv, group, eps, o)));
        CpuBuf::new(x.rows, x.cols, out)
    }

    fn rope_neox(
        &self,
        x: &mut CpuBuf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &CpuIds,
    ) -> Result<()> {
        let positions = &positions.0[..];
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

    /// The catalogue's `route` kernel (`kernels::route`), in the variant the registry selected
    /// at creation (`STRATA_KERNELS=route=baseline` runs the baseline): one implementation, so
    /// `strata parity router-ab` measures what the model runs.
    fn route(&self, logits: &CpuBuf, k: usize) -> Result<CpuRoutes> {
        if k == 0 || k > logits.cols {
            return Err(EngineError::shape(
                "route",
                format!("top {k} of {} experts", logits.cols),
            ));
        }
        let f = self.kernels.route.get();
        let mut ids = vec![0i32; logits.rows * k];
        let mut weights = vec![0f32; logits.rows * k];
        f(&logits.data, logits.cols, k, &mut ids, &mut weights)?;
        Ok(CpuRoutes(
            ids.chunks(k)
                .zip(weights.chunks(k))
                .map(|(i, w)| i.iter().zip(w).map(|(&e, &w)| (e as u32, w)).collect())
                .collect(),
        ))
    }

    fn moe_experts(
        &self,
        ex: &ExpertWeights<'_, CpuWeight>,
        x: &CpuBuf,
        routes: &CpuRoutes,
    ) -> Result<CpuBuf> {
        self.moe_experts_with(ex, x, &[], routes)
    }

    fn moe_experts_prepared(
        &self,
        ex: &ExpertWeights<'_, CpuWeight>,
        x: &Prepared<Self>,
        routes: &CpuRoutes,
    ) -> Result<CpuBuf> {
        self.moe_experts_with(ex, &x.rows, &x.images.0, routes)
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

    /// Greedy rows through the catalogue's `pick` (after the trunk's NaN refusal, which makes
    /// it `sampler::argmax`); draws through the sampler's own code on the row, in place.
    fn pick_rows(&self, logits: &CpuBuf, pick: DevicePick, first_position: u64) -> Result<CpuIds> {
        if logits.cols == 0 {
            return Err(EngineError::Input("pick: no logits".to_string()));
        }
        let f = self.kernels.pick.get();
        let ids = (0..logits.rows)
            .map(|r| {
                let row = logits.row(r);
                match pick {
                    DevicePick::Greedy => {
                        if let Some(i) = row.iter().position(|v| v.is_nan()) {
                            return Err(EngineError::Input(format!(
                                "sampler: logit of token {i} is NaN"
                            )));
                        }
                        Ok(f(row, &[])?.index as u32)
                    }
                    DevicePick::Draw { .. } => {
                        crate::sampler::pick_row(pick, row, first_position + r as u64)
                    }
                }
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok(CpuIds(ids))
    }

    /// The catalogue's `pick` on each row.
    fn pick_draft(&self, logits: &CpuBuf) -> Result<CpuIds> {
        if logits.cols == 0 {
            return Err(EngineError::Input("pick: no draft logits".to_string()));
        }
        let f = self.kernels.pick.get();
        let ids = (0..logits.rows)
            .map(|r| Ok(f(logits.row(r), &[])?.index as u32))
            .collect::<Result<Vec<u32>>>()?;
        Ok(CpuIds(ids))
    }

    /// The catalogue's `pick` on each row, mapped through the draft ids by the kernel itself.
    fn pick_draft_mapped(
        &self,
        logits: &CpuBuf,
        map: Option<&crate::backend::DraftMap<CpuIds>>,
    ) -> Result<crate::backend::DraftPick<CpuIds>> {
        if logits.cols == 0 {
            return Err(EngineError::Input("pick: no draft logits".to_string()));
        }
        let table: &[i32] = map.map_or(&[], |m| &m.host_i32);
        let f = self.kernels.pick.get();
        let (mut ids, mut values) = (Vec::new(), Vec::new());
        for r in 0..logits.rows {
            let p = f(logits.row(r), table)?;
            // The index is below the row length and the map's ids were checked against the
            // vocabulary: the token is valid by construction.
            ids.push(u32::try_from(p.token).map_err(|_| {
                EngineError::shape("pick_draft_mapped", format!("index {}", p.index))
            })?);
            values.push(p.value.to_bits());
        }
        Ok(crate::backend::DraftPick {
            ids: CpuIds(ids),
            values: CpuIds(values),
        })
    }

    /// The catalogue's `slop_pen` (the selected variant) on the row, in place.
    fn slop_pen_draft(
        &self,
        logits: &mut CpuBuf,
        slop: &crate::backend::DraftSlop<CpuIds, CpuBuf>,
        prev: Option<&CpuIds>,
        state: &CpuIds,
    ) -> Result<CpuIds> {
        if logits.rows != 1 || logits.cols != slop.n_draft {
            return Err(EngineError::shape(
                "slop_pen_draft",
                format!(
                    "logits {}×{} for one row of {} draft logits",
                    logits.rows, logits.cols, slop.n_draft
                ),
            ));
        }
        let prev = match prev.map(|p| p.0.as_slice()) {
            None => -1,
            Some(&[t]) => i32::try_from(t).map_err(|_| {
                EngineError::Input(format!("slop_pen_draft: previous token {t} is too large"))
            })?,
            Some(p) => {
                return Err(EngineError::shape(
                    "slop_pen_draft",
                    format!("{} previous tokens, expected one", p.len()),
                ))
            }
        };
        let st_in: Vec<i32> = state.0.iter().map(|&x| x as i32).collect();
        let mut st_out = vec![0i32; kernels::slop::STATE_LEN];
        // The tables were validated when `slop` was made (DraftSlop::new).
        let checked = kernels::slop::CheckedSlop {
            tables: &slop.tables,
            nv: slop.n_draft,
        };
        let f = self.kernels.slop_pen.get();
        f(
            &checked,
            u32::from(slop.compiled.mode()),
            prev,
            &[],
            &st_in,
            &mut st_out,
            &mut logits.data,
        )?;
        Ok(CpuIds(st_out.into_iter().map(|x| x as u32).collect()))
    }

    fn write_ids(&self, dst: &mut CpuIds, at: usize, src: &CpuIds) -> Result<()> {
        let n = dst.0.len();
        dst.0
            .get_mut(at..at + src.0.len())
            .ok_or_else(|| {
                EngineError::shape("write_ids", format!("{} ids at {at} of {n}", src.0.len()))
            })?
            .copy_from_slice(&src.0);
        Ok(())
    }

    fn attend_causal(
        &self,
        q: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        positions: &CpuIds,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<CpuBuf> {
        let positions = &positions.0[..];
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
}
