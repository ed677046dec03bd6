//! Host launchers for the model operations of both families (kernels/elem.cu, gdn.cu, attn.cu,
//! moe.cu, and the matmul / MoE products of gemv.cu): argument checks (every buffer covers what
//! the launch touches), then one launch, or for the composed operations (hyper-connection mix,
//! routed experts) a fixed sequence of launches over caller-owned scratch.
//!
//! Semantics are the CPU backend's (`strata_engine::cpu`); `tests/model_ops.rs` compares each
//! against it. These are the pieces of a CUDA backend, not the `Backend` trait itself.
//!
//! **Graph replay.** Every value that changes from one step to the next is read by the kernels
//! from device memory: positions (`pos`), token/row ids, expert ids and weights, selections and
//! their counts, tile counts. Kernel arguments hold only the step's *shape* (row counts, widths)
//! and the stores' fixed capacities, so a step captured once replays with its inputs rewritten
//! in place. Lengths that follow from positions (visible tokens, complete QSA blocks) are
//! derived on the device. A position or id outside a store sets a bit in a caller-owned `err`
//! word ([`ERR_CAPACITY`], [`ERR_EXPERT`]) instead of touching memory out of bounds; the host
//! reads it after the step.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use strata_engine::kernels::ActFmt;
use strata_quant::GgmlType;

use crate::device::{cfg, Gpu};
use crate::ops::{self, bad, i32_of, launch, need};
use crate::CudaError;

/// `err` bit: a position, block or selection past a store's capacity.
pub const ERR_CAPACITY: u32 = 1;
/// `err` bit: an expert id outside the layer's experts.
pub const ERR_EXPERT: u32 = 2;
/// Error-word bit: a NaN logit met by a greedy pick that refuses NaN (sample.cu pick_rows).
pub const ERR_NAN_LOGIT: u32 = 8;

/// Blocks of 256 threads for a grid-stride loop over `n` elements.
fn grid(n: usize) -> LaunchConfig {
    cfg(n.div_ceil(256).clamp(1, 1 << 16) as u32, 256)
}

fn cfg2(x: u32, y: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x.max(1), y.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn u64_of(v: usize) -> u64 {
    v as u64
}

/// Inverse rope frequencies `θ^(−2i/rot)` in f64 for the `rot / 2` pairs: the CPU's formula
/// (`cpu::ops::rope_freqs`), uploaded once per (rot, θ).
pub fn rope_freqs(rot: usize, theta: f32) -> Vec<f64> {
    (0..rot / 2)
        .map(|i| (theta as f64).powf(-(2.0 * i as f64) / rot as f64))
        .collect()
}

// ---- row-wise and element-wise ------------------------------------------------------------

/// RMS norm of every `group`-wide slice of `rows` rows of `cols`, times `w` (`cols` values, or
/// `group` values broadcast over the groups).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
    group: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let k = "rms_norm";
    if group == 0 || !cols.is_multiple_of(group) || (w.len() != cols && w.len() != group) {
        return Err(bad(
            k,
            format!(
                "rows of {cols} in groups of {group} with {} weights",
                w.len()
            ),
        ));
    }
    need(k, "x", x.len(), rows * cols)?;
    need(k, "out", out.len(), rows * cols)?;
    if rows == 0 {
        // A grid of no blocks is no launch (cfg would round it up to one).
        return Ok(());
    }
    let (c, g, wl) = (i32_of(k, cols)?, i32_of(k, group)?, i32_of(k, w.len())?);
    launch!(
        gpu,
        "elem",
        "rms_norm_f32",
        cfg((rows * (cols / group)) as u32, 256),
        [x, w, out, &c, &g, &wl, &eps]
    )
}

/// NeoX rope of the first `rot` dims of every `head_dim` head; row `r` at position `pos[r]`
/// (device). `freqs` from [`rope_freqs`].
#[allow(clippy::too_many_arguments)]
pub fn rope_neox(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    pos: &CudaSlice<u32>,
    freqs: &CudaSlice<f64>,
    rows: usize,
    cols: usize,
    head_dim: usize,
    rot: usize,
) -> Result<(), CudaError> {
    let k = "rope_neox";
    if head_dim == 0 || !cols.is_multiple_of(head_dim) || rot > head_dim || !rot.is_multiple_of(2) {
        return Err(bad(
            k,
            format!("rows of {cols}, head {head_dim}, rot {rot}"),
        ));
    }
    need(k, "x", x.len(), rows * cols)?;
    need(k, "positions", pos.len(), rows)?;
    need(k, "freqs", freqs.len(), rot / 2)?;
    if rot == 0 {
        return Ok(());
    }
    let (r, c, h, ro) = (
        i32_of(k, rows)?,
        i32_of(k, cols)?,
        i32_of(k, head_dim)?,
        i32_of(k, rot)?,
    );
    launch!(
        gpu,
        "elem",
        "rope_neox_f32",
        grid(rows * (cols / head_dim) * (rot / 2)),
        [x, pos, freqs, &r, &c, &h, &ro]
    )
}

/// `out = x + y` (`n` elements).
pub fn add(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    y: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    need("add", "x", x.len(), n)?;
    need("add", "y", y.len(), n)?;
    need("add", "out", out.len(), n)?;
    let nn = u64_of(n);
    launch!(gpu, "elem", "add_f32", grid(n), [x, y, out, &nn])
}

/// `x += y` (`n` elements).
pub fn add_assign(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    need("add_assign", "x", x.len(), n)?;
    need("add_assign", "y", y.len(), n)?;
    let nn = u64_of(n);
    launch!(gpu, "elem", "add_assign_f32", grid(n), [x, y, &nn])
}

/// `x[r] += b` for `rows` rows of `cols` (`b` has `cols` values).
pub fn add_bias(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    b: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<(), CudaError> {
    need("add_bias", "x", x.len(), rows * cols)?;
    if b.len() != cols {
        return Err(bad(
            "add_bias",
            format!("{} bias values for rows of {cols}", b.len()),
        ));
    }
    if cols == 0 {
        return Ok(());
    }
    let (nn, c) = (u64_of(rows * cols), i32_of("add_bias", cols)?);
    launch!(
        gpu,
        "elem",
        "add_bias_f32",
        grid(rows * cols),
        [x, b, &nn, &c]
    )
}

/// Binary element-wise `out = f(a, b)` kernels of elem.cu.
fn binary(
    gpu: &Gpu,
    kernel: &'static str,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    need(kernel, "a", a.len(), n)?;
    need(kernel, "b", b.len(), n)?;
    need(kernel, "out", out.len(), n)?;
    let nn = u64_of(n);
    launch!(gpu, "elem", kernel, grid(n), [a, b, out, &nn])
}

/// `out = silu(g) ⊙ u`.
pub fn swiglu(
    gpu: &Gpu,
    g: &CudaSlice<f32>,
    u: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    binary(gpu, "swiglu_f32", g, u, out, n)
}

/// `out = x ⊙ σ(gate)`.
pub fn mul_sigmoid(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    gate: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    binary(gpu, "mul_sigmoid_f32", x, gate, out, n)
}

/// `y[r] += σ(gate[r]) · x[r]` (`gate` one value per row).
pub fn add_sigmoid_gated(
    gpu: &Gpu,
    y: &mut CudaSlice<f32>,
    x: &CudaSlice<f32>,
    gate: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<(), CudaError> {
    let k = "add_sigmoid_gated";
    need(k, "y", y.len(), rows * cols)?;
    need(k, "x", x.len(), rows * cols)?;
    need(k, "gate", gate.len(), rows)?;
    if cols == 0 {
        return Ok(());
    }
    let (nn, c) = (u64_of(rows * cols), i32_of(k, cols)?);
    launch!(
        gpu,
        "elem",
        "add_sigmoid_gated_f32",
        grid(rows * cols),
        [y, x, gate, &nn, &c]
    )
}

/// Rows of repeated `[part 0 (chunk) | part 1 (chunk) | …]` split into `parts` parts, written
/// part-major into `out` (part `p` at `p · n / parts`).
pub fn deinterleave(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
    chunk: usize,
    parts: usize,
) -> Result<(), CudaError> {
    let k = "deinterleave";
    if chunk == 0 || parts == 0 || !cols.is_multiple_of(chunk * parts) {
        return Err(bad(
            k,
            format!("rows of {cols} into {parts} parts of {chunk}"),
        ));
    }
    need(k, "x", x.len(), rows * cols)?;
    need(k, "out", out.len(), rows * cols)?;
    let (nn, c, p) = (u64_of(rows * cols), i32_of(k, chunk)?, i32_of(k, parts)?);
    launch!(
        gpu,
        "elem",
        "deinterleave_f32",
        grid(rows * cols),
        [x, out, &nn, &c, &p]
    )
}

/// `out[r] = [x[r]; …; x[r]]` (`copies` times).
pub fn repeat_rows(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
    copies: usize,
) -> Result<(), CudaError> {
    let k = "repeat_rows";
    need(k, "x", x.len(), rows * cols)?;
    need(k, "out", out.len(), rows * cols * copies)?;
    if cols == 0 || copies == 0 {
        return Ok(());
    }
    let (nn, c, cp) = (
        u64_of(rows * cols * copies),
        i32_of(k, cols)?,
        i32_of(k, copies)?,
    );
    launch!(
        gpu,
        "elem",
        "repeat_rows_f32",
        grid(rows * cols * copies),
        [x, out, &nn, &c, &cp]
    )
}

/// `x[r][s] += inj[r][s] · y[r]` for `streams` streams of `h`.
pub fn hc_combine(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    inj: &CudaSlice<f32>,
    rows: usize,
    h: usize,
    streams: usize,
) -> Result<(), CudaError> {
    let k = "hc_combine";
    need(k, "x", x.len(), rows * streams * h)?;
    need(k, "y", y.len(), rows * h)?;
    need(k, "inj", inj.len(), rows * streams)?;
    let (r, hh, s) = (i32_of(k, rows)?, i32_of(k, h)?, i32_of(k, streams)?);
    launch!(
        gpu,
        "elem",
        "hc_combine_f32",
        grid(rows * streams * h),
        [x, y, inj, &r, &hh, &s]
    )
}

/// PLE gate: `out[r][s] = γ_{r,s} · v[r]`, `γ = σ(sign(z)·sqrt(max(|z|, 1e-6)))`,
/// `z = <k[r][s], q[r][s]> / sqrt(h)`.
#[allow(clippy::too_many_arguments)]
pub fn ple_gate(
    gpu: &Gpu,
    k: &CudaSlice<f32>,
    q: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    h: usize,
    streams: usize,
) -> Result<(), CudaError> {
    let kn = "ple_gate";
    need(kn, "k", k.len(), rows * streams * h)?;
    need(kn, "q", q.len(), rows * streams * h)?;
    need(kn, "v", v.len(), rows * h)?;
    need(kn, "out", out.len(), rows * streams * h)?;
    if rows * streams == 0 {
        return Ok(());
    }
    let (hh, s) = (i32_of(kn, h)?, i32_of(kn, streams)?);
    launch!(
        gpu,
        "elem",
        "ple_gate_f32",
        cfg((rows * streams) as u32, 256),
        [k, q, v, out, &hh, &s]
    )
}

// ---- products -------------------------------------------------------------------------------

/// A weight on the device in its file format: `rows` rows of `k` elements of `ty` (for an
/// expert stack, `n_expert` such slabs back to back).
pub struct DevWeight {
    pub ty: GgmlType,
    pub bytes: CudaSlice<u8>,
    pub rows: usize,
    pub k: usize,
    pub n_expert: usize,
}

impl DevWeight {
    pub fn upload(
        gpu: &Gpu,
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        k: usize,
        n_expert: usize,
    ) -> Result<DevWeight, CudaError> {
        let w = DevWeight {
            ty,
            bytes: gpu.upload_weights(bytes)?,
            rows,
            k,
            n_expert,
        };
        need(
            "weight",
            "bytes",
            bytes.len(),
            w.slab_bytes()? * n_expert.max(1),
        )?;
        Ok(w)
    }

    /// A weight over bytes already on (or mapped into) the device, checked as
    /// [`DevWeight::upload`] checks.
    pub fn over(
        ty: GgmlType,
        bytes: CudaSlice<u8>,
        len: usize,
        rows: usize,
        k: usize,
        n_expert: usize,
    ) -> Result<DevWeight, CudaError> {
        let w = DevWeight {
            ty,
            bytes,
            rows,
            k,
            n_expert,
        };
        need("weight", "bytes", len, w.slab_bytes()? * n_expert.max(1))?;
        Ok(w)
    }

    /// The paired activation format.
    pub fn act(&self) -> Result<ActFmt, CudaError> {
        ActFmt::for_weight(self.ty)
            .ok_or_else(|| bad("matmul", format!("{} has no paired activation", self.ty)))
    }

    fn row_bytes(&self) -> Result<usize, CudaError> {
        self.ty.row_bytes(self.k).ok_or_else(|| {
            bad(
                "matmul",
                format!("rows of {} are not whole {} blocks", self.k, self.ty),
            )
        })
    }

    pub fn slab_bytes(&self) -> Result<usize, CudaError> {
        Ok(self.rows * self.row_bytes()?)
    }

    /// Bytes of one activation row in the paired format.
    pub fn act_row_bytes(&self) -> Result<usize, CudaError> {
        let f = self.act()?;
        f.row_bytes(self.k).ok_or_else(|| {
            bad(
                "matmul",
                format!("rows of {} are not whole {} blocks", self.k, f.name()),
            )
        })
    }
}

/// Weight formats with product kernels: the catalogue's GEMV formats, and (tiled kernel only)
/// Q3_K, F32, Q4_0, Q5_0 and IQ4_NL.
pub fn has_products(ty: GgmlType) -> bool {
    strata_engine::kernels::gemv::GEMV_FORMATS.contains(&ty)
        || matches!(
            ty,
            GgmlType::Q3_K | GgmlType::F32 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::IQ4_NL
        )
}

fn product_module(ty: GgmlType) -> Result<String, CudaError> {
    if !has_products(ty) {
        return Err(bad("matmul", format!("{ty} has no CUDA product kernels")));
    }
    Ok(ty.name().to_lowercase())
}

/// The product kernels read rows in 32-element units: a row length that is not a multiple of
/// 32 is refused (it would silently drop the last elements).
fn whole_units(kernel: &str, w: &DevWeight) -> Result<(), CudaError> {
    if !w.k.is_multiple_of(32) {
        return Err(bad(
            kernel,
            format!("rows of {} are not whole 32-element units", w.k),
        ));
    }
    Ok(())
}

/// Weight formats whose products beyond the GEMV window run the exact tensor-core kernels
/// (kernels/mmq.cu: int8 MMA on the units' integer dots, bitwise the GEMV's result). BF16 runs
/// a register-tiled CUDA-core kernel beyond the window (a float MMA would not add in the GEMV's
/// order), F32 the tiled one.
pub fn has_mmq(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::IQ4_NL
            | GgmlType::Q2_0
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS
            | GgmlType::IQ3_S
            | GgmlType::IQ3_XXS
    )
}

/// Batches above this many activation rows run the tensor-core product in [`matmul`] (at or
/// below it the tiled kernel, whose one-warp-a-row decode suits decode-sized batches).
pub const MMQ_MIN_ROWS: usize = 9;

/// The tensor-core kernels' tiles (kernels/mmq.cu): weight rows a block, activation rows a
/// dense tile (the expert product takes moe_group's tiles of up to 8 pairs).
pub const MMQ_ROWS: usize = 32;
pub const MMQ_TOKENS: usize = 16;

/// Grid of the dense tensor-core product: one block per 32 weight rows × 16 activation rows.
pub fn mmq_grid(rows: usize, nt: usize) -> (u32, u32) {
    (
        rows.div_ceil(MMQ_ROWS) as u32,
        nt.div_ceil(MMQ_TOKENS) as u32,
    )
}

/// The BF16 register-tiled product (kernels/mmq.cu) for rows of `k`: its kernel and grid, one
/// block per 32 weight rows × 8 activation rows, or × 16 for rows of at most 16 units
/// (`mmt_bf16_h`: the half-warps take 8 tokens each).
pub fn mmt_kernel(rows: usize, nt: usize, k: usize) -> (&'static str, (u32, u32)) {
    let halves = k <= 16 * 32;
    let tokens = if halves { 16 } else { 8 };
    (
        if halves { "mmt_bf16_h" } else { "mmt_bf16" },
        (rows.div_ceil(MMQ_ROWS) as u32, nt.div_ceil(tokens) as u32),
    )
}

/// Checks of a dense product's arguments; returns (row bytes, activation row bytes).
fn matmul_args(
    k: &str,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &CudaSlice<f32>,
) -> Result<(usize, usize), CudaError> {
    whole_units(k, w)?;
    let (wrb, xrb) = (w.row_bytes()?, w.act_row_bytes()?);
    need(k, "w", w.bytes.len(), w.rows * wrb)?;
    need(k, "x", x.len(), nt * xrb)?;
    need(k, "y", y.len(), nt * w.rows)?;
    Ok((wrb, xrb))
}

/// `y[t][r] = W[r] · x_t` for `nt` activation rows already in the paired format: from
/// [`MMQ_MIN_ROWS`] rows on the tensor-core kernel for the integer-dot formats and the
/// register-tiled one for BF16, else the tiled kernel. Bitwise the GEMV's result for every row
/// (any `nt`).
pub fn matmul(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let tn = product_module(w.ty)?;
    let (kernel, (gx, gy)) = if nt < MMQ_MIN_ROWS {
        return matmul_tiled(gpu, w, x, nt, y);
    } else if has_mmq(w.ty) && mmq_wide_applies(w.ty, nt) {
        (
            format!("mmqw_{tn}"),
            (
                w.rows.div_ceil(MMQ_ROWS) as u32,
                nt.div_ceil(MMQ_WIDE_TOKENS) as u32,
            ),
        )
    } else if has_mmq(w.ty) {
        (format!("mmq_{tn}"), mmq_grid(w.rows, nt))
    } else if w.ty == GgmlType::BF16 {
        let (name, grid) = mmt_kernel(w.rows, nt, w.k);
        (name.to_string(), grid)
    } else {
        return matmul_tiled(gpu, w, x, nt, y);
    };
    let k = "matmul";
    let (wrb, xrb) = matmul_args(k, w, x, nt, y)?;
    let (ri, ki, ni) = (i32_of(k, w.rows)?, i32_of(k, w.k)?, i32_of(k, nt)?);
    let (wb, xb) = (u64_of(wrb), u64_of(xrb));
    if has_mmq(w.ty) {
        let q2t = mmq_q2t_on() as i32;
        let threads = if kernel.starts_with("mmqw_") {
            512
        } else {
            256
        };
        return launch!(
            gpu,
            &format!("gemv_{tn}"),
            kernel,
            cfg2(gx, gy, threads),
            [&w.bytes, x, y, &ri, &ki, &ni, &wb, &xb, &q2t]
        );
    }
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        kernel,
        cfg2(gx, gy, 256),
        [&w.bytes, x, y, &ri, &ki, &ni, &wb, &xb]
    )
}

