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
            bytes: gpu.upload(bytes)?,
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
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        kernel,
        cfg2(gx, gy, 256),
        [&w.bytes, x, y, &ri, &ki, &ni, &wb, &xb]
    )
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

/// The product the model runs: the optimized GEMV for 1..=8 rows, [`matmul`] beyond (the
/// tensor-core kernel) and for the formats without a GEMV (all bitwise the same per row).
pub fn product(
    gpu: &Gpu,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    whole_units("product", w)?;
    if (1..=8).contains(&nt) && w.ty == GgmlType::BF16 && w.k == 10240 {
        // The hyper-connection down / inject shape: the optimized BF16 GEMV at K = 10240.
        let k = "product";
        need(k, "w", w.bytes.len(), w.rows * w.row_bytes()?)?;
        need(k, "x", x.len(), nt * w.act_row_bytes()?)?;
        need(k, "y", y.len(), nt * w.rows)?;
        let ri = i32_of(k, w.rows)?;
        launch!(
            gpu,
            "gemv_bf16",
            format!("gemv_opt_bf16_k{}_nt{nt}", w.k),
            cfg(w.rows.div_ceil(8) as u32, 256),
            [&w.bytes, x, y, &ri]
        )
    } else if (1..=8).contains(&nt) && strata_engine::kernels::gemv::GEMV_FORMATS.contains(&w.ty) {
        ops::gemv(gpu, "optimized", w.ty, &w.bytes, w.rows, w.k, x, nt, y)
    } else {
        matmul(gpu, w, x, nt, y)
    }
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
    product(gpu, hc.down, &s.xq, rows, &mut s.a)?;
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
    product(gpu, hc.up, &s.aq, rows, &mut s.g)?;
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
            product(gpu, wi, &s.xq, rows, inj)?;
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
    launch!(
        gpu,
        "gdn",
        "conv1d_silu_f32",
        cfg(c.div_ceil(256) as u32, 256),
        [x, w, hist, out, &ni, &ci, &ki, &di]
    )
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
    launch!(
        gpu,
        "gdn",
        format!("gdn_scan_{dk}"),
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
    launch!(
        gpu,
        "attn",
        "qsa_scores",
        cfg2(sel.cap_blocks.div_ceil(256) as u32, n as u32, 256),
        [qi, blocks, pos, &mut sel.scores, &cb, &hi, &di, &ri]
    )?;
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
                err
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
    // Rows run in chunks of the scratch's rows (each row's result does not depend on it).
    let qc = n_head * head_dim;
    for r0 in (0..n).step_by(s.rows.max(1)) {
        let m = s.rows.min(n - r0);
        let qv = q.slice(r0 * qc..(r0 + m) * qc);
        let pv = pos.slice(r0..r0 + m);
        let mut ov = out.slice_mut(r0 * qc..(r0 + m) * qc);
        let (lst, cnt) = match sel {
            Some(se) => (
                se.sel.slice(r0 * se.stride..(r0 + m) * se.stride),
                se.cnt.slice(r0..r0 + m),
            ),
            None => (pos.slice(r0..r0 + m), pos.slice(r0..r0 + m)),
        };
        let c2 = cfg2((m * n_head) as u32, chunks as u32, 256);
        launch!(
            gpu,
            "attn",
            "attend_split_scores",
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
                &mut *err
            ]
        )?;
        launch!(
            gpu,
            "attn",
            "attend_split_out",
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
                &mc
            ]
        )?;
        launch!(
            gpu,
            "attn",
            "attend_split_sum",
            cfg((m * n_head) as u32, 256),
            [&s.part, &cnt, &pv, &mut ov, &capu, &nh, &hd, &causal, &mc]
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
    launch!(
        gpu,
        &format!("gemv_{tn}"),
        format!("{kernel}_{tn}"),
        cfg2(
            w.rows.div_ceil(rows_a_block) as u32,
            groups.max_tiles as u32,
            threads
        ),
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
    aq: CudaSlice<u8>,
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

// ---- the MoE block (qwen4exp::moe) ------------------------------------------------------------

/// The weights of one MoE block on the device: router `[n_expert, h]` (BF16 in the release),
/// the routed experts, the shared expert's gate/up `[ff_sh, h]` and down `[h, ff_sh]`, and the
/// shared expert's gate `[1, h]`.
pub struct MoeLayerDev<'a> {
    pub router: DevWeight,
    pub experts: ExpertsDev<'a>,
    pub n_used: usize,
    pub gate_sh: DevWeight,
    pub up_sh: DevWeight,
    pub down_sh: DevWeight,
    pub gate_inp_sh: DevWeight,
}

/// Scratch of [`moe_layer`] for `nt` rows (fixed addresses: the step replays as a graph).
pub struct MoeLayerScratch {
    pub nt: usize,
    xr: CudaSlice<u8>,
    xs: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub wts: CudaSlice<f32>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    act: CudaSlice<f32>,
    aq: CudaSlice<u8>,
    shared: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    pub experts: MoeScratch,
}

impl MoeLayerScratch {
    pub fn new(gpu: &Gpu, l: &MoeLayerDev<'_>, nt: usize) -> Result<MoeLayerScratch, CudaError> {
        let (h, ff) = (l.router.k, l.gate_sh.rows);
        Ok(MoeLayerScratch {
            nt,
            xr: gpu.zeros(nt * l.router.act_row_bytes()?)?,
            xs: gpu.zeros(nt * l.gate_sh.act_row_bytes()?)?,
            logits: gpu.zeros(nt * l.router.rows)?,
            ids: gpu.zeros(nt * l.n_used)?,
            wts: gpu.zeros(nt * l.n_used)?,
            g: gpu.zeros(nt * ff)?,
            u: gpu.zeros(nt * ff)?,
            act: gpu.zeros(nt * ff)?,
            aq: gpu.zeros(nt * l.down_sh.act_row_bytes()?)?,
            shared: gpu.zeros(nt * h)?,
            gate: gpu.zeros(nt)?,
            experts: MoeScratch::new(gpu, &l.experts, nt, l.n_used)?,
        })
    }
}

/// The MoE block of `nt` rows `x` (`[nt, h]`): router → route (the catalogue kernel: softmax,
/// top-k ties to the lower id, renormalised) → routed experts (decode: one pair a block; with
/// `grouped`, by expert) → shared expert `down(silu(gate·x) ⊙ up·x)` → `out = y + σ(g·x)·shared`.
/// The router's ids and weights stay on the device (`s.ids`, `s.wts`).
pub fn moe_layer(
    gpu: &Gpu,
    l: &MoeLayerDev<'_>,
    x: &CudaSlice<f32>,
    s: &mut MoeLayerScratch,
    grouped: bool,
    out: &mut CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let k = "moe_layer";
    let (nt, h, ff) = (s.nt, l.router.k, l.gate_sh.rows);
    if l.gate_sh.k != h
        || l.up_sh.k != h
        || l.up_sh.rows != ff
        || l.down_sh.k != ff
        || l.down_sh.rows != h
        || l.gate_inp_sh.k != h
        || l.gate_inp_sh.rows != 1
        || l.experts.gate.k != h
        || l.router.rows != l.experts.gate.n_expert
        || l.gate_sh.act()? != l.up_sh.act()?
        || l.gate_inp_sh.act()? != l.router.act()?
    {
        return Err(bad(k, "weights of mismatched shapes or formats".into()));
    }
    need(k, "x", x.len(), nt * h)?;
    need(k, "out", out.len(), nt * h)?;
    if nt == 0 {
        return Ok(());
    }
    prepare(gpu, &l.router, x, nt, &mut s.xr)?;
    product(gpu, &l.router, &s.xr, nt, &mut s.logits)?;
    ops::route(
        gpu,
        "optimized",
        &s.logits,
        &mut s.ids,
        &mut s.wts,
        nt,
        l.router.rows,
        l.n_used,
    )?;
    product(gpu, &l.gate_inp_sh, &s.xr, nt, &mut s.gate)?;
    prepare(gpu, &l.gate_sh, x, nt, &mut s.xs)?;
    product(gpu, &l.gate_sh, &s.xs, nt, &mut s.g)?;
    product(gpu, &l.up_sh, &s.xs, nt, &mut s.u)?;
    swiglu(gpu, &s.g, &s.u, &mut s.act, nt * ff)?;
    prepare(gpu, &l.down_sh, &s.act, nt, &mut s.aq)?;
    product(gpu, &l.down_sh, &s.aq, nt, &mut s.shared)?;
    moe_experts(
        gpu,
        &l.experts,
        x,
        &s.ids,
        &s.wts,
        &mut s.experts,
        grouped,
        out,
        err,
    )?;
    add_sigmoid_gated(gpu, out, &s.shared, &s.gate, nt, h)
}

#[cfg(test)]
mod tests {
    use super::*;

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