/// Rows from which the fast prefill (`--prefill fast`, [`matmul_blas`]) takes a BF16 weight's
/// product to cuBLAS, and a quantized weight's (which first pays a dequantization of the whole
/// matrix to BF16). Chosen, not measured: a prefill chunk (512) is above both.
pub const BLAS_MIN_ROWS_BF16: usize = 64;
pub const BLAS_MIN_ROWS_QUANT: usize = 256;
/// The most elements a dequantized weight may have (the BF16 scratch: 128 MiB); larger ones
/// (an LM head over all rows) keep the exact kernels.
pub const BLAS_SCRATCH_MAX: usize = 64 << 20;

/// Formats `embed.cu dequant_bf16_*` decodes: the report's 13 but BF16 (which needs none).
pub fn has_dequant_bf16(ty: GgmlType) -> bool {
    ty != GgmlType::BF16 && strata_engine::kernels::embed::REPORT_FORMATS.contains(&ty)
}

/// Whether the fast prefill runs `w`'s product of `nt` rows by cuBLAS: a dense (not expert)
/// BF16 weight from [`BLAS_MIN_ROWS_BF16`] rows, a dense quantized weight of a format
/// `dequant_bf16_*` decodes from [`BLAS_MIN_ROWS_QUANT`] rows and at most
/// [`BLAS_SCRATCH_MAX`] elements; every size within cuBLAS's 32-bit arguments. Its activations
/// are then the rows' BF16 image, whatever the weight's paired format.
pub fn blas_applies(w: &DevWeight, nt: usize) -> bool {
    blas_takes(w.ty, w.rows, w.k, w.n_expert, nt)
}

/// [`blas_applies`] on a weight's shape: `rows` × `k` of `ty`, `n_expert` slabs, `nt` rows.
pub fn blas_takes(ty: GgmlType, rows: usize, k: usize, n_expert: usize, nt: usize) -> bool {
    let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
    if n_expert > 1 || !k.is_multiple_of(32) || !fits(rows) || !fits(k) || !fits(nt) {
        return false;
    }
    let over = BLAS_MIN_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed);
    let min = |d: usize| if over > 0 { over } else { d };
    match ty {
        GgmlType::BF16 => nt >= min(BLAS_MIN_ROWS_BF16),
        t if has_dequant_bf16(t) => {
            nt >= min(BLAS_MIN_ROWS_QUANT)
                && rows.checked_mul(k).is_some_and(|e| e <= BLAS_SCRATCH_MAX)
        }
        _ => false,
    }
}

/// Whether a product goes to cuBLAS now: the fast prefill on (`fast`), a shape
/// [`blas_applies`] takes, and not inside a recorded step (checked last: it takes a lock).
pub fn blas_now(gpu: &Gpu, fast: bool, w: &DevWeight, nt: usize) -> bool {
    fast && blas_applies(w, nt) && !gpu.recording()
}

/// 0: the thresholds above; else the rows from which every format takes cuBLAS.
static BLAS_MIN_OVERRIDE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// For tests on small files (whose prompts are shorter than the thresholds): the fast prefill
/// takes every product of at least `rows` rows (never fewer than 9: steps of 1..8 rows are
/// recorded and keep the exact kernels); None restores the thresholds.
pub fn set_blas_min_rows(rows: Option<usize>) {
    let v = rows.map_or(0, |r| r.max(9));
    BLAS_MIN_OVERRIDE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The fast prefill's product (not the GEMV's bits: within a stated tolerance, docs/CUDA.md
/// "Fast prefill"): `y[t][r] = Σ_k W[r][k]·x[t][k]` by cuBLAS on the tensor cores, BF16 inputs
/// and f32 accumulation, `x` the rows' BF16 image; a quantized `w` is first dequantized to
/// BF16 into the scratch (`embed.cu dequant_bf16_*`: the CPU's values, rounded once).
pub fn matmul_blas(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let k = "matmul_blas";
    if !blas_applies(w, nt) {
        return Err(bad(k, format!("{} {}×{} at {nt} rows", w.ty, w.rows, w.k)));
    }
    need(k, "w", w.bytes.len(), w.rows * w.row_bytes()?)?;
    need(k, "x", x.len(), nt * w.k * 2)?;
    need(k, "y", y.len(), nt * w.rows)?;
    let (m, n, kk) = (w.rows as i32, nt as i32, w.k as i32);
    gpu.with_blas(|b| {
        let st = gpu.stream().clone();
        let a = if w.ty == GgmlType::BF16 {
            crate::record::addr(&w.bytes, &st)
        } else {
            let elems = w.rows * w.k;
            if b.scratch.as_ref().is_none_or(|s| s.len() < elems) {
                b.scratch = None;
                b.scratch = Some(gpu.alloc_uninit::<u16>(elems)?);
            }
            let Some(scratch) = b.scratch.as_mut() else {
                return Err(bad(k, "no scratch".into()));
            };
            let units = (w.k / 32) as u32;
            let (ri, rb) = (w.rows as u32, w.row_bytes()? as u64);
            gpu.note_bytes(w.rows * w.row_bytes()? + elems * 2);
            launch!(
                gpu,
                "embed",
                format!("dequant_bf16_{}", w.ty.name().to_lowercase()),
                cfg((w.rows * w.k / 32).div_ceil(256) as u32, 256),
                [&w.bytes, &mut *scratch, &ri, &units, &rb]
            )?;
            crate::record::addr(scratch, &st)
        };
        let xb = crate::record::addr(x, &st);
        let yb = crate::record::addr_mut(y, &st);
        let (one, zero) = (1.0f32, 0.0f32);
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        gpu.note_bytes(w.rows * w.k * 2 + nt * w.k * 2 + nt * w.rows * 4);
        gpu.timed("cublas_gemm_bf16", || {
            // SAFETY: a, x and y are live device buffers of at least rows·k, nt·k BF16 and
            // nt·rows f32 elements (checked above); column-major, C (rows × nt, ld rows) =
            // Aᵀ (A: k × rows, ld k) · B (k × nt, ld k) is y's rows of x·Wᵀ.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *b.handle.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    kk,
                    (&one as *const f32).cast(),
                    a as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    kk,
                    xb as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    kk,
                    (&zero as *const f32).cast(),
                    yb as *mut std::ffi::c_void,
                    cudaDataType::CUDA_R_32F,
                    m,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| CudaError::Launch {
                kernel: "cublasGemmEx".into(),
                what: e.to_string(),
            })
        })
    })
}

/// Activation rows a block of the wide dense tensor-core product (mmq.cu `mmqw_*`).
pub const MMQ_WIDE_TOKENS: usize = 32;

/// Whether a dense product of `nt` rows runs the wide tensor-core tile (mmq.cu `mmqw_*`: 32
/// weight rows × 32 activation rows a block of 16 warps, each weight unit decoded once for 32
/// rows instead of 16 and each activation unit staged once for 32 weight rows; the same bits):
/// from 64 rows on, every integer format but Q6_K; `STRATA_CUDA_MMQ_WIDE=0` keeps `mmq_*`.
pub fn mmq_wide_applies(ty: GgmlType, nt: usize) -> bool {
    nt >= 64
        && ty != GgmlType::Q6_K
        && has_mmq(ty)
        && crate::device::switch_on("STRATA_CUDA_MMQ_WIDE")
}

/// Whether the tensor-core products stage Q2_0 in the transposed element order (mmq.cu
/// `mmq_stage_w`: a shift and mask a weight word instead of spreading each code byte, the
/// activation words transposed to match; the same integer dots, the same bits);
/// `STRATA_CUDA_MMQ_Q2T=0` keeps the byte-wise decoder, for A/B.
pub fn mmq_q2t_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_MMQ_Q2T")
}

/// [`matmul`] by the tiled kernel (gemv.cu `matmul_*`: one warp a weight row, 8 activation rows
/// a tile): the live path for F32 and small batches, and the baseline the tensor-core and BF16
/// kernels are tested against.
pub fn matmul_tiled(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let k = "matmul";
    let tn = product_module(w.ty)?;
    let (wrb, xrb) = matmul_args(k, w, x, nt, y)?;
    if nt == 0 {
        return Ok(());
    }
    let (ri, ki, ni) = (i32_of(k, w.rows)?, i32_of(k, w.k)?, i32_of(k, nt)?);
    let (wb, xb) = (u64_of(wrb), u64_of(xrb));
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        format!("matmul_{tn}"),
        cfg2(w.rows.div_ceil(4) as u32, nt.div_ceil(8) as u32, 128),
        [&w.bytes, x, y, &ri, &ki, &ni, &wb, &xb]
    )
}

/// Weights of at least this many rows keep the row-parallel optimized GEMV where their shape
/// has one (a warp per row already fills the GPU); fewer rows, or shapes without one, run the
/// unit-parallel product.
const UNITS_BELOW_ROWS: usize = 4096;

/// Whether [`product`] runs `w` at `nt` rows as the unit-parallel product (so that weights of
/// one format and row length against the same image can share a [`product_units`] launch).
pub fn units_preferred(w: &DevWeight, nt: usize) -> bool {
    units_apply(w, nt) && !direct_opt(w, nt) && !(opt_shape(w) && w.rows >= UNITS_BELOW_ROWS)
}

/// Whether the row-parallel optimized GEMV has a kernel for `w`'s shape.
fn opt_shape(w: &DevWeight) -> bool {
    (w.k == 2560 && strata_engine::kernels::gemv::GEMV_FORMATS.contains(&w.ty))
        || (w.k == 10240 && w.ty == GgmlType::BF16)
}

/// The shapes [`product`] runs with an optimized GEMV of its own (outside the catalogue's
/// GEMV formats and row length): the hyper-connection down / inject (BF16 rows of 10240), the
/// GDN qkv (Q3_K rows of 2560, many rows), and for one activation row the GDN and attention
/// outputs (Q4_K / Q5_K rows of 6144), where the unit-parallel blocks would stage a long
/// activation row for two weight rows each. All keep gemv_base's order.
pub fn direct_opt(w: &DevWeight, nt: usize) -> bool {
    (1..=8).contains(&nt)
        && match (w.ty, w.k) {
            (GgmlType::BF16, 10240) | (GgmlType::Q3_K, 2560) => w.rows >= UNITS_BELOW_ROWS,
            (GgmlType::Q4_K | GgmlType::Q5_K, 6144) => nt == 1 && w.rows >= 1024,
            _ => false,
        }
}

/// Whether [`product`] runs `w` for one activation row as gemv.cu `gemv_rows4_*` (each warp's
/// rows brought in by one bulk copy before the wait; gemv_opt's bits): rows of 2560 in Q6_K (at
/// least 16,384: the LM head) or in Q3_K, Q4_K or IQ4_XS (at least 4,096: the GDN qkv and
/// gate); `STRATA_CUDA_ROWS4=0` keeps gemv_opt for all, `STRATA_CUDA_ROWS4_GDN=0` for the
/// last three, for A/B.
pub fn rows4_applies(w: &DevWeight, nt: usize) -> bool {
    let least = match w.ty {
        GgmlType::Q6_K => 16384,
        GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::IQ4_XS
            if crate::device::switch_on("STRATA_CUDA_ROWS4_GDN") =>
        {
            UNITS_BELOW_ROWS
        }
        _ => return false,
    };
    nt == 1 && w.k == 2560 && w.rows >= least && crate::device::switch_on("STRATA_CUDA_ROWS4")
}

/// Rows a block and threads of gemv.cu `gemv_rows4_*` for rows of `row_bytes`, by the kernel's
/// rule (`rows_to_granule`, `WARPS`): a warp takes the fewest rows whose bytes are whole 16-byte
/// granules, eight warps a block where that is one row, else four.
pub fn rows4_geometry(row_bytes: usize) -> (usize, u32) {
    let rw = if row_bytes.is_multiple_of(16) {
        1
    } else if row_bytes.is_multiple_of(8) {
        2
    } else {
        4
    };
    let warps = if rw == 1 { 8 } else { 4 };
    (rw * warps, 32 * warps as u32)
}

/// The product the model runs: for 1..=8 rows the unit-parallel product, or the optimized GEMV
/// for weights of many rows; [`matmul`] beyond (the tensor-core kernel) and for the formats
/// without a GEMV (all bitwise the same per row).
pub fn product(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    whole_units("product", w)?;
    if rows4_applies(w, nt) {
        let (per_block, threads) = rows4_geometry(w.row_bytes()?);
        let name = format!("gemv_rows4_{}_k2560", product_module(w.ty)?);
        row_kernel(
            gpu,
            w,
            x,
            nt,
            y,
            name,
            cfg(w.rows.div_ceil(per_block) as u32, threads),
        )
    } else if direct_opt(w, nt) {
        let name = format!("gemv_opt_{}_k{}_nt{nt}", product_module(w.ty)?, w.k);
        row_kernel(gpu, w, x, nt, y, name, cfg(w.rows.div_ceil(8) as u32, 256))
    } else if units_preferred(w, nt) {
        product_units(gpu, &[w], &mut [y], x, nt)
    } else if (1..=8).contains(&nt) && strata_engine::kernels::gemv::GEMV_FORMATS.contains(&w.ty) {
        ops::gemv(gpu, "optimized", w.ty, &w.bytes, w.rows, w.k, x, nt, y)
    } else {
        matmul(gpu, w, x, nt, y)
    }
}

/// One of gemv.cu's row kernels of `w`'s module (`name`, arguments `w, x, y, rows`) over `nt`
/// activation rows, the buffers checked first.
fn row_kernel(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
    name: String,
    c: LaunchConfig,
) -> Result<(), CudaError> {
    let k = "product";
    need(k, "w", w.bytes.len(), w.rows * w.row_bytes()?)?;
    need(k, "x", x.len(), nt * w.act_row_bytes()?)?;
    need(k, "y", y.len(), nt * w.rows)?;
    let ri = i32_of(k, w.rows)?;
    gpu.note_bytes(w.rows * w.row_bytes()? + nt * w.act_row_bytes()?);
    launch!(
        gpu,
        &format!("gemv_{}", product_module(w.ty)?),
        name,
        c,
        [&w.bytes, x, y, &ri]
    )
}

/// The images of `nt` rows of `n` in BF16, Q8_0 and/or Q8_K (those given) in one launch
/// (norm.cu xprep_multi): each equals [`prepare`]'s for that format bit for bit.
pub fn prepare_multi(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    nt: usize,
    n: usize,
    bf16: Option<&mut CudaSlice<u8>>,
    q8_0: Option<&mut CudaSlice<u8>>,
    q8k: Option<&mut CudaSlice<u8>>,
) -> Result<(), CudaError> {
    let k = "prepare_multi";
    need(k, "x", x.len(), nt * n)?;
    let ptr = |fmt: ActFmt, o: Option<&mut CudaSlice<u8>>| -> Result<u64, CudaError> {
        let Some(o) = o else { return Ok(0) };
        let rb = fmt
            .row_bytes(n)
            .ok_or_else(|| bad(k, format!("n = {n} is not whole {} blocks", fmt.name())))?;
        need(k, fmt.name(), o.len(), nt * rb)?;
        Ok(addr(gpu, o))
    };
    let (pb, pq, pk) = (
        ptr(ActFmt::Bf16, bf16)?,
        ptr(ActFmt::Q8_0, q8_0)?,
        ptr(ActFmt::Q8K, q8k)?,
    );
    if nt == 0 {
        return Ok(());
    }
    let (ti, ni) = (i32_of(k, nt)?, i32_of(k, n)?);
    launch!(
        gpu,
        "norm",
        "xprep_multi",
        grid(nt * n),
        [x, &pb, &pq, &pk, &ti, &ni]
    )
}

/// The image in `fmt` of `silu(g) · u` (`nt` rows of `n`, norm.cu swiglu_xprep): the bits of
/// [`swiglu`] then [`prepare`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_prepare(
    gpu: &Gpu,
    g: &CudaSlice<f32>,
    u: &CudaSlice<f32>,
    nt: usize,
    n: usize,
    fmt: ActFmt,
    out: &mut CudaSlice<u8>,
) -> Result<(), CudaError> {
    let k = "swiglu_prepare";
    let rb = fmt
        .row_bytes(n)
        .ok_or_else(|| bad(k, format!("n = {n} is not whole {} blocks", fmt.name())))?;
    need(k, "g", g.len(), nt * n)?;
    need(k, "u", u.len(), nt * n)?;
    need(k, "out", out.len(), nt * rb)?;
    if nt == 0 {
        return Ok(());
    }
    let (ti, ni, fi) = (i32_of(k, nt)?, i32_of(k, n)?, fmt.code() as i32);
    launch!(
        gpu,
        "norm",
        "swiglu_xprep",
        grid(nt * n),
        [g, u, out, &ti, &ni, &fi]
    )
}

/// The index of each row's largest logit (`rows × nv`, sample.cu pick_rows), ties to the lower
/// index; `nan_err` makes a NaN logit set [`ERR_NAN_LOGIT`] (the host sampler's greedy refuses
/// NaN), else NaN is never chosen (the catalogue's pick).
pub fn pick_rows(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    rows: usize,
    nv: usize,
    nan_err: bool,
    out: &mut CudaSlice<u32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "pick_rows";
    if nv == 0 {
        return Err(bad(k, "no logits".into()));
    }
    need(k, "logits", logits.len(), rows * nv)?;
    need(k, "out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (nvi, ne) = (i32_of(k, nv)?, nan_err as i32);
    launch!(
        gpu,
        "sample",
        "pick_rows",
        cfg(rows as u32, 1024),
        [logits, &nvi, out, &ne, err]
    )
}

// ---- unit-parallel products (gemv.cu gemv_units_*, the fused mix and experts) ---------------

/// Shared contributions per block of the unit-parallel kernels (gemv.cu `UNITS_PART`).
pub const UNITS_PART: usize = 6144;

/// Rows per block of a unit-parallel product of `units` units a row and `nt` activation rows
/// over `total` rows: enough rows to give the block's 256 threads a unit each where a row has
/// fewer, within the block's shared contributions (`nt · rows · units ≤ UNITS_PART`). `None`
/// when not even one row fits (rows of more than 32,768 elements at nt = 8).
pub fn units_rows_per_block(units: usize, nt: usize, total: usize) -> Option<usize> {
    if units == 0 || nt == 0 {
        return None;
    }
    let by_smem = UNITS_PART / (nt * units);
    if by_smem == 0 {
        return None;
    }
    Some(256usize.div_ceil(units).min(by_smem).min(total.max(1)))
}

/// Threads of a unit-parallel block with `work` unit contributions: one each, in whole warps,
/// at most 1024 (the kernels loop over the rest).
fn units_threads(work: usize) -> u32 {
    (work.div_ceil(32).clamp(1, 32) * 32) as u32
}

/// A device buffer's address as a kernel argument (for the launchers whose argument list is
/// fixed but whose buffers vary in number: unused slots repeat the first buffer with 0 rows).
fn addr<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(gpu.stream()).0
}

/// Whether [`product_units`] runs BF16 rows of 2560 with a warp a row (gemv.cu
/// gemv_w_bf16_k2560_nt*, the unit-parallel kernel's bits: the router with the shared gate, the
/// GDN and attention projections); `STRATA_CUDA_BF16W=0` keeps the unit-parallel kernel.
pub fn units_w_applies(w: &DevWeight, nt: usize) -> bool {
    w.ty == GgmlType::BF16
        && w.k == 2560
        && (1..=8).contains(&nt)
        && crate::device::switch_on("STRATA_CUDA_BF16W")
}

/// Whether [`product_units`] runs `w` against `nt` activation rows.
pub fn units_apply(w: &DevWeight, nt: usize) -> bool {
    (1..=8).contains(&nt)
        && has_products(w.ty)
        && w.k.is_multiple_of(32)
        && units_rows_per_block(w.k / 32, nt, w.rows).is_some()
}

/// `y_i[t][r] = W_i[r] · x_t` for up to four weights of one format and row length against the
/// same 1..=8 activation rows (already in the paired format), in one launch of the
/// unit-parallel kernel: every output has gemv_base's bits.
pub fn product_units(
    gpu: &Gpu,
    ws: &[&DevWeight],
    ys: &mut [&mut CudaSlice<f32>],
    x: &CudaSlice<u8>,
    nt: usize,
) -> Result<(), CudaError> {
    let k = "product_units";
    let (Some(w0), true) = (ws.first(), ws.len() == ys.len() && ws.len() <= 4) else {
        return Err(bad(
            k,
            format!("{} weights for {} outputs (1..=4)", ws.len(), ys.len()),
        ));
    };
    if ws.iter().any(|w| w.ty != w0.ty || w.k != w0.k) {
        return Err(bad(k, "weights of different formats or row lengths".into()));
    }
    whole_units(k, w0)?;
    let tn = product_module(w0.ty)?;
    let (wrb, xrb) = (w0.row_bytes()?, w0.act_row_bytes()?);
    need(k, "x", x.len(), nt * xrb)?;
    let mut wp = [0u64; 4];
    let mut yp = [0u64; 4];
    let mut n = [0i32; 4];
    for (i, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
        need(k, "w", w.bytes.len(), w.rows * wrb)?;
        need(k, "y", y.len(), nt * w.rows)?;
        wp[i] = addr(gpu, &w.bytes);
        yp[i] = addr(gpu, y);
        n[i] = i32_of(k, w.rows)?;
    }
    for i in ws.len()..4 {
        wp[i] = wp[0];
        yp[i] = yp[0];
    }
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let units = w0.k / 32;
    let rb = units_rows_per_block(units, nt, total)
        .ok_or_else(|| bad(k, format!("rows of {} at {nt} activation rows", w0.k)))?;
    if total == 0 {
        return Ok(());
    }
    let (ni, ki, rbi) = (i32_of(k, nt)?, i32_of(k, w0.k)?, i32_of(k, rb)?);
    let (wb, xb) = (u64_of(wrb), u64_of(xrb));
    gpu.note_bytes(total * wrb + nt * xrb);
    if units_w_applies(w0, nt) {
        return launch!(
            gpu,
            "gemv_bf16",
            format!("gemv_w_bf16_k2560_nt{nt}"),
            cfg(total.div_ceil(4) as u32, 128),
            [
                &wp[0], &wp[1], &wp[2], &wp[3], &yp[0], &yp[1], &yp[2], &yp[3], &n[0], &n[1],
                &n[2], &n[3], x
            ]
        );
    }
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        format!("gemv_units_{tn}"),
        cfg(total.div_ceil(rb) as u32, units_threads(rb * units)),
        [
            &wp[0], &wp[1], &wp[2], &wp[3], &yp[0], &yp[1], &yp[2], &yp[3], &n[0], &n[1], &n[2],
            &n[3], x, &ni, &ki, &wb, &xb, &rbi
        ]
    )
}

/// `nt` f32 rows of `w.k` to `w`'s paired activation format.
pub fn prepare(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<f32>,
    nt: usize,
    out: &mut CudaSlice<u8>,
) -> Result<(), CudaError> {
    ops::xprep(gpu, "optimized", x, out, nt, w.k, w.act()?)
}

// ---- hyper-connection mix -------------------------------------------------------------------

/// The weights of one hyper-connection module on the device.
pub struct HcDev<'a> {
    /// Grouped norm weight, `streams · h` values.
    pub norm: &'a CudaSlice<f32>,
    /// `[rank, streams·h]` and `[streams·h, rank]` BF16.
    pub down: &'a DevWeight,
    pub up: &'a DevWeight,
    /// `[streams, streams·h]` BF16 (absent for the final mixer).
    pub inject: Option<&'a DevWeight>,
    pub streams: usize,
    pub h: usize,
    pub eps: f32,
    /// The fast prefill: products it takes ([`blas_applies`]) by cuBLAS (all three weights are
    /// BF16, so the images are the same either way).
    pub fast: bool,
}

/// [`product`], or [`matmul_blas`] when `fast` and the shape is one it takes (never inside a
/// recorded step); `x` is `w`'s paired image, which must be BF16 for the latter.
fn product_or_blas(
    gpu: &Gpu,
    fast: bool,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    if w.ty == GgmlType::BF16 && blas_now(gpu, fast, w, nt) {
        matmul_blas(gpu, w, x, nt, y)
    } else {
        product(gpu, w, x, nt, y)
    }
}

/// Scratch of [`hc_mix`] for up to `rows` rows (allocated once; addresses stay fixed).
pub struct HcScratch {
    pub rows: usize,
    xn: CudaSlice<f32>,
    xq: CudaSlice<u8>,
    a: CudaSlice<f32>,
    aq: CudaSlice<u8>,
    g: CudaSlice<f32>,
}

impl HcScratch {
    pub fn new(gpu: &Gpu, hc: &HcDev<'_>, rows: usize) -> Result<HcScratch, CudaError> {
        let sh = hc.streams * hc.h;
        let rank = hc.down.rows;
        Ok(HcScratch {
            rows,
            xn: gpu.zeros(rows * sh)?,
            xq: gpu.zeros(rows * hc.down.act_row_bytes()?)?,
            a: gpu.zeros(rows * rank)?,
            aq: gpu.zeros(rows * hc.up.act_row_bytes()?)?,
            g: gpu.zeros(rows * sh)?,
        })
    }
}

/// GatedResidual mix (cpu::hc_mix): `xn = RMS_h(x)·norm`, `a = silu(down·xn / S)`,
/// `u = (Σ_s σ(up·a)_s ⊙ xn_s) / S`, and, with an inject matrix, `inj = 2σ(inject·xn / S)`.
/// `u` is `rows × h`, `inj` `rows × streams`.
pub fn hc_mix(
    gpu: &Gpu,
    hc: &HcDev<'_>,
    x: &CudaSlice<f32>,
    rows: usize,
    s: &mut HcScratch,
    u: &mut CudaSlice<f32>,
    inj: Option<&mut CudaSlice<f32>>,
) -> Result<(), CudaError> {
    let k = "hc_mix";
    let (st, h) = (hc.streams, hc.h);
    let sh = st * h;
    if rows > s.rows {
        return Err(bad(k, format!("{rows} rows; the scratch holds {}", s.rows)));
    }
    if hc.down.k != sh || hc.up.k != hc.down.rows || hc.up.rows != sh {
        return Err(bad(
            k,
            format!(
                "down {}×{}, up {}×{} for {st} streams of {h}",
                hc.down.rows, hc.down.k, hc.up.rows, hc.up.k
            ),
        ));
    }
    need(k, "u", u.len(), rows * h)?;
    if rows == 0 {
        return Ok(());
    }
    let inv_s = 1.0 / st as f32;
    rms_norm(gpu, x, hc.norm, &mut s.xn, rows, sh, h, hc.eps)?;
    prepare(gpu, hc.down, &s.xn, rows, &mut s.xq)?;
    product_or_blas(gpu, hc.fast, hc.down, &s.xq, rows, &mut s.a)?;
    // The up weight is BF16: its activation image is the BF16 rounding of silu(a / S).
    if hc.up.act()? != ActFmt::Bf16 {
        return Err(bad(k, format!("up weight {} is not BF16", hc.up.ty)));
    }
    let na = rows * hc.down.rows;
    let nn = u64_of(na);
    launch!(
        gpu,
        "elem",
        "hc_act_bf16",
        grid(na),
        [&s.a, &mut s.aq, &nn, &inv_s]
    )?;
    product_or_blas(gpu, hc.fast, hc.up, &s.aq, rows, &mut s.g)?;
    let (ri, hi, si) = (i32_of(k, rows)?, i32_of(k, h)?, i32_of(k, st)?);
    launch!(
        gpu,
        "elem",
        "hc_u_f32",
        grid(rows * h),
        [&s.g, &s.xn, u, &ri, &hi, &si, &inv_s]
    )?;
    match (hc.inject, inj) {
        (Some(wi), Some(inj)) => {
            if wi.rows != st || wi.k != sh || wi.act()? != hc.down.act()? {
                return Err(bad(
                    k,
                    format!("inject {}×{} for {st} streams", wi.rows, wi.k),
                ));
            }
            need(k, "inj", inj.len(), rows * st)?;
            product_or_blas(gpu, hc.fast, wi, &s.xq, rows, inj)?;
            let ni = u64_of(rows * st);
            launch!(
                gpu,
                "elem",
                "hc_inj_f32",
                grid(rows * st),
                [inj, &ni, &inv_s]
            )
        }
        (None, None) => Ok(()),
        _ => Err(bad(
            k,
            "inject weights and the inject output go together".into(),
        )),
    }
}

/// The residual a fused mix reads: as it is, or after the previous block's combine
/// (`x_s += inj_s · y`, `y` `rows × h`, `inj` `rows × streams`), which the mix writes back.
pub enum MixInput<'a> {
    Plain(&'a CudaSlice<f32>),
    Combine {
        x: &'a mut CudaSlice<f32>,
        y: &'a CudaSlice<f32>,
        inj: &'a CudaSlice<f32>,
    },
}

/// The longest stream the fused mix's norm stages in shared memory (gemv.cu HC_NORM_MAX_H).
const HC_NORM_MAX_H: usize = 4096;

/// Whether [`hc_mix_fused`] runs this mix at `rows` rows: BF16 down, up and inject weights
/// (their activation images are BF16), whole 32-element units, 1..=8 rows.
pub fn hc_fused_applies(hc: &HcDev<'_>, rows: usize) -> bool {
    let bf16 = |w: &DevWeight| w.ty == GgmlType::BF16;
    (1..=8).contains(&rows)
        && bf16(hc.down)
        && bf16(hc.up)
        && hc.inject.is_none_or(bf16)
        && hc.h <= HC_NORM_MAX_H
        && hc.down.k.is_multiple_of(32)
        && hc.up.k.is_multiple_of(32)
        && units_rows_per_block(hc.down.k / 32, rows, 1).is_some()
        && units_rows_per_block(hc.up.k / 32, rows, hc.up.rows).is_some_and(|r| r >= hc.streams)
}

/// Whether the mix's up product runs gemv.cu hc_up_q4_bf16 (four threads a row, the same bits
/// as hc_up_u_bf16): at most 12 units of rank, 1, 2, 4 or 8 streams, 1..=8 rows;
/// `STRATA_CUDA_HC_UP4=0` keeps hc_up_u_bf16, for A/B.
pub fn hc_up_q4_applies(streams: usize, rank: usize, rows: usize) -> bool {
    crate::device::switch_on("STRATA_CUDA_HC_UP4")
        && matches!(streams, 1 | 2 | 4 | 8)
        && rank.is_multiple_of(32)
        && (1..=12).contains(&(rank / 32))
        && (1..=8).contains(&rows)
}

/// [`hc_mix`] in three launches (gemv.cu hc_norm_bf16 or hc_combine_norm_bf16, hc_down_bf16,
/// hc_up_u_bf16) with its bits; with `combine`, the previous block's [`hc_combine`] first
/// (`x` updated in place, the same bits as the separate launch).
#[allow(clippy::too_many_arguments)]
pub fn hc_mix_fused(
    gpu: &Gpu,
    hc: &HcDev<'_>,
    x: MixInput<'_>,
    rows: usize,
    s: &mut HcScratch,
    u: &mut CudaSlice<f32>,
    inj: Option<&mut CudaSlice<f32>>,
) -> Result<(), CudaError> {
    let k = "hc_mix_fused";
    let (st, h) = (hc.streams, hc.h);
    let (sh, rank) = (st * h, hc.down.rows);
    if !hc_fused_applies(hc, rows) || rows > s.rows {
        return Err(bad(k, format!("{rows} rows of this mix's weights")));
    }
    if hc.down.k != sh || hc.up.k != rank || hc.up.rows != sh {
        return Err(bad(
            k,
            format!(
                "down {}×{}, up {}×{} for {st} streams of {h}",
                hc.down.rows, hc.down.k, hc.up.rows, hc.up.k
            ),
        ));
    }
    need(k, "u", u.len(), rows * h)?;
    let inv_s = 1.0 / st as f32;
    let (hi, si, ri, ki, ni) = (
        i32_of(k, h)?,
        i32_of(k, st)?,
        i32_of(k, rank)?,
        i32_of(k, sh)?,
        i32_of(k, rows)?,
    );
    let eps = hc.eps;
    let blocks = (rows * st) as u32;
    // The rows, the norm's weight (and the combine's y and inj).
    gpu.note_bytes(
        4 * (rows * sh + sh) + matches!(x, MixInput::Combine { .. }) as usize * 4 * rows * (h + st),
    );
    match x {
        MixInput::Combine { x, y, inj } => {
            need(k, "x", x.len(), rows * sh)?;
            need(k, "y", y.len(), rows * h)?;
            need(k, "inj", inj.len(), rows * st)?;
            launch!(
                gpu,
                "gemv_bf16",
                "hc_combine_norm_bf16",
                cfg(blocks, 1024),
                [&mut *x, y, inj, hc.norm, &mut s.xn, &mut s.xq, &hi, &si, &eps]
            )?
        }
        MixInput::Plain(x) => {
            need(k, "x", x.len(), rows * sh)?;
            launch!(
                gpu,
                "gemv_bf16",
                "hc_norm_bf16",
                cfg(blocks, 1024),
                [x, hc.norm, &mut s.xn, &mut s.xq, &hi, &si, &eps]
            )?
        }
    }
    // The stacked [down; inject] rows (no inject: the final mixer's down alone).
    let (wi, n_inj, inj_out) = hc_inject_rows(gpu, hc, inj, rows, &s.a)?;
    let total = rank + n_inj;
    let rb = units_rows_per_block(sh / 32, rows, total)
        .ok_or_else(|| bad(k, format!("rows of {sh}")))?;
    let (nii, rbi) = (i32_of(k, n_inj)?, i32_of(k, rb)?);
    gpu.note_bytes(2 * total * sh + 2 * rows * sh);
    launch!(
        gpu,
        "gemv_bf16",
        "hc_down_bf16",
        cfg(total.div_ceil(rb) as u32, units_threads(rb * sh / 32)),
        [
            &hc.down.bytes,
            &wi.bytes,
            &s.xq,
            &mut s.aq,
            &inj_out,
            &ri,
            &nii,
            &ki,
            &ni,
            &rbi,
            &inv_s
        ]
    )?;
    // The up rows, the activation image and the normed rows.
    gpu.note_bytes(2 * sh * rank + 2 * rows * rank + 4 * rows * sh);
    if hc_up_q4_applies(st, rank, rows) {
        // The normed rows were written two launches back (the norm, then the down, which waits
        // for it): settled when the up starts, so its blocks may load them before their wait
        // (`STRATA_CUDA_HC_UP_EARLY`, session 12; not with the opt-in trigger-first, which
        // lets kernels start before the one before them has waited). Each of the block's
        // outputs takes one thread (rows · 64/S ≤ 256).
        let early = i32::from(
            crate::device::switch_on("STRATA_CUDA_HC_UP_EARLY")
                && !crate::sources::trigger_first()
                && rows * (64 / st) <= 256,
        );
        return launch!(
            gpu,
            "gemv_bf16",
            "hc_up_q4_bf16",
            cfg(h.div_ceil(64 / st) as u32, 256),
            [
                &hc.up.bytes,
                &s.aq,
                &s.xn,
                u,
                &hi,
                &si,
                &ri,
                &ni,
                &inv_s,
                &early
            ]
        );
    }
    let rb = units_rows_per_block(rank / 32, rows, sh)
        .ok_or_else(|| bad(k, format!("rows of {rank}")))?;
    let j = (rb / st).clamp(1, 512 / (rows * st));
    let ji = i32_of(k, j)?;
    launch!(
        gpu,
        "gemv_bf16",
        "hc_up_u_bf16",
        cfg(h.div_ceil(j) as u32, units_threads(st * j * rank / 32)),
        [
            &hc.up.bytes,
            &s.aq,
            &s.xn,
            u,
            &hi,
            &si,
            &ri,
            &ni,
            &ji,
            &inv_s
        ]
    )
}

/// The inject rows stacked under a mix's down rows, their count and the inject output's
/// address: the module's inject weight and `inj` (checked against `rows`), or, for the final
/// mixer, none (the down weight and `spare` stand in the unused slots).
fn hc_inject_rows<'w>(
    gpu: &Gpu,
    hc: &HcDev<'w>,
    inj: Option<&mut CudaSlice<f32>>,
    rows: usize,
    spare: &CudaSlice<f32>,
) -> Result<(&'w DevWeight, usize, u64), CudaError> {
    let k = "hc_mix_fused";
    let (st, sh) = (hc.streams, hc.streams * hc.h);
    match (hc.inject, inj) {
        (Some(wi), Some(o)) => {
            if wi.rows != st || wi.k != sh {
                return Err(bad(
                    k,
                    format!("inject {}×{} for {st} streams", wi.rows, wi.k),
                ));
            }
            need(k, "inj", o.len(), rows * st)?;
            Ok((wi, st, addr(gpu, o)))
        }
        (None, None) => Ok((hc.down, 0, addr(gpu, spare))),
        _ => Err(bad(
            k,
            "inject weights and the inject output go together".into(),
        )),
    }
}

// ---- Gated DeltaNet -------------------------------------------------------------------------

/// Causal depthwise conv of `n` rows of `c` channels continuing from `hist` (`(k−1)·dil` rows,
/// updated in place), kernel `w` `[c][k]`, then silu.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_silu(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    hist: &mut CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
    c: usize,
    k: usize,
    dil: usize,
) -> Result<(), CudaError> {
    let kn = "conv1d_silu";
    if k == 0 || dil == 0 {
        return Err(bad(kn, format!("kernel {k}, dilation {dil}")));
    }
    need(kn, "x", x.len(), n * c)?;
    need(kn, "w", w.len(), c * k)?;
    need(kn, "history", hist.len(), (k - 1) * dil * c)?;
    need(kn, "out", out.len(), n * c)?;
    let (ni, ci, ki, di) = (
        i32_of(kn, n)?,
        i32_of(kn, c)?,
        i32_of(kn, k)?,
        i32_of(kn, dil)?,
    );
    if n > 8 && conv_rows_on() {
        // A prefill: rows in parallel, then the history (gdn.cu conv1d_rows_f32 / _hist_f32).
        launch!(
            gpu,
            "gdn",
            "conv1d_rows_f32",
            cfg2(c.div_ceil(256) as u32, n.div_ceil(8) as u32, 256),
            [x, w, &*hist, out, &ni, &ci, &ki, &di]
        )?;
        return launch!(
            gpu,
            "gdn",
            "conv1d_hist_f32",
            cfg(c.div_ceil(256) as u32, 256),
            [x, hist, &ni, &ci, &ki, &di]
        );
    }
    launch!(
        gpu,
        "gdn",
        "conv1d_silu_f32",
        cfg(c.div_ceil(256) as u32, 256),
        [x, w, hist, out, &ni, &ci, &ki, &di]
    )
}

/// Whether [`conv1d_silu`] of more than 8 rows runs gdn.cu `conv1d_rows_f32` (a thread per
/// channel and 8 rows) and `conv1d_hist_f32` instead of a thread per channel over every row:
/// the same bits; `STRATA_CUDA_CONV_ROWS=0` keeps the one kernel, for A/B.
pub fn conv_rows_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_CONV_ROWS")
}

/// Geometry of a GDN layer (as `strata_engine::backend::GdnDims`).
pub use strata_engine::qwen4exp::ops::GdnDims;

/// The per-head constants of a GDN layer on the device (f32 images).
pub struct GdnDev<'a> {
    pub ssm_a: &'a CudaSlice<f32>,
    pub dt_bias: &'a CudaSlice<f32>,
    pub norm: &'a CudaSlice<f32>,
    pub dims: GdnDims,
    pub eps: f32,
}

/// The recurrent Gated DeltaNet step over `n` rows in order (the exact mode): `qkv` `[n,
/// conv_dim]` (convolved), `z` `[n, value_dim]`, `alpha`/`beta` `[n, n_v_heads]`, `state`
/// `[n_v_heads, head_k·head_v]` updated in place, `out` `[n, value_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_step(
    gpu: &Gpu,
    p: &GdnDev<'_>,
    qkv: &CudaSlice<f32>,
    z: &CudaSlice<f32>,
    alpha: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let k = "gdn_step";
    let d = p.dims;
    let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.head_k, d.head_v);
    if nk == 0 || !nv.is_multiple_of(nk) || dk != dv || !matches!(dk, 16 | 32 | 64 | 128) {
        return Err(bad(
            k,
            format!("{d:?}: the kernels take head_k = head_v in 16, 32, 64, 128"),
        ));
    }
    need(k, "qkv", qkv.len(), n * d.conv_dim())?;
    need(k, "z", z.len(), n * d.value_dim())?;
    need(k, "alpha", alpha.len(), n * nv)?;
    need(k, "beta", beta.len(), n * nv)?;
    need(k, "ssm_a", p.ssm_a.len(), nv)?;
    need(k, "dt_bias", p.dt_bias.len(), nv)?;
    need(k, "norm", p.norm.len(), dv)?;
    need(k, "state", state.len(), nv * dk * dv)?;
    need(k, "out", out.len(), n * d.value_dim())?;
    let (ni, nki, nvi) = (i32_of(k, n)?, i32_of(k, nk)?, i32_of(k, nv)?);
    launch!(
        gpu,
        "gdn",
        format!("gdn_step_{dk}_{dv}"),
        cfg(nv as u32, dv as u32),
        [qkv, z, alpha, beta, p.ssm_a, p.dt_bias, p.norm, state, out, &ni, &nki, &nvi, &p.eps]
    )
}

/// Scratch of [`gdn_step_scan`] for up to `rows` rows: normalised q/k, (β, decay), the output
/// before its norm.
pub struct GdnScratch {
    pub rows: usize,
    qn: CudaSlice<f32>,
    kn: CudaSlice<f32>,
    bd: CudaSlice<f32>,
    oraw: CudaSlice<f32>,
}

impl GdnScratch {
    pub fn new(gpu: &Gpu, dims: GdnDims, rows: usize) -> Result<GdnScratch, CudaError> {
        Ok(GdnScratch {
            rows,
            qn: gpu.zeros(rows * dims.key_dim())?,
            kn: gpu.zeros(rows * dims.key_dim())?,
            bd: gpu.zeros(rows * dims.n_v_heads * 2)?,
            oraw: gpu.zeros(rows * dims.value_dim())?,
        })
    }
}

/// Whether [`gdn_step_scan`] runs gdn.cu `gdn_scan_ring_*` (the rows' inputs staged in shared
/// memory by cp.async, row t's output sum interleaved with row t + 1's k·S sum: the same bits as
/// `gdn_scan_*`); `STRATA_CUDA_GDN_RING=0` keeps `gdn_scan_*`, for A/B.
pub fn gdn_ring_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_GDN_RING")
}

/// [`gdn_step`] spread over the state's columns (one warp per 32 columns of a head, no block
/// syncs in the row loop), for prefill: three launches (prep, scan, output norm), every value
/// bitwise [`gdn_step`]'s.
#[allow(clippy::too_many_arguments)]
pub fn gdn_step_scan(
    gpu: &Gpu,
    p: &GdnDev<'_>,
    qkv: &CudaSlice<f32>,
    z: &CudaSlice<f32>,
    alpha: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
    s: &mut GdnScratch,
) -> Result<(), CudaError> {
    let k = "gdn_step_scan";
    let d = p.dims;
    let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.head_k, d.head_v);
    if nk == 0
        || !nv.is_multiple_of(nk)
        || !matches!(dk, 32 | 64 | 128)
        || dv == 0
        || dv > 256
        || !dv.is_multiple_of(32)
        || n > s.rows
    {
        return Err(bad(
            k,
            format!(
                "{d:?}, {n} rows of {}: head_k in 32, 64, 128; head_v a multiple of 32 up to 256",
                s.rows
            ),
        ));
    }
    need(k, "qkv", qkv.len(), n * d.conv_dim())?;
    need(k, "z", z.len(), n * d.value_dim())?;
    need(k, "alpha", alpha.len(), n * nv)?;
    need(k, "beta", beta.len(), n * nv)?;
    need(k, "ssm_a", p.ssm_a.len(), nv)?;
    need(k, "dt_bias", p.dt_bias.len(), nv)?;
    need(k, "norm", p.norm.len(), dv)?;
    need(k, "state", state.len(), nv * dk * dv)?;
    need(k, "out", out.len(), n * d.value_dim())?;
    if n == 0 {
        return Ok(());
    }
    let (ni, nki, nvi, dki, dvi) = (
        i32_of(k, n)?,
        i32_of(k, nk)?,
        i32_of(k, nv)?,
        i32_of(k, dk)?,
        i32_of(k, dv)?,
    );
    launch!(
        gpu,
        "gdn",
        "gdn_prep",
        cfg2(n as u32, nk as u32, 128),
        [
            qkv, alpha, beta, p.ssm_a, p.dt_bias, &mut s.qn, &mut s.kn, &mut s.bd, &nki, &nvi,
            &dki, &dvi
        ]
    )?;
    let scan = if gdn_ring_on() {
        "gdn_scan_ring"
    } else {
        "gdn_scan"
    };
    launch!(
        gpu,
        "gdn",
        format!("{scan}_{dk}"),
        cfg2(nv as u32, (dv / 32) as u32, 32),
        [
            &s.qn,
            &s.kn,
            &s.bd,
            qkv,
            state,
            &mut s.oraw,
            &ni,
            &nki,
            &nvi,
            &dvi
        ]
    )?;
    launch!(
        gpu,
        "gdn",
        "gdn_out",
        cfg((n * nv) as u32, dv as u32),
        [&s.oraw, z, p.norm, out, &dvi, &p.eps]
    )
}

/// [`gdn_step`] in the chunked (WY) form over chunks of 16 rows, for prefill: within a stated
/// bound of the sequential form (which stays the exact mode). `head_k = head_v = 128` only.
#[allow(clippy::too_many_arguments)]
pub fn gdn_step_chunked(
    gpu: &Gpu,
    p: &GdnDev<'_>,
    qkv: &CudaSlice<f32>,
    z: &CudaSlice<f32>,
    alpha: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let k = "gdn_step_chunked";
    let d = p.dims;
    let (nk, nv) = (d.n_k_heads, d.n_v_heads);
    if nk == 0 || !nv.is_multiple_of(nk) || d.head_k != 128 || d.head_v != 128 {
        return Err(bad(
            k,
            format!("{d:?}: the chunked kernel takes heads of 128"),
        ));
    }
    need(k, "qkv", qkv.len(), n * d.conv_dim())?;
    need(k, "z", z.len(), n * d.value_dim())?;
    need(k, "alpha", alpha.len(), n * nv)?;
    need(k, "beta", beta.len(), n * nv)?;
    need(k, "ssm_a", p.ssm_a.len(), nv)?;
    need(k, "dt_bias", p.dt_bias.len(), nv)?;
    need(k, "norm", p.norm.len(), 128)?;
    need(k, "state", state.len(), nv * 128 * 128)?;
    need(k, "out", out.len(), n * d.value_dim())?;
    if n == 0 {
        return Ok(());
    }
    let (ni, nki, nvi) = (i32_of(k, n)?, i32_of(k, nk)?, i32_of(k, nv)?);
    launch!(
        gpu,
        "gdn",
        "gdn_chunk_128",
        cfg(nv as u32, 128),
        [qkv, z, alpha, beta, p.ssm_a, p.dt_bias, p.norm, state, out, &ni, &nki, &nvi, &p.eps]
    )
}

// ---- attention ------------------------------------------------------------------------------

/// `store[pos[r]] = x[r]` for `n` rows of `cols` into a store of `cap` rows, rounded through F16
/// when `f16` (the values an F16 cache holds). Positions past `cap` set [`ERR_CAPACITY`].
#[allow(clippy::too_many_arguments)]
pub fn kv_append(
    gpu: &Gpu,
    store: &mut CudaSlice<f32>,
    cap: usize,
    x: &CudaSlice<f32>,
    pos: &CudaSlice<u32>,
    n: usize,
    cols: usize,
    f16: bool,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "kv_append";
    need(k, "store", store.len(), cap * cols)?;
    need(k, "x", x.len(), n * cols)?;
    need(k, "positions", pos.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (capu, ci, fi) = (cap as u32, i32_of(k, cols)?, f16 as i32);
    launch!(
        gpu,
        "attn",
        "kv_append_f32",
        cfg(n as u32, 256),
        [store, &capu, x, pos, &ci, &fi, err]
    )
}

/// QSA block pooling for the `n` rows at `pos`: each row that completes a block writes that
/// block's key (mean of `ratio` raw keys, RMS norm with `w`, rope at the block's first token) to
/// `blocks` (capacity `cap_blocks` rows of `d`).
#[allow(clippy::too_many_arguments)]
pub fn qsa_pool(
    gpu: &Gpu,
    kraw: &CudaSlice<f32>,
    blocks: &mut CudaSlice<f32>,
    cap_blocks: usize,
    pos: &CudaSlice<u32>,
    n: usize,
    d: usize,
    ratio: usize,
    w: &CudaSlice<f32>,
    eps: f32,
    freqs: &CudaSlice<f64>,
    rot: usize,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "qsa_pool";
    if ratio == 0 || d == 0 || d > 1024 || rot > d || !rot.is_multiple_of(2) {
        return Err(bad(k, format!("ratio {ratio}, d {d} (≤ 1024), rot {rot}")));
    }
    need(k, "kraw", kraw.len(), cap_blocks * ratio * d)?;
    need(k, "blocks", blocks.len(), cap_blocks * d)?;
    need(k, "positions", pos.len(), n)?;
    need(k, "w", w.len(), d)?;
    need(k, "freqs", freqs.len(), rot / 2)?;
    if n == 0 {
        return Ok(());
    }
    let (cb, di, ri, roti) = (
        cap_blocks as u32,
        i32_of(k, d)?,
        i32_of(k, ratio)?,
        i32_of(k, rot)?,
    );
    launch!(
        gpu,
        "attn",
        "qsa_pool",
        cfg(n as u32, 256),
        [kraw, blocks, &cb, pos, &di, &ri, w, &eps, freqs, &roti, err]
    )
}

/// The geometry of a [`qsa_prep`] launch: `hq` query heads and `hkv` key/value heads of `hd`,
/// `hi` indexer heads of `di` (0 without the indexer), RoPE over the first `rot` dims, blocks of
/// `ratio` tokens.
#[derive(Clone, Copy, Debug)]
pub struct QsaPrepGeom {
    pub hq: usize,
    pub hkv: usize,
    pub hd: usize,
    pub hi: usize,
    pub di: usize,
    pub rot: usize,
    pub ratio: usize,
    pub eps: f32,
}

/// The indexer's buffers of a [`qsa_prep`] launch: its query and raw-key rows, norms, the
/// queries it writes and the raw-key and pooled-block stores (their capacities in rows).
pub struct QsaPrepIndex<'a> {
    pub qi: &'a CudaSlice<f32>,
    pub kraw: &'a CudaSlice<f32>,
    pub wiq: &'a CudaSlice<f32>,
    pub wik: &'a CudaSlice<f32>,
    pub qi_out: &'a mut CudaSlice<f32>,
    pub kraw_store: &'a mut CudaSlice<f32>,
    pub kraw_cap: usize,
    pub blocks: &'a mut CudaSlice<f32>,
    pub blocks_cap: usize,
}

/// A QSA layer's row preparation in one launch (attn.cu `qsa_prep`; the composition it keeps
/// the bits of is `strata_engine::qwen4exp::ops::qsa_prepare_composed`) for `rows` rows at
/// consecutive positions `pos`: queries deinterleaved from `qg` into `q_out` and `gate_out`,
/// normed and rotated; keys normed, rotated and written with the values into `kc` / `vc`
/// (`cap` rows); with `index`, the indexer's side.
#[allow(clippy::too_many_arguments)]
pub fn qsa_prep(
    gpu: &Gpu,
    g: &QsaPrepGeom,
    rows: usize,
    qg: &CudaSlice<f32>,
    k_in: &CudaSlice<f32>,
    v_in: &CudaSlice<f32>,
    wq: &CudaSlice<f32>,
    wk: &CudaSlice<f32>,
    pos: &CudaSlice<u32>,
    freqs: &CudaSlice<f64>,
    q_out: &mut CudaSlice<f32>,
    gate_out: &mut CudaSlice<f32>,
    kc: &mut CudaSlice<f32>,
    vc: &mut CudaSlice<f32>,
    cap: usize,
    index: Option<QsaPrepIndex<'_>>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "qsa_prep";
    let idx = index.is_some();
    let (hi, di) = if idx { (g.hi, g.di) } else { (0, 0) };
    if g.hq == 0
        || g.hkv == 0
        || g.hd == 0
        || g.hd > 1024
        || g.rot > g.hd
        || !g.rot.is_multiple_of(2)
        || (idx && (hi == 0 || di == 0 || di > 1024 || g.rot > di || g.ratio == 0))
    {
        return Err(bad(
            k,
            format!("{g:?} (head dims ≤ 1024, rot even and ≤ both)"),
        ));
    }
    let (qc, kvc) = (g.hq * g.hd, g.hkv * g.hd);
    need(k, "qg", qg.len(), rows * 2 * qc)?;
    need(k, "k", k_in.len(), rows * kvc)?;
    need(k, "v", v_in.len(), rows * kvc)?;
    need(k, "q norm", wq.len(), g.hd)?;
    need(k, "k norm", wk.len(), g.hd)?;
    need(k, "positions", pos.len(), rows)?;
    need(k, "freqs", freqs.len(), g.rot / 2)?;
    need(k, "q out", q_out.len(), rows * qc)?;
    need(k, "gate out", gate_out.len(), rows * qc)?;
    need(k, "k cache", kc.len(), cap * kvc)?;
    need(k, "v cache", vc.len(), cap * kvc)?;
    let st = gpu.stream();
    let (mut a_qi, mut a_kraw, mut a_wiq, mut a_wik, mut a_qio, mut a_krs, mut a_bl) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut kraw_cap, mut blocks_cap) = (0u32, 0u32);
    if let Some(ix) = index {
        need(k, "qi", ix.qi.len(), rows * hi * di)?;
        need(k, "kraw", ix.kraw.len(), rows * di)?;
        need(k, "qi norm", ix.wiq.len(), di)?;
        need(k, "kraw norm", ix.wik.len(), di)?;
        need(k, "qi out", ix.qi_out.len(), rows * hi * di)?;
        need(k, "kraw store", ix.kraw_store.len(), ix.kraw_cap * di)?;
        need(k, "block store", ix.blocks.len(), ix.blocks_cap * di)?;
        a_qi = crate::record::addr(ix.qi, st);
        a_kraw = crate::record::addr(ix.kraw, st);
        a_wiq = crate::record::addr(ix.wiq, st);
        a_wik = crate::record::addr(ix.wik, st);
        a_qio = crate::record::addr_mut(ix.qi_out, st);
        a_krs = crate::record::addr_mut(ix.kraw_store, st);
        a_bl = crate::record::addr_mut(ix.blocks, st);
        kraw_cap = u32::try_from(ix.kraw_cap).map_err(|_| bad(k, "kraw store".into()))?;
        blocks_cap = u32::try_from(ix.blocks_cap).map_err(|_| bad(k, "block store".into()))?;
    }
    if rows == 0 {
        return Ok(());
    }
    let capu = u32::try_from(cap).map_err(|_| bad(k, format!("capacity {cap}")))?;
    let (hq, hkv, hd, hii, dii, rot, ratio) = (
        i32_of(k, g.hq)?,
        i32_of(k, g.hkv)?,
        i32_of(k, g.hd)?,
        i32_of(k, hi)?,
        i32_of(k, di)?,
        i32_of(k, g.rot)?,
        i32_of(k, g.ratio.max(1))?,
    );
    let gx = g.hq + hi + g.hkv + if idx { 2 } else { 0 };
    launch!(
        gpu,
        "attn",
        "qsa_prep",
        cfg2(gx as u32, rows as u32, 256),
        [
            qg,
            k_in,
            v_in,
            &a_qi,
            &a_kraw,
            wq,
            wk,
            &a_wiq,
            &a_wik,
            pos,
            freqs,
            q_out,
            gate_out,
            &a_qio,
            kc,
            vc,
            &capu,
            &a_krs,
            &kraw_cap,
            &a_bl,
            &blocks_cap,
            &hq,
            &hkv,
            &hd,
            &hii,
            &dii,
            &rot,
            &ratio,
            &g.eps,
            err
        ]
    )
}

/// How one QSA layer selects (as `strata_engine::backend::QsaSelect`).
pub use strata_engine::qwen4exp::ops::{QsaRule, QsaSelect};

/// Fixed-capacity selection buffers for up to `rows` query rows: block scores, the selected
/// tokens (`stride = budget + ratio − 1` a row) and their counts, and the llama.cpp rule's
/// per-row heap scratch (`cap` tokens a row).
pub struct Selection {
    pub rows: usize,
    pub cap_blocks: usize,
    pub cap: usize,
    pub stride: usize,
    pub scores: CudaSlice<f32>,
    pub sel: CudaSlice<u32>,
    pub cnt: CudaSlice<u32>,
    pub heap: Option<CudaSlice<u32>>,
}

impl Selection {
    pub fn new(gpu: &Gpu, rows: usize, cap: usize, s: QsaSelect) -> Result<Selection, CudaError> {
        if s.ratio == 0 {
            return Err(bad("qsa_select", "ratio 0".into()));
        }
        let cap_blocks = cap / s.ratio;
        let stride = s.budget + s.ratio - 1;
        Ok(Selection {
            rows,
            cap_blocks,
            cap,
            stride,
            scores: gpu.zeros(rows * cap_blocks)?,
            sel: gpu.zeros(rows * stride)?,
            cnt: gpu.zeros(rows)?,
            heap: match s.rule {
                QsaRule::LlamaCpp => Some(gpu.zeros(rows * cap)?),
                QsaRule::Reference => None,
            },
        })
    }
}

/// QSA block scores and selection for `n` query rows: `qi` `[n, heads·d]` (normed, rotated),
/// `blocks` the block store (`sel.cap_blocks` rows of `d`). Fills `sel.sel` / `sel.cnt`.
#[allow(clippy::too_many_arguments)]
pub fn qsa_select(
    gpu: &Gpu,
    qi: &CudaSlice<f32>,
    blocks: &CudaSlice<f32>,
    pos: &CudaSlice<u32>,
    n: usize,
    heads: usize,
    d: usize,
    s: QsaSelect,
    sel: &mut Selection,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "qsa_select";
    if heads == 0 || heads > 8 || heads * d > 1024 || d == 0 || s.ratio == 0 || n > sel.rows {
        return Err(bad(
            k,
            format!(
                "{heads} heads (1..=8) of {d} (≤ 1024 in all), ratio {}, {n} rows of {}",
                s.ratio, sel.rows
            ),
        ));
    }
    if sel.stride < s.budget + s.ratio - 1 || sel.cap_blocks < sel.cap / s.ratio {
        return Err(bad(k, "selection buffers made for another rule".into()));
    }
    need(k, "qi", qi.len(), n * heads * d)?;
    need(k, "blocks", blocks.len(), sel.cap_blocks * d)?;
    need(k, "positions", pos.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (cb, hi, di, ri, bi, si) = (
        sel.cap_blocks as u32,
        i32_of(k, heads)?,
        i32_of(k, d)?,
        i32_of(k, s.ratio)?,
        i32_of(k, s.budget)?,
        i32_of(k, sel.stride)?,
    );
    // Where the reference rule selects every complete block (a context of at most `budget`
    // tokens' blocks), no score is computed and the selection lists the tokens in order.
    let all_fast = s.rule == QsaRule::Reference && qsa_all_on();
    let all_blocks = if all_fast { bi / ri } else { 0 };
    let direct = i32::from(attn_direct_on());
    launch!(
        gpu,
        "attn",
        "qsa_scores",
        cfg2(sel.cap_blocks.div_ceil(256) as u32, n as u32, 256),
        [
            qi,
            blocks,
            pos,
            &mut sel.scores,
            &cb,
            &hi,
            &di,
            &ri,
            &all_blocks,
            &direct
        ]
    )?;
    let all_fast = i32::from(all_fast);
    match s.rule {
        QsaRule::Reference => launch!(
            gpu,
            "attn",
            "qsa_select_ref",
            cfg(n as u32, 1024),
            [
                &sel.scores,
                pos,
                &mut sel.sel,
                &mut sel.cnt,
                &cb,
                &ri,
                &bi,
                &si,
                err,
                &all_fast
            ]
        ),
        QsaRule::LlamaCpp => {
            let capu = sel.cap as u32;
            let heap = sel
                .heap
                .as_mut()
                .ok_or_else(|| bad(k, "no heap scratch for the llama.cpp rule".into()))?;
            launch!(
                gpu,
                "attn",
                "qsa_select_llamacpp",
                cfg(n as u32, 32),
                [
                    &sel.scores,
                    pos,
                    &mut sel.sel,
                    &mut sel.cnt,
                    heap,
                    &capu,
                    &cb,
                    &ri,
                    &bi,
                    &si,
                    err
                ]
            )
        }
    }
}

/// Whether the decode rows' attention scores (`attend_split_scores`) and the QSA block scores
/// read each key row straight from the store (`STRATA_CUDA_ATTN_DIRECT`, on) instead of staging
/// the rows through shared memory 32 dims at a time; the same bits either way.
pub fn attn_direct_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_ATTN_DIRECT")
}

/// Whether the reference selection skips its block scores and radix select where it takes every
/// complete block (`STRATA_CUDA_QSA_ALL`, on); the same token lists either way.
pub fn qsa_all_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_QSA_ALL")
}

/// Attention geometry (as `strata_engine::backend::AttnDims`).
pub use strata_engine::backend::AttnDims;

/// Softmax attention of `n` query rows (`q` `[n, n_head·head_dim]`) over caches of `cap` rows
/// (`[cap, n_head_kv·head_dim]`): over `sel`'s token lists, or causally over `0..=pos[r]` when
/// `sel` is `None`. `scratch` holds `n_head · cap` floats per row of a chunk (the rows run in
/// chunks of what it holds). `f16`: as an F16 cache reads.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f32>,
    v_cache: &CudaSlice<f32>,
    cap: usize,
    sel: Option<&Selection>,
    pos: &CudaSlice<u32>,
    n: usize,
    dims: AttnDims,
    f16: bool,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "attend";
    let AttnDims {
        n_head,
        n_head_kv,
        head_dim,
    } = dims;
    if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) || head_dim == 0 || head_dim > 512 {
        return Err(bad(k, format!("{dims:?} (head_dim ≤ 512)")));
    }
    let kvc = n_head_kv * head_dim;
    need(k, "q", q.len(), n * n_head * head_dim)?;
    need(k, "k cache", k_cache.len(), cap * kvc)?;
    need(k, "v cache", v_cache.len(), cap * kvc)?;
    need(k, "positions", pos.len(), n)?;
    need(k, "out", out.len(), n * n_head * head_dim)?;
    need(k, "scratch", scratch.len(), n_head * cap)?;
    if n == 0 {
        return Ok(());
    }
    let (capu, nh, nkv, hd, fi) = (
        cap as u32,
        i32_of(k, n_head)?,
        i32_of(k, n_head_kv)?,
        i32_of(k, head_dim)?,
        f16 as i32,
    );
    if let Some(s) = sel {
        if n > s.rows || s.cap > cap {
            return Err(bad(k, "selection made for other stores".into()));
        }
    }
    // The rows run in chunks of as many as the scratch holds (a long prefill over a large
    // capacity); each row's result does not depend on the chunking.
    let qc = n_head * head_dim;
    let chunk = (scratch.len() / (n_head * cap)).clamp(1, n);
    for r0 in (0..n).step_by(chunk) {
        let m = chunk.min(n - r0);
        let c = cfg((m * n_head) as u32, 256);
        let qv = q.slice(r0 * qc..(r0 + m) * qc);
        let pv = pos.slice(r0..r0 + m);
        let mut ov = out.slice_mut(r0 * qc..(r0 + m) * qc);
        match sel {
            Some(s) => {
                let (st, causal) = (i32_of(k, s.stride)?, 0i32);
                let sv = s.sel.slice(r0 * s.stride..(r0 + m) * s.stride);
                let cv = s.cnt.slice(r0..r0 + m);
                launch!(
                    gpu,
                    "attn",
                    "attend_f32",
                    c,
                    [
                        &qv,
                        k_cache,
                        v_cache,
                        &sv,
                        &cv,
                        &pv,
                        &mut ov,
                        &mut *scratch,
                        &capu,
                        &nh,
                        &nkv,
                        &hd,
                        &st,
                        &causal,
                        &fi,
                        &mut *err
                    ]
                )?;
            }
            None => {
                // No list is read in the causal mode; `pos` stands in for both list pointers.
                let (st, causal) = (0i32, 1i32);
                launch!(
                    gpu,
                    "attn",
                    "attend_f32",
                    c,
                    [
                        &qv,
                        k_cache,
                        v_cache,
                        &pv,
                        &pv,
                        &pv,
                        &mut ov,
                        &mut *scratch,
                        &capu,
                        &nh,
                        &nkv,
                        &hd,
                        &st,
                        &causal,
                        &fi,
                        &mut *err
                    ]
                )?;
            }
        }
    }
    Ok(())
}

/// Scratch of [`attend_split`] for up to `rows` query rows of `n_head` heads over stores of
/// `cap` rows: scores, per-chunk (max, Σexp) stats, per-chunk partial outputs.
pub struct AttnSplitScratch {
    pub rows: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub cap: usize,
    pub max_chunks: usize,
    scores: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    part: CudaSlice<f32>,
}

impl AttnSplitScratch {
    pub fn new(
        gpu: &Gpu,
        rows: usize,
        dims: AttnDims,
        cap: usize,
    ) -> Result<AttnSplitScratch, CudaError> {
        let rh = rows * dims.n_head;
        let max_chunks = cap.div_ceil(256).max(1);
        Ok(AttnSplitScratch {
            rows,
            n_head: dims.n_head,
            head_dim: dims.head_dim,
            cap,
            max_chunks,
            scores: gpu.zeros(rh * cap)?,
            stats: gpu.zeros(rh * max_chunks * 2)?,
            part: gpu.zeros(rh * max_chunks * dims.head_dim)?,
        })
    }
}

/// Heads a block of attn.cu `attend_group_*` takes (`ATTN_AG`).
pub const ATTN_GROUP: usize = 12;

/// Whether [`attend_split`] over `rows` query rows runs attn.cu `attend_group_scores` /
/// `attend_group_out` (one block per row, group of up to [`ATTN_GROUP`] heads of one kv head
/// and chunk: every key and value row read once for the group; the same bits as
/// `attend_split_scores` / `attend_split_out`): more rows than a decode window, head dims a
/// multiple of 32 up to 256; `STRATA_CUDA_ATTN_GROUP=0` keeps the per-head kernels, for A/B.
pub fn attend_grouped_applies(rows: usize, dims: AttnDims) -> bool {
    rows > 8
        && dims.head_dim.is_multiple_of(32)
        && dims.head_dim <= 256
        && crate::device::switch_on("STRATA_CUDA_ATTN_GROUP")
}

/// [`attend`] with the tokens split into chunks of 256, one block per (row, head, chunk) (rows
/// beyond the scratch's run in chunks of its rows): the
/// same scores and per-token weights, `z` and the output summed over chunks (another order
/// than the CPU's, within the same bound). Three launches; grids sized by the capacity.
#[allow(clippy::too_many_arguments)]
pub fn attend_split(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f32>,
    v_cache: &CudaSlice<f32>,
    cap: usize,
    sel: Option<&Selection>,
    pos: &CudaSlice<u32>,
    n: usize,
    dims: AttnDims,
    f16: bool,
    out: &mut CudaSlice<f32>,
    s: &mut AttnSplitScratch,
    err: &mut CudaSlice<u32>,
    gate: Option<&CudaSlice<f32>>,
) -> Result<(), CudaError> {
    let grouped = attend_grouped_applies(n, dims);
    attend_split_as(
        gpu, q, k_cache, v_cache, cap, sel, pos, n, dims, f16, out, s, err, grouped, gate,
    )
}

/// [`attend_split`] with the kernels chosen by the caller: `grouped` runs `attend_group_*`
/// (head dims a multiple of 32 up to 256), else the per-head kernels; the same bits either
/// way (tests/model_ops.rs binds them). With `gate` (rows like `q`'s), the last pass writes
/// `out ⊙ σ(gate)` with [`mul_sigmoid`]'s bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_split_as(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f32>,
    v_cache: &CudaSlice<f32>,
    cap: usize,
    sel: Option<&Selection>,
    pos: &CudaSlice<u32>,
    n: usize,
    dims: AttnDims,
    f16: bool,
    out: &mut CudaSlice<f32>,
    s: &mut AttnSplitScratch,
    err: &mut CudaSlice<u32>,
    grouped: bool,
    gate: Option<&CudaSlice<f32>>,
) -> Result<(), CudaError> {
    let k = "attend_split";
    let AttnDims {
        n_head,
        n_head_kv,
        head_dim,
    } = dims;
    if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) || head_dim == 0 || head_dim > 512 {
        return Err(bad(k, format!("{dims:?} (head_dim ≤ 512)")));
    }
    if s.n_head != n_head || s.head_dim != head_dim || s.cap != cap {
        return Err(bad(k, "scratch made for another shape".into()));
    }
    let kvc = n_head_kv * head_dim;
    need(k, "q", q.len(), n * n_head * head_dim)?;
    need(k, "k cache", k_cache.len(), cap * kvc)?;
    need(k, "v cache", v_cache.len(), cap * kvc)?;
    need(k, "positions", pos.len(), n)?;
    need(k, "out", out.len(), n * n_head * head_dim)?;
    if let Some(g) = gate {
        need(k, "gate", g.len(), n * n_head * head_dim)?;
    }
    if n == 0 {
        return Ok(());
    }
    let (capu, nh, nkv, hd, fi, mc) = (
        cap as u32,
        i32_of(k, n_head)?,
        i32_of(k, n_head_kv)?,
        i32_of(k, head_dim)?,
        f16 as i32,
        i32_of(k, s.max_chunks)?,
    );
    // Causal: every chunk up to the capacity may be live; a list: only those its stride holds.
    let (chunks, st, causal) = match sel {
        Some(se) => {
            if n > se.rows || se.cap > cap {
                return Err(bad(k, "selection made for other stores".into()));
            }
            (
                se.stride.div_ceil(256).min(s.max_chunks),
                i32_of(k, se.stride)?,
                0i32,
            )
        }
        None => (s.max_chunks, 0, 1),
    };
    if grouped && (!head_dim.is_multiple_of(32) || head_dim > 256) {
        return Err(bad(
            k,
            format!("{dims:?}: the grouped kernels take head dims of 32·k ≤ 256"),
        ));
    }
    let direct = i32::from(attn_direct_on());
    // A decode row's key and value rows pulled into L2 before the scores' and the out pass's
    // waits (attn.cu attn_rows_to_l2; the grouped kernels ignore it): `STRATA_CUDA_ATTN_L2`, on.
    let prefetch = i32::from(crate::device::switch_on("STRATA_CUDA_ATTN_L2"));
    // A row whose tokens fit one chunk finished by the scores kernel (weights, values, gate),
    // the out and sum passes skipping it (the per-head kernels only): `STRATA_CUDA_ATTN_FUSE`, on.
    let fused = i32::from(!grouped && crate::device::switch_on("STRATA_CUDA_ATTN_FUSE"));
    // attn.cu's ATTN_DIRECT = 1, ATTN_L2 = 2, ATTN_FUSE = 4.
    let score_flags = direct | (prefetch << 1) | (fused << 2);
    let out_flags = (prefetch << 1) | (fused << 2);
    // The grouped kernels: blocks of up to ATTN_GROUP heads of one kv head.
    let groups = n_head_kv * (n_head / n_head_kv).div_ceil(ATTN_GROUP);
    // Rows run in chunks of the scratch's rows (each row's result does not depend on it).
    let qc = n_head * head_dim;
    for r0 in (0..n).step_by(s.rows.max(1)) {
        let m = s.rows.min(n - r0);
        let qv = q.slice(r0 * qc..(r0 + m) * qc);
        let pv = pos.slice(r0..r0 + m);
        let mut ov = out.slice_mut(r0 * qc..(r0 + m) * qc);
        // The gate's rows of this chunk, by address (0: no gate).
        let gp: u64 = gate.map_or(0, |g| {
            crate::record::addr(g, gpu.stream()) + (4 * r0 * qc) as u64
        });
        let (lst, cnt) = match sel {
            Some(se) => (
                se.sel.slice(r0 * se.stride..(r0 + m) * se.stride),
                se.cnt.slice(r0..r0 + m),
            ),
            None => (pos.slice(r0..r0 + m), pos.slice(r0..r0 + m)),
        };
        // The grouped kernels take the same arguments as the per-head ones, over blocks of up
        // to ATTN_GROUP heads of one kv head instead of one head (they ignore the flags).
        let (scores_k, out_k, c2) = if grouped {
            (
                "attend_group_scores",
                "attend_group_out",
                cfg2((m * groups) as u32, chunks as u32, 256),
            )
        } else {
            (
                "attend_split_scores",
                "attend_split_out",
                cfg2((m * n_head) as u32, chunks as u32, 256),
            )
        };
        launch!(
            gpu,
            "attn",
            scores_k,
            c2,
            [
                &qv,
                k_cache,
                &lst,
                &cnt,
                &pv,
                &mut s.scores,
                &mut s.stats,
                &capu,
                &nh,
                &nkv,
                &hd,
                &st,
                &causal,
                &fi,
                &mc,
                &mut *err,
                &score_flags,
                v_cache,
                &mut ov,
                &gp
            ]
        )?;
        launch!(
            gpu,
            "attn",
            out_k,
            c2,
            [
                v_cache,
                &lst,
                &cnt,
                &pv,
                &s.scores,
                &s.stats,
                &mut s.part,
                &capu,
                &nh,
                &nkv,
                &hd,
                &st,
                &causal,
                &fi,
                &mc,
                &out_flags
            ]
        )?;
        launch!(
            gpu,
            "attn",
            "attend_split_sum",
            cfg((m * n_head) as u32, 256),
            [&s.part, &cnt, &pv, &mut ov, &capu, &nh, &hd, &causal, &mc, &gp, &fused]
        )?;
    }
    Ok(())
}

// ---- routed experts -------------------------------------------------------------------------

/// `y[q] = W_{ids[q]} · x` for the `npairs = nt·kslots` (row, slot) pairs of a step in one
/// launch; `x` holds one activation row per token (gate/up) or, with `x_per_slot`, one per pair
/// (down). Outputs `npairs × w.rows`, pair-major.
#[allow(clippy::too_many_arguments)]
pub fn moe_gemv(
    gpu: &Gpu,
    w: &DevWeight,
    ids: &CudaSlice<i32>,
    x: &CudaSlice<u8>,
    x_per_slot: bool,
    kslots: usize,
    npairs: usize,
    y: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "moe_gemv";
    let tn = product_module(w.ty)?;
    whole_units(k, w)?;
    let (wrb, xrb, slab) = (w.row_bytes()?, w.act_row_bytes()?, w.slab_bytes()?);
    if kslots == 0 || !npairs.is_multiple_of(kslots) {
        return Err(bad(k, format!("{npairs} pairs of {kslots} slots")));
    }
    need(k, "w", w.bytes.len(), slab * w.n_expert)?;
    need(k, "ids", ids.len(), npairs)?;
    let xrows = if x_per_slot { npairs } else { npairs / kslots };
    need(k, "x", x.len(), xrows * xrb)?;
    need(k, "y", y.len(), npairs * w.rows)?;
    if npairs == 0 {
        return Ok(());
    }
    let (sb, ne, xps, ks) = (
        u64_of(slab),
        i32_of(k, w.n_expert)?,
        x_per_slot as i32,
        i32_of(k, kslots)?,
    );
    let (ri, ki, wb, xb) = (
        i32_of(k, w.rows)?,
        i32_of(k, w.k)?,
        u64_of(wrb),
        u64_of(xrb),
    );
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        format!("moe_gemv_{tn}"),
        cfg2(w.rows.div_ceil(4) as u32, npairs as u32, 128),
        [&w.bytes, &sb, ids, &ne, x, &xps, &ks, y, &ri, &ki, &wb, &xb, err]
    )
}

/// The bound on moe_group's tiles (up to 8 pairs of one expert each) for `npairs` pairs over
/// `n_expert` experts: each expert's last tile may be partial, so at most npairs/8 full tiles
/// plus one partial tile per expert that has any pair.
pub fn moe_max_tiles(npairs: usize, n_expert: usize) -> usize {
    npairs / 8 + n_expert.min(npairs)
}

/// The grouping of a prefill's pairs by expert (device buffers, sized for `npairs` pairs).
pub struct MoeGroups {
    pub npairs: usize,
    pub n_expert: usize,
    pub max_tiles: usize,
    offs: CudaSlice<u32>,
    perm: CudaSlice<u32>,
    tiles: CudaSlice<i32>,
    n_tiles: CudaSlice<u32>,
}

impl MoeGroups {
    pub fn new(gpu: &Gpu, npairs: usize, n_expert: usize) -> Result<MoeGroups, CudaError> {
        let max_tiles = moe_max_tiles(npairs, n_expert);
        Ok(MoeGroups {
            npairs,
            n_expert,
            max_tiles,
            offs: gpu.zeros(n_expert + 1)?,
            perm: gpu.zeros(npairs)?,
            tiles: gpu.zeros(3 * max_tiles)?,
            n_tiles: gpu.zeros(1)?,
        })
    }

    /// Groups the pairs of `ids` (the router's output, `npairs` values) by expert.
    pub fn build(
        &mut self,
        gpu: &Gpu,
        ids: &CudaSlice<i32>,
        err: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        need("moe_group", "ids", ids.len(), self.npairs)?;
        let (np, ne, mt) = (
            i32_of("moe_group", self.npairs)?,
            i32_of("moe_group", self.n_expert)?,
            i32_of("moe_group", self.max_tiles)?,
        );
        launch!(
            gpu,
            "moe",
            "moe_group",
            cfg(1, 256),
            [
                ids,
                &np,
                &ne,
                &mut self.offs,
                &mut self.perm,
                &mut self.tiles,
                &mut self.n_tiles,
                &mt,
                err
            ]
        )
    }
}

/// [`moe_gemv`] grouped by expert (prefill): each expert's weight units decoded once per tile
/// of up to 8 of its pairs, by the tensor-core kernel for the integer-dot formats (mmq.cu
/// `moe_mmq_*`), else the tiled one. Bitwise the same outputs as [`moe_gemv`].
#[allow(clippy::too_many_arguments)]
pub fn moe_matmul(
    gpu: &Gpu,
    w: &DevWeight,
    groups: &MoeGroups,
    x: &CudaSlice<u8>,
    x_per_slot: bool,
    kslots: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let (kernel, rows_a_block, threads) = if has_mmq(w.ty) {
        ("moe_mmq", MMQ_ROWS, 256)
    } else {
        ("moe_matmul", 4, 128)
    };
    moe_grouped(
        gpu,
        kernel,
        rows_a_block,
        threads,
        w,
        groups,
        x,
        x_per_slot,
        kslots,
        y,
    )
}

/// [`moe_matmul`] by the tiled kernel (gemv.cu `moe_matmul_*`): the baseline the tensor-core
/// kernel is tested against.
#[allow(clippy::too_many_arguments)]
pub fn moe_matmul_tiled(
    gpu: &Gpu,
    w: &DevWeight,
    groups: &MoeGroups,
    x: &CudaSlice<u8>,
    x_per_slot: bool,
    kslots: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    moe_grouped(
        gpu,
        "moe_matmul",
        4,
        128,
        w,
        groups,
        x,
        x_per_slot,
        kslots,
        y,
    )
}

/// One launch of an expert-grouped product kernel `{kernel}_{type}`: grid (weight rows /
/// `rows_a_block`, the groups' tile bound).
#[allow(clippy::too_many_arguments)]
fn moe_grouped(
    gpu: &Gpu,
    kernel: &str,
    rows_a_block: usize,
    threads: u32,
    w: &DevWeight,
    groups: &MoeGroups,
    x: &CudaSlice<u8>,
    x_per_slot: bool,
    kslots: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let k = "moe_matmul";
    let tn = product_module(w.ty)?;
    whole_units(k, w)?;
    let (wrb, xrb, slab) = (w.row_bytes()?, w.act_row_bytes()?, w.slab_bytes()?);
    let npairs = groups.npairs;
    if kslots == 0 || !npairs.is_multiple_of(kslots) || groups.n_expert != w.n_expert {
        return Err(bad(
            k,
            format!(
                "{npairs} pairs of {kslots} slots, {} experts grouped for {}",
                groups.n_expert, w.n_expert
            ),
        ));
    }
    need(k, "w", w.bytes.len(), slab * w.n_expert)?;
    let xrows = if x_per_slot { npairs } else { npairs / kslots };
    need(k, "x", x.len(), xrows * xrb)?;
    need(k, "y", y.len(), npairs * w.rows)?;
    if npairs == 0 {
        return Ok(());
    }
    let (sb, xps, ks) = (u64_of(slab), x_per_slot as i32, i32_of(k, kslots)?);
    let (ri, ki, wb, xb) = (
        i32_of(k, w.rows)?,
        i32_of(k, w.k)?,
        u64_of(wrb),
        u64_of(xrb),
    );
    let grid = cfg2(
        w.rows.div_ceil(rows_a_block) as u32,
        groups.max_tiles as u32,
        threads,
    );
    if kernel.starts_with("moe_mmq") {
        let q2t = mmq_q2t_on() as i32;
        return launch!(
            gpu,
            &format!("gemv_{tn}"),
            format!("{kernel}_{tn}"),
            grid,
            [
                &w.bytes,
                &sb,
                &groups.tiles,
                &groups.n_tiles,
                &groups.perm,
                x,
                &xps,
                &ks,
                y,
                &ri,
                &ki,
                &wb,
                &xb,
                &q2t
            ]
        );
    }
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        format!("{kernel}_{tn}"),
        grid,
        [
            &w.bytes,
            &sb,
            &groups.tiles,
            &groups.n_tiles,
            &groups.perm,
            x,
            &xps,
            &ks,
            y,
            &ri,
            &ki,
            &wb,
            &xb
        ]
    )
}

/// `out[t] = Σ_slot wts[t][slot] · y[t·kslots + slot]` (rows of `h`), slots in rank order.
pub fn moe_combine(
    gpu: &Gpu,
    y: &CudaSlice<f32>,
    wts: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    nt: usize,
    kslots: usize,
    h: usize,
) -> Result<(), CudaError> {
    let k = "moe_combine";
    need(k, "y", y.len(), nt * kslots * h)?;
    need(k, "weights", wts.len(), nt * kslots)?;
    need(k, "out", out.len(), nt * h)?;
    let (ni, ki, hi) = (i32_of(k, nt)?, i32_of(k, kslots)?, i32_of(k, h)?);
    launch!(
        gpu,
        "moe",
        "moe_combine",
        grid(nt * h),
        [y, wts, out, &ni, &ki, &hi]
    )
}

/// The routed experts of one MoE layer on the device.
pub struct ExpertsDev<'a> {
    pub gate: &'a DevWeight,
    pub up: &'a DevWeight,
    pub down: &'a DevWeight,
}

/// Scratch of [`moe_experts`] for `nt` rows of `kslots` slots (fixed addresses).
pub struct MoeScratch {
    pub nt: usize,
    pub kslots: usize,
    xg: CudaSlice<u8>,
    xu: CudaSlice<u8>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    act: CudaSlice<f32>,
    pub(crate) aq: CudaSlice<u8>,
    y: CudaSlice<f32>,
    pub groups: MoeGroups,
}

impl MoeScratch {
    pub fn new(
        gpu: &Gpu,
        ex: &ExpertsDev<'_>,
        nt: usize,
        kslots: usize,
    ) -> Result<MoeScratch, CudaError> {
        let np = nt * kslots;
        let ff = ex.gate.rows;
        Ok(MoeScratch {
            nt,
            kslots,
            xg: gpu.zeros(nt * ex.gate.act_row_bytes()?)?,
            xu: gpu.zeros(nt * ex.up.act_row_bytes()?)?,
            g: gpu.zeros(np * ff)?,
            u: gpu.zeros(np * ff)?,
            act: gpu.zeros(np * ff)?,
            aq: gpu.zeros(np * ex.down.act_row_bytes()?)?,
            y: gpu.zeros(np * ex.down.rows)?,
            groups: MoeGroups::new(gpu, np, ex.gate.n_expert)?,
        })
    }
}

/// Whether the fused experts run their wide blocks (1,024-thread gate/up blocks where the
/// decoder fits, about 1,024 contributions a down block); `STRATA_CUDA_EXPERTS_WIDE=0`: session
/// 5's 512 and 512, for an A/B. Read once; either gives the same bits.
fn experts_wide() -> bool {
    crate::device::switch_on("STRATA_CUDA_EXPERTS_WIDE")
}

/// Whether Q2_0 experts' gate/up runs the transposed-activation kernel (gemv.cu
/// moe_gate_up_q8_q2t: the same bits with a unit a thread fixed; `STRATA_CUDA_Q2T=0` keeps the
/// generic decoder, for A/B). (The down product stays generic: a transposed down with eight
/// rows a thread measured 15.9 µs against the generic 14.5 µs, session 7.)
fn experts_q2t() -> bool {
    crate::device::switch_on("STRATA_CUDA_Q2T")
}

/// The transposed Q2_0 gate/up launch for rows of `units` units: its threads (G row groups of
/// `units`), when it applies.
pub fn gate_up_q2t_threads(ty: GgmlType, units: usize) -> Option<u32> {
    // About 512 threads: at ~50 registers two blocks then share an SM, so the 200 blocks of a
    // decode row's ten experts at rows of 2560 run in one wave.
    (ty == GgmlType::Q2_0 && experts_q2t() && (1..=1024).contains(&units))
        .then(|| (units * (512 / units).clamp(1, 64)) as u32)
}

/// Output rows per block of the fused down-and-combine launch (with `kslots` slots of `units`).
fn down_rows_per_block(kslots: usize, units: usize) -> usize {
    down_rows_for(kslots, units, if experts_wide() { 1024 } else { 512 })
}

/// About `contribs` contributions a block, a unit a thread (so at most 1,024), within the
/// block's shared contributions and 256 combined rows.
fn down_rows_for(kslots: usize, units: usize, contribs: usize) -> usize {
    (contribs / (kslots * units).max(1))
        .clamp(1, 16)
        .min(256 / kslots.max(1))
        .min(UNITS_PART / (kslots * units).max(1))
}

/// Threads of a fused gate/up block for weights of `ty` (gemv.cu GATE_UP_THREADS: the
/// launch bound that keeps the decoder's registers without spills).
fn gate_up_threads(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::IQ4_XS | GgmlType::IQ3_XXS => 256,
        GgmlType::Q2_0 | GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::IQ4_NL
            if experts_wide() =>
        {
            1024
        }
        _ => 512,
    }
}

/// Whether [`moe_experts_fused`] runs these experts: gate and up of one format with whole-unit
/// rows that fit a block, a down weight paired with Q8_0 activations (the fused epilogue
/// writes Q8_0 blocks), and room for a block of output rows for every slot.
pub fn experts_fuse(ex: &ExpertsDev<'_>, kslots: usize) -> bool {
    let (h, ff) = (ex.gate.k, ex.gate.rows);
    kslots > 0
        && ex.gate.ty == ex.up.ty
        && has_products(ex.gate.ty)
        && has_products(ex.down.ty)
        && ex.down.act().ok() == Some(ActFmt::Q8_0)
        && h.is_multiple_of(32)
        && ff.is_multiple_of(32)
        && 64 * (h / 32) <= UNITS_PART
        && down_rows_per_block(kslots, ff / 32) > 0
}

/// The routed experts of a decode step in two launches (gemv.cu moe_gate_up_q8_* and
/// moe_down_combine_*), with [`moe_experts`]' bits: gate, up, swiglu and the down product's
/// Q8_0 image per pair, then the down products of a row's pairs and their weighted sum (with
/// the shared expert's add when given).
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_fused(
    gpu: &Gpu,
    ex: &ExpertsDev<'_>,
    x: &CudaSlice<f32>,
    ids: &CudaSlice<i32>,
    wts: &CudaSlice<f32>,
    s: &mut MoeScratch,
    shared: Option<SharedAdd<'_>>,
    out: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    prepare(gpu, ex.gate, x, s.nt, &mut s.xg)?;
    let (nt, ks) = (s.nt, s.kslots);
    moe_experts_fused_on(
        gpu, ex, &s.xg, ids, wts, nt, ks, &mut s.aq, shared, out, err,
    )
}

/// The shared expert's output and gate, added in the routed experts' epilogue (the bits of
/// add_sigmoid_gated after the experts).
pub struct SharedAdd<'a> {
    /// The shared expert's output, or what the staged down computes it from.
    pub y: SharedY<'a>,
    /// `nt`, before the sigmoid.
    pub gate: &'a CudaSlice<f32>,
    /// The caller's promise that `ids`, the image `xg` (and the shared expert's `g` and `u`)
    /// were written two or more launches before the experts' first, with only launches that
    /// wait for their predecessor between (the MoE block: route, then the shared expert's
    /// gate/up products). A grid starts only once every block of the launch before has passed
    /// its wait, which returned only when the launch before that had completed; so the staged
    /// kernels (gemv.cu moe_gate_up_q2s, moe_down_q2s) may read them before their own wait:
    /// the gate/up copies and computes its block there, the down copies its weight rows and
    /// makes the shared expert's image (the same bits).
    pub settled: bool,
}

/// The shared expert of [`SharedAdd`].
pub enum SharedY<'a> {
    /// Its output, `nt × h`.
    Out(&'a CudaSlice<f32>),
    /// Its gate and up products (`nt × ff` each) and its Q8_0 down weight (`h` rows of `ff`):
    /// the staged down computes swiglu_prepare's image and the down product itself (only
    /// where [`shared_in_down`] says so).
    Parts {
        g: &'a CudaSlice<f32>,
        u: &'a CudaSlice<f32>,
        down: &'a DevWeight,
    },
}

/// Whether the staged down (gemv.cu moe_down_q2s) computes the shared expert of these experts
/// itself ([`SharedY::Parts`]): the staged down applies, and the shared down weight is Q8_0,
/// `h` rows of at most 640 in whole 32-element units, 16-byte aligned rows of 16.
pub fn shared_in_down(
    gpu: &Gpu,
    ex: &ExpertsDev<'_>,
    xg: &CudaSlice<u8>,
    kslots: usize,
    down: &DevWeight,
) -> bool {
    let Ok(rb) = down.row_bytes() else {
        return false;
    };
    experts_staged(gpu, ex, xg, kslots).down
        && down.ty == GgmlType::Q8_0
        && down.n_expert == 1
        && down.rows == ex.gate.k
        && down.k.is_multiple_of(32)
        && (1..=SHARED_STAGED_UNITS).contains(&(down.k / 32))
        && (DOWN_STAGED_ROWS * rb).is_multiple_of(16)
        && addr(gpu, &down.bytes).is_multiple_of(16)
}

/// Whether the experts start before their dependency wait where the caller says the route is
/// settled ([`SharedAdd::settled`]): the staged kernels copy (and the gate/up computes) their
/// blocks before it; the unit-parallel ones pull their rows into L2. `STRATA_CUDA_MOE_EARLY=0`
/// turns it off, for an A/B (the same bits either way).
fn early_experts() -> bool {
    crate::device::switch_on("STRATA_CUDA_MOE_EARLY") && !crate::sources::trigger_first()
}

/// Which of the routed experts' two launches run the staged kernels (gemv.cu moe_gate_up_q2s,
/// moe_down_q2s: each block's weight rows brought into shared memory by bulk copies, a warp a
/// row; the same bits as the unit-parallel kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    pub gate_up: bool,
    pub down: bool,
}

/// gemv.cu's MQS_STAGE, MDS_ROWS, MDS_SLOTS, MDS_STAGE and MDS_SH_UNITS.
const GATE_UP_STAGE: usize = 48_800;
const DOWN_STAGED_ROWS: usize = 16;
const DOWN_STAGED_SLOTS: usize = 10;
const DOWN_STAGE: usize = 28_800;
const SHARED_STAGED_UNITS: usize = 20;

/// Whether the staged kernels fit these experts (Q2_0 rows, the gate/up's 64 rows and
/// activation row within its stage, the down's 16 rows of every slot within its stage, at most
/// 20 units a down row and 96 a gate/up row, every bulk copy's address and size a multiple of
/// 16 bytes). `STRATA_CUDA_MOE_STAGE=0` keeps the unit-parallel kernels, for an A/B.
pub fn experts_staged_for(
    ex: &ExpertsDev<'_>,
    kslots: usize,
    ptrs_aligned: bool,
) -> Result<Staged, CudaError> {
    if !experts_stage_on() || !ptrs_aligned {
        return Ok(Staged {
            gate_up: false,
            down: false,
        });
    }
    let (h, ff) = (ex.gate.k, ex.gate.rows);
    let (gwrb, gxrb, gslab) = (
        ex.gate.row_bytes()?,
        ex.gate.act_row_bytes()?,
        ex.gate.slab_bytes()?,
    );
    let gate_up = ex.gate.ty == GgmlType::Q2_0
        && ex.up.ty == GgmlType::Q2_0
        && ex.gate.act()? == ActFmt::Q8_0
        && h.is_multiple_of(32)
        && h / 32 <= 96
        && ff.is_multiple_of(32)
        && 64 * gwrb + gxrb <= GATE_UP_STAGE
        && gxrb.is_multiple_of(16)
        && (32 * gwrb).is_multiple_of(16)
        && gslab.is_multiple_of(16)
        && ex.up.slab_bytes()? == gslab;
    let (dwrb, dslab) = (ex.down.row_bytes()?, ex.down.slab_bytes()?);
    let down = ex.down.ty == GgmlType::Q2_0
        && ex.down.act()? == ActFmt::Q8_0
        && ex.down.k == ff
        && ff / 32 <= 20
        && (1..=DOWN_STAGED_SLOTS).contains(&kslots)
        && h.is_multiple_of(DOWN_STAGED_ROWS)
        && kslots * DOWN_STAGED_ROWS * dwrb <= DOWN_STAGE
        && (DOWN_STAGED_ROWS * dwrb).is_multiple_of(16)
        && dslab.is_multiple_of(16);
    Ok(Staged { gate_up, down })
}

/// Whether a QSA layer's row preparation runs as one [`qsa_prep`] launch (the default) rather
/// than the composition (`STRATA_CUDA_QSA_PREP=0`, for an A/B).
pub fn qsa_prep_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_QSA_PREP")
}

fn experts_stage_on() -> bool {
    crate::device::switch_on("STRATA_CUDA_MOE_STAGE")
}

/// Overrides `STRATA_CUDA_MOE_STAGE` for this process (None: the environment's choice), for
/// tests that bind the staged experts to the unit-parallel ones.
pub fn set_experts_stage(on: Option<bool>) {
    // A switch read at every step: never refused.
    let _ = crate::device::set_switch("STRATA_CUDA_MOE_STAGE", on);
}

fn experts_staged(gpu: &Gpu, ex: &ExpertsDev<'_>, xg: &CudaSlice<u8>, kslots: usize) -> Staged {
    let aligned = [
        addr(gpu, &ex.gate.bytes),
        addr(gpu, &ex.up.bytes),
        addr(gpu, &ex.down.bytes),
        addr(gpu, xg),
    ]
    .iter()
    .all(|a| a.is_multiple_of(16));
    experts_staged_for(ex, kslots, aligned).unwrap_or(Staged {
        gate_up: false,
        down: false,
    })
}

/// [`moe_experts_fused`] from the gate weight's activation image `xg` already prepared, with
/// the shared expert's add when given.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_fused_on(
    gpu: &Gpu,
    ex: &ExpertsDev<'_>,
    xg: &CudaSlice<u8>,
    ids: &CudaSlice<i32>,
    wts: &CudaSlice<f32>,
    nt: usize,
    ks: usize,
    aq: &mut CudaSlice<u8>,
    shared: Option<SharedAdd<'_>>,
    out: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "moe_experts_fused";
    let (h, ff) = (ex.gate.k, ex.gate.rows);
    let np = nt * ks;
    if !experts_fuse(ex, ks) {
        return Err(bad(k, "experts of these formats and shapes".into()));
    }
    need(k, "ids", ids.len(), np)?;
    need(k, "weights", wts.len(), np)?;
    need(k, "out", out.len(), nt * h)?;
    need(k, "x", xg.len(), nt * ex.gate.act_row_bytes()?)?;
    need(k, "image", aq.len(), np * ex.down.act_row_bytes()?)?;
    let (gn, dn) = (product_module(ex.gate.ty)?, product_module(ex.down.ty)?);
    let (gslab, gwrb, gxrb) = (
        ex.gate.slab_bytes()?,
        ex.gate.row_bytes()?,
        ex.gate.act_row_bytes()?,
    );
    need(k, "gate", ex.gate.bytes.len(), gslab * ex.gate.n_expert)?;
    need(
        k,
        "up",
        ex.up.bytes.len(),
        ex.up.slab_bytes()? * ex.up.n_expert,
    )?;
    let (ne, ksi, ffi, hi) = (
        i32_of(k, ex.gate.n_expert)?,
        i32_of(k, ks)?,
        i32_of(k, ff)?,
        i32_of(k, h)?,
    );
    let (sb, wb, xb) = (u64_of(gslab), u64_of(gwrb), u64_of(gxrb));
    // Each pair's 32-row blocks of gate and up, and its activation row.
    gpu.note_bytes(np * (2 * ff * gwrb + gxrb));
    let staged = experts_staged(gpu, ex, xg, ks);
    if let Some(SharedAdd {
        y: SharedY::Parts { down, .. },
        ..
    }) = &shared
    {
        if !shared_in_down(gpu, ex, xg, ks, down) {
            return Err(bad(k, "a shared expert the staged down cannot take".into()));
        }
    }
    let settled = shared.as_ref().is_some_and(|s| s.settled) && early_experts();
    let early = i32::from(settled);
    match gate_up_q2t_threads(ex.gate.ty, h / 32) {
        _ if staged.gate_up => launch!(
            gpu,
            &format!("gemv_{gn}"),
            "moe_gate_up_q2s",
            cfg2((ff / 32) as u32, np as u32, 512),
            [
                &ex.gate.bytes,
                &ex.up.bytes,
                &sb,
                ids,
                &ne,
                xg,
                &ksi,
                &mut *aq,
                &ffi,
                &hi,
                &wb,
                &xb,
                &mut *err,
                &early
            ]
        )?,
        Some(threads) => launch!(
            gpu,
            &format!("gemv_{gn}"),
            "moe_gate_up_q8_q2t",
            cfg2((ff / 32) as u32, np as u32, threads),
            [
                &ex.gate.bytes,
                &ex.up.bytes,
                &sb,
                ids,
                &ne,
                xg,
                &ksi,
                &mut *aq,
                &ffi,
                &hi,
                &wb,
                &xb,
                &mut *err
            ]
        )?,
        None => launch!(
            gpu,
            &format!("gemv_{gn}"),
            format!("moe_gate_up_q8_{gn}"),
            cfg2(
                (ff / 32) as u32,
                np as u32,
                units_threads(64 * h / 32).min(gate_up_threads(ex.gate.ty))
            ),
            [
                &ex.gate.bytes,
                &ex.up.bytes,
                &sb,
                ids,
                &ne,
                xg,
                &ksi,
                &mut *aq,
                &ffi,
                &hi,
                &wb,
                &xb,
                &mut *err
            ]
        )?,
    }
    let (dslab, dwrb, dxrb) = (
        ex.down.slab_bytes()?,
        ex.down.row_bytes()?,
        ex.down.act_row_bytes()?,
    );
    need(k, "down", ex.down.bytes.len(), dslab * ex.down.n_expert)?;
    let rb = down_rows_per_block(ks, ff / 32);
    let (dne, rbi) = (i32_of(k, ex.down.n_expert)?, i32_of(k, rb)?);
    let (dsb, dwb, dxb) = (u64_of(dslab), u64_of(dwrb), u64_of(dxrb));
    let c = cfg2(
        h.div_ceil(rb) as u32,
        nt as u32,
        units_threads(ks * rb * ff / 32),
    );
    gpu.note_bytes(np * (h * dwrb + dxrb));
    if staged.down {
        // (out, gate, sg, su, sw, sff, swrb): the shared expert's output, or its parts.
        let (mut sy, mut sgate, mut sg, mut su, mut sw, mut sff, mut swrb) =
            (0u64, 0u64, 0, 0, 0, 0i32, 0u64);
        if let Some(sh) = &shared {
            need(k, "shared gate", sh.gate.len(), nt)?;
            sgate = addr(gpu, sh.gate);
            match &sh.y {
                SharedY::Out(y) => {
                    need(k, "shared", y.len(), nt * h)?;
                    sy = addr(gpu, *y);
                }
                SharedY::Parts { g, u, down } => {
                    need(k, "shared g", g.len(), nt * down.k)?;
                    need(k, "shared u", u.len(), nt * down.k)?;
                    need(k, "shared down", down.bytes.len(), h * down.row_bytes()?)?;
                    (sg, su, sw) = (addr(gpu, *g), addr(gpu, *u), addr(gpu, &down.bytes));
                    (sff, swrb) = (i32_of(k, down.k)?, u64_of(down.row_bytes()?));
                    gpu.note_bytes(h * down.row_bytes()? + 8 * nt * down.k);
                }
            }
        }
        return launch!(
            gpu,
            &format!("gemv_{dn}"),
            "moe_down_q2s",
            cfg2((h / DOWN_STAGED_ROWS) as u32, nt as u32, 512),
            [
                &ex.down.bytes,
                &dsb,
                ids,
                &dne,
                &*aq,
                wts,
                &ksi,
                out,
                &sy,
                &sgate,
                &hi,
                &ffi,
                &dwb,
                &dxb,
                err,
                &early,
                &sg,
                &su,
                &sw,
                &sff,
                &swrb
            ]
        );
    }
    match shared {
        None => launch!(
            gpu,
            &format!("gemv_{dn}"),
            format!("moe_down_combine_{dn}"),
            c,
            [
                &ex.down.bytes,
                &dsb,
                ids,
                &dne,
                &*aq,
                wts,
                &ksi,
                out,
                &hi,
                &ffi,
                &dwb,
                &dxb,
                &rbi,
                err
            ]
        ),
        Some(sh) => {
            let SharedY::Out(sy) = sh.y else {
                return Err(bad(
                    k,
                    "the shared expert's parts need the staged down".into(),
                ));
            };
            need(k, "shared", sy.len(), nt * h)?;
            need(k, "shared gate", sh.gate.len(), nt)?;
            launch!(
                gpu,
                &format!("gemv_{dn}"),
                format!("moe_down_combine_shared_{dn}"),
                c,
                [
                    &ex.down.bytes,
                    &dsb,
                    ids,
                    &dne,
                    &*aq,
                    wts,
                    &ksi,
                    out,
                    sy,
                    sh.gate,
                    &hi,
                    &ffi,
                    &dwb,
                    &dxb,
                    &rbi,
                    err
                ]
            )
        }
    }
}

/// `Σ_k w_k · down_e(silu(gate_e·x) ⊙ up_e·x)` over each row's routed experts (cpu::moe_experts):
/// `ids`/`wts` are the router's `[nt, kslots]` outputs (device). `grouped`: the products grouped
/// by expert (prefill) instead of one pair a block (decode); the outputs are bitwise the same.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    gpu: &Gpu,
    ex: &ExpertsDev<'_>,
    x: &CudaSlice<f32>,
    ids: &CudaSlice<i32>,
    wts: &CudaSlice<f32>,
    s: &mut MoeScratch,
    grouped: bool,
    out: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "moe_experts";
    let (nt, ks) = (s.nt, s.kslots);
    let (h, ff) = (ex.gate.k, ex.gate.rows);
    if ex.up.k != h || ex.up.rows != ff || ex.down.k != ff || ex.down.rows != h {
        return Err(bad(
            k,
            format!(
                "gate {}×{}, up {}×{}, down {}×{}",
                ex.gate.rows, ex.gate.k, ex.up.rows, ex.up.k, ex.down.rows, ex.down.k
            ),
        ));
    }
    let np = nt * ks;
    prepare(gpu, ex.gate, x, nt, &mut s.xg)?;
    let same_fmt = ex.up.act()? == ex.gate.act()?;
    if !same_fmt {
        prepare(gpu, ex.up, x, nt, &mut s.xu)?;
    }
    if grouped {
        s.groups.build(gpu, ids, err)?;
        moe_matmul(gpu, ex.gate, &s.groups, &s.xg, false, ks, &mut s.g)?;
        let xu = if same_fmt { &s.xg } else { &s.xu };
        moe_matmul(gpu, ex.up, &s.groups, xu, false, ks, &mut s.u)?;
    } else {
        moe_gemv(gpu, ex.gate, ids, &s.xg, false, ks, np, &mut s.g, err)?;
        let xu = if same_fmt { &s.xg } else { &s.xu };
        moe_gemv(gpu, ex.up, ids, xu, false, ks, np, &mut s.u, err)?;
    }
    swiglu(gpu, &s.g, &s.u, &mut s.act, np * ff)?;
    prepare(gpu, ex.down, &s.act, np, &mut s.aq)?;
    if grouped {
        moe_matmul(gpu, ex.down, &s.groups, &s.aq, true, ks, &mut s.y)?;
    } else {
        moe_gemv(gpu, ex.down, ids, &s.aq, true, ks, np, &mut s.y, err)?;
    }
    moe_combine(gpu, &s.y, wts, out, nt, ks, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows per block of the unit-parallel products: a unit a thread where rows are short,
    /// within the shared contributions, never more rows than the product has.
    #[test]
    fn unit_parallel_blocks_fit_their_shared_memory() {
        assert_eq!(units_rows_per_block(320, 8, 324), Some(1)); // the mix's down, rows of 10240
        assert_eq!(units_rows_per_block(80, 1, 513), Some(4)); // the router, rows of 2560
        assert_eq!(units_rows_per_block(10, 8, 10240), Some(26)); // the mix's up, rows of 320
        assert_eq!(units_rows_per_block(10, 1, 3), Some(3));
        assert_eq!(units_rows_per_block(1025, 8, 10), None); // rows of 32,800 at 8 rows
        assert_eq!(units_rows_per_block(0, 1, 10), None);
        for units in [1usize, 10, 20, 80, 192, 320, 768] {
            for nt in 1..=8 {
                let rb = units_rows_per_block(units, nt, 1 << 20).unwrap();
                assert!(
                    nt * rb * units <= UNITS_PART,
                    "{units} units, {nt} rows: {rb}"
                );
            }
        }
        assert_eq!(down_rows_for(10, 20, 512), 2);
        assert_eq!(down_rows_for(10, 20, 1024), 5);
        for (ks, units) in [(1usize, 1usize), (8, 20), (10, 20), (10, 80), (16, 200)] {
            let rb = down_rows_per_block(ks, units);
            assert!(ks * rb * units <= 1024 || rb == 1);
            assert!(rb >= 1 && ks * rb <= 256 && ks * rb * units <= UNITS_PART);
        }
        assert_eq!(units_threads(1), 32);
        assert_eq!(units_threads(320), 320);
        assert_eq!(units_threads(5120), 1024);
    }

    /// Which products the fast prefill takes to cuBLAS, decided on the host: dense BF16 from
    /// 64 rows, dense quantized formats with a BF16 decoder from 256 rows and within the
    /// scratch, never expert slabs, F32, odd row lengths or sizes beyond 32-bit arguments.
    #[test]
    fn the_fast_prefill_takes_large_dense_products_only() {
        use GgmlType as G;
        assert!(blas_takes(G::BF16, 320, 10240, 1, 64));
        assert!(!blas_takes(G::BF16, 320, 10240, 1, 63));
        assert!(blas_takes(G::Q4_K, 6144, 2560, 1, 256));
        assert!(!blas_takes(G::Q4_K, 6144, 2560, 1, 255));
        assert!(blas_takes(G::Q2_0, 2560, 1024, 1, 512));
        assert!(!blas_takes(G::Q2_0, 2560, 1024, 512, 512), "expert slabs");
        assert!(
            !blas_takes(G::F32, 256, 256, 1, 512),
            "F32 keeps the exact kernels"
        );
        assert!(
            !blas_takes(G::BF16, 256, 100, 1, 512),
            "rows of 100 are not whole units"
        );
        assert!(
            !blas_takes(G::Q6_K, 248_320, 2560, 1, 512),
            "the LM head is over the scratch"
        );
        assert!(blas_takes(G::Q6_K, 16_384, 4096, 1, 512));
        assert!(!blas_takes(G::Q8_0, 0, 2560, 1, 512));
        assert!(!blas_takes(G::BF16, 1 << 31, 32, 1, 512), "rows beyond i32");
        assert!(!has_dequant_bf16(G::BF16) && !has_dequant_bf16(G::F32));
        // Every dequantizer the host may ask for is in embed.cu, and its format has exact
        // kernels too (the exact mode's products).
        let src = include_str!("../kernels/embed.cu");
        let report = strata_engine::kernels::embed::REPORT_FORMATS;
        for t in report.into_iter().filter(|&t| has_dequant_bf16(t)) {
            assert!(has_products(t), "{t}");
            let (up, low) = (t.name().to_uppercase(), t.name().to_lowercase());
            assert!(
                src.contains(&format!("DEQUANT_BF16(T_{up}, {low})")),
                "{low}"
            );
        }
        assert_eq!(report.iter().filter(|&&t| has_dequant_bf16(t)).count(), 12);
    }

    /// The backend's switches take unset, empty, 0 and 1, and refuse anything else by name.
    #[test]
    fn switches_refuse_unknown_values_by_name() {
        use crate::device::{check_switches, SWITCHES};
        assert!(check_switches(|_| None).is_ok());
        for ok in ["", "0", "1", " 1 "] {
            assert!(check_switches(|_| Some(ok.to_string())).is_ok(), "{ok:?}");
        }
        for var in SWITCHES {
            let e = check_switches(|v| (v == var).then(|| "off".to_string()))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{var}=off")) && e.contains("0 (off) or 1"),
                "{e}"
            );
        }
    }

    /// An override turns a per-step switch off and on and back to the environment's value;
    /// switches read only at start and names that are no switch are refused by name.
    #[test]
    fn switch_overrides_take_per_step_switches_only() {
        use crate::device::{set_switch, switch_on, SWITCHES, SWITCHES_AT_START};
        let v = "STRATA_CUDA_QSA_PREP";
        let env = switch_on(v);
        set_switch(v, Some(false)).unwrap();
        assert!(!switch_on(v) && !super::qsa_prep_on());
        set_switch(v, Some(true)).unwrap();
        assert!(switch_on(v) && super::qsa_prep_on());
        set_switch(v, None).unwrap();
        assert_eq!(switch_on(v), env);
        for s in SWITCHES_AT_START {
            assert!(SWITCHES.contains(&s));
            let e = set_switch(s, Some(false)).unwrap_err().to_string();
            assert!(e.contains(s) && e.contains("environment"), "{e}");
        }
        let e = set_switch("STRATA_CUDA_NOPE", Some(true))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("STRATA_CUDA_NOPE") && e.contains("not one of"),
            "{e}"
        );
    }

    /// gemv_rows4's host geometry follows the kernel's rule for the formats it runs: a warp's
    /// rows are whole 16-byte granules (Q6_K and Q3_K rows of 2560 are not: four rows a warp,
    /// four warps; Q4_K and IQ4_XS rows are: a row a warp, eight warps).
    #[test]
    fn rows4_geometry_matches_the_kernels_granules() {
        for (ty, want) in [
            (GgmlType::Q6_K, (16, 128)),
            (GgmlType::Q3_K, (16, 128)),
            (GgmlType::Q4_K, (8, 256)),
            (GgmlType::IQ4_XS, (8, 256)),
        ] {
            let rb = ty.row_bytes(2560).unwrap();
            let (per_block, threads) = rows4_geometry(rb);
            assert_eq!((per_block, threads), want, "{ty}: rows of {rb} bytes");
            let rw = per_block / (threads as usize / 32);
            assert!(
                (rw * rb).is_multiple_of(16),
                "{ty}: a warp's rows are whole granules"
            );
        }
    }

    /// The dense tensor-core grid covers every (row, token) exactly once: blocks of 32 × 16,
    /// the last ones partial, none empty.
    #[test]
    fn mmq_grid_covers_the_product() {
        for (rows, nt) in [
            (1, 9),
            (31, 16),
            (32, 17),
            (33, 512),
            (2560, 4096),
            (151_936, 9),
        ] {
            let (gx, gy) = mmq_grid(rows, nt);
            let (gx, gy) = (gx as usize, gy as usize);
            assert!(
                gx * MMQ_ROWS >= rows && (gx - 1) * MMQ_ROWS < rows,
                "{rows} rows"
            );
            assert!(
                gy * MMQ_TOKENS >= nt && (gy - 1) * MMQ_TOKENS < nt,
                "{nt} tokens"
            );
        }
        assert_eq!(mmq_grid(64, 32), (2, 2));
        assert_eq!(mmq_grid(65, 33), (3, 3));
        for (rows, nt, k, name, tokens) in [
            (4, 9, 10240, "mmt_bf16", 8),
            (320, 512, 10240, "mmt_bf16", 8),
            (10240, 17, 320, "mmt_bf16_h", 16),
            (33, 9, 512, "mmt_bf16_h", 16),
            (33, 200, 544, "mmt_bf16", 8),
        ] {
            let (kn, (gx, gy)) = mmt_kernel(rows, nt, k);
            let (gx, gy) = (gx as usize, gy as usize);
            assert_eq!(kn, name, "k = {k}");
            assert!(gx * 32 >= rows && (gx - 1) * 32 < rows, "{rows} rows");
            assert!(gy * tokens >= nt && (gy - 1) * tokens < nt, "{nt} tokens");
        }
    }

    /// moe_group's tiles (per expert, ⌈count / 8⌉ tiles) never exceed the bound the launch
    /// grid and the tile buffer are sized by, for even, skewed and one-expert routings.
    #[test]
    fn moe_tile_bound_holds() {
        let tiles = |counts: &[usize]| counts.iter().map(|c| c.div_ceil(8)).sum::<usize>();
        let mut rng = strata_engine::kernels::testdata::Rng::new(3);
        for (nt, ks, ne) in [(512, 10, 512), (9, 10, 512), (4096, 10, 512), (100, 4, 16)] {
            let np = nt * ks;
            let bound = moe_max_tiles(np, ne);
            let mut cases: Vec<Vec<usize>> = Vec::new();
            // Every pair on one expert; spread evenly; 9 pairs on as many experts as possible
            // (the most partial tiles); random.
            let mut one = vec![0; ne];
            one[0] = np;
            cases.push(one);
            cases.push(
                (0..ne)
                    .map(|e| np / ne + usize::from(e < np % ne))
                    .collect(),
            );
            let mut nine = vec![0; ne];
            let mut left = np;
            for c in nine.iter_mut() {
                let n = left.min(9);
                *c = n;
                left -= n;
            }
            nine[0] += left;
            cases.push(nine);
            let mut rand = vec![0; ne];
            for _ in 0..np {
                rand[rng.below(ne)] += 1;
            }
            cases.push(rand);
            for c in &cases {
                assert_eq!(c.iter().sum::<usize>(), np);
                assert!(tiles(c) <= bound, "{} tiles > bound {bound}", tiles(c));
            }
        }
    }
}
