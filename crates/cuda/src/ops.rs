//! One launch function per catalogue op: argument checks (every slice long enough for what
//! the kernel touches), the variant's kernel (`baseline` → `*_base`, `optimized` → the
//! specialized `*_opt_*` kernel where the shape has one, else the base kernel), and the launch.
//! Semantics: `strata_engine::kernels`.

use cudarc::driver::{CudaSlice, PushKernelArg};
use strata_engine::kernels::registry::{BASELINE, OPTIMIZED};
use strata_engine::kernels::slop::STATE_LEN;
use strata_engine::kernels::{ActFmt, KernelError};
use strata_quant::GgmlType;

use crate::device::{cfg, Gpu};
use crate::CudaError;

fn optimized(op: &str, variant: &str) -> Result<bool, CudaError> {
    match variant {
        BASELINE => Ok(false),
        OPTIMIZED => Ok(true),
        v => Err(CudaError::Kernel(KernelError::UnknownVariant {
            op: op.into(),
            variant: v.into(),
            origin: "the CUDA backend",
            known: format!("{BASELINE}, {OPTIMIZED}"),
        })),
    }
}

pub(crate) fn need(kernel: &str, what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got < want {
        return Err(CudaError::Launch {
            kernel: kernel.into(),
            what: format!("{what} holds {got} elements, the launch needs {want}"),
        });
    }
    Ok(())
}

pub(crate) fn bad(kernel: &str, what: String) -> CudaError {
    CudaError::Launch {
        kernel: kernel.into(),
        what,
    }
}

pub(crate) fn fmt_name(fmt: ActFmt) -> &'static str {
    match fmt {
        ActFmt::F32 => "f32",
        ActFmt::Bf16 => "bf16",
        ActFmt::Q8_0 => "q8_0",
        ActFmt::Q8K => "q8_k",
    }
}

pub(crate) fn i32_of(kernel: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| {
        bad(
            kernel,
            format!("size {v} does not fit the kernel's 32-bit index"),
        )
    })
}

macro_rules! launch {
    ($gpu:expr, $module:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let name: &str = &$name;
        if $gpu.ablated(name) {
            $gpu.launch_ablated(name)
        } else {
        let f = $gpu.func($module, name)?;
        if $gpu.recording() {
            #[allow(unused_imports)]
            use $crate::record::KArg as _;
            let args = vec![$( ($arg).karg($gpu.stream()) ),*];
            let _ = $gpu.record($crate::record::Op::Launch { func: f, cfg: $cfg, args });
        } else {
            let mut b = $gpu.stream().launch_builder(&f);
            $( b.arg($arg); )*
            $gpu.timed(name, || {
                // SAFETY: the argument list matches the kernel's parameter list in
                // kernels/*.cu, and the caller checked that every buffer covers what the launch
                // reads and writes.
                unsafe { b.launch($cfg) }
                    .map(|_| ())
                    .map_err(|e| CudaError::Launch { kernel: name.to_string(), what: e.to_string() })
            })?;
        }
        Ok::<(), CudaError>(())
        }
    }};
}
pub(crate) use launch;

/// `rms_xprep`: `nt` rows of `n` in `x`, weight `w` (`n`), image in `fmt` to `out`.
#[allow(clippy::too_many_arguments)]
pub fn rms_xprep(
    gpu: &Gpu,
    variant: &str,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
    nt: usize,
    n: usize,
    eps: f32,
    fmt: ActFmt,
) -> Result<(), CudaError> {
    let k = "rms_xprep";
    let rb = fmt
        .row_bytes(n)
        .ok_or_else(|| bad(k, format!("n = {n} is not whole {} blocks", fmt.name())))?;
    need(k, "x", x.len(), nt * n)?;
    need(k, "w", w.len(), n)?;
    need(k, "out", out.len(), nt * rb)?;
    let opt = optimized(k, variant)? && (n == 2560 || n == 10240);
    if opt {
        launch!(
            gpu,
            "norm",
            format!("rms_xprep_opt_{n}_{}", fmt_name(fmt)),
            cfg(nt as u32, if n == 10240 { 1024 } else { 256 }),
            [x, w, out, &eps]
        )
    } else {
        let (ni, fi) = (i32_of(k, n)?, fmt.code() as i32);
        launch!(
            gpu,
            "norm",
            "rms_xprep_base",
            cfg(nt as u32, 256),
            [x, w, out, &ni, &eps, &fi]
        )
    }
}

/// `combine_gnorm`: `h` (`nt·streams·n`), `e` (`nt·n`), `w` (`streams·n`) to `r`, `o`.
#[allow(clippy::too_many_arguments)]
pub fn combine_gnorm(
    gpu: &Gpu,
    variant: &str,
    h: &CudaSlice<f32>,
    e: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    r: &mut CudaSlice<f32>,
    o: &mut CudaSlice<f32>,
    nt: usize,
    n: usize,
    streams: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let k = "combine_gnorm";
    need(k, "h", h.len(), nt * streams * n)?;
    need(k, "e", e.len(), nt * n)?;
    need(k, "w", w.len(), streams * n)?;
    need(k, "r", r.len(), nt * streams * n)?;
    need(k, "o", o.len(), nt * streams * n)?;
    if optimized(k, variant)? && n == 2560 && streams == 4 {
        launch!(
            gpu,
            "norm",
            "combine_gnorm_opt_2560_4",
            cfg((nt * 4) as u32, 256),
            [h, e, w, r, o, &eps]
        )
    } else {
        let (ni, si) = (i32_of(k, n)?, i32_of(k, streams)?);
        launch!(
            gpu,
            "norm",
            "combine_gnorm_base",
            cfg(nt as u32, 256),
            [h, e, w, r, o, &ni, &si, &eps]
        )
    }
}

/// `xprep`: `rows` rows of `n` from `x` to their image in `fmt`.
pub fn xprep(
    gpu: &Gpu,
    variant: &str,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
    rows: usize,
    n: usize,
    fmt: ActFmt,
) -> Result<(), CudaError> {
    let k = "xprep";
    let rb = fmt
        .row_bytes(n)
        .ok_or_else(|| bad(k, format!("n = {n} is not whole {} blocks", fmt.name())))?;
    if fmt == ActFmt::Q8K && !n.is_multiple_of(256) || !n.is_multiple_of(32) {
        return Err(bad(k, format!("n = {n} is not whole blocks")));
    }
    need(k, "x", x.len(), rows * n)?;
    need(k, "out", out.len(), rows * rb)?;
    let bs = if fmt == ActFmt::Q8K { 256 } else { 32 };
    let warps = rows * (n / bs);
    let grid = warps.div_ceil(8) as u32;
    let ri = i32_of(k, rows)?;
    if optimized(k, variant)? && n == 2560 {
        launch!(
            gpu,
            "norm",
            format!("xprep_opt_2560_{}", fmt_name(fmt)),
            cfg(grid, 256),
            [x, out, &ri]
        )
    } else {
        let (ni, fi) = (i32_of(k, n)?, fmt.code() as i32);
        launch!(
            gpu,
            "norm",
            "xprep_base",
            cfg(grid, 256),
            [x, out, &ri, &ni, &fi]
        )
    }
}

/// `embed`: rows `ids` of `table` (`ty`, rows of `row_len`) to `out` (`ids·row_len`).
#[allow(clippy::too_many_arguments)]
pub fn embed(
    gpu: &Gpu,
    variant: &str,
    ty: GgmlType,
    table: &CudaSlice<u8>,
    table_rows: usize,
    ids: &CudaSlice<u32>,
    n_ids: usize,
    out: &mut CudaSlice<f32>,
    row_len: usize,
) -> Result<(), CudaError> {
    let k = "embed";
    if !strata_engine::kernels::embed::REPORT_FORMATS.contains(&ty) {
        return Err(bad(k, format!("{ty} is not one of the 13 report formats")));
    }
    let rb = ty
        .row_bytes(row_len)
        .ok_or_else(|| bad(k, format!("row length {row_len} is not whole {ty} blocks")))?;
    if !row_len.is_multiple_of(32) {
        return Err(bad(
            k,
            format!("row length {row_len} is not a multiple of 32"),
        ));
    }
    need(k, "table", table.len(), table_rows * rb)?;
    need(k, "ids", ids.len(), n_ids)?;
    need(k, "out", out.len(), n_ids * row_len)?;
    // An id at or past `table_rows` gives a NaN row (checked in the kernel: no host copy).
    let nr = u32::try_from(table_rows)
        .map_err(|_| bad(k, format!("{table_rows} rows exceed 32-bit ids")))?;
    if optimized(k, variant)? && row_len == 2560 {
        let name = format!("embed_opt_2560_{}", ty.name().to_lowercase());
        launch!(
            gpu,
            "embed",
            name,
            cfg(n_ids as u32, 128),
            [table, &nr, ids, out]
        )
    } else {
        let (li, rbu, ti) = (i32_of(k, row_len)?, rb as u64, ty.id() as i32);
        launch!(
            gpu,
            "embed",
            "embed_base",
            cfg(n_ids as u32, 256),
            [table, &nr, ids, out, &li, &rbu, &ti]
        )
    }
}

/// `gemv`: `rows` weight rows of `k` elements (`ty`) times `nt` activation rows (paired
/// format) into `y` (`nt·rows`).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    variant: &str,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    rows: usize,
    kk: usize,
    x: &CudaSlice<u8>,
    nt: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let k = "gemv";
    if !strata_engine::kernels::gemv::GEMV_FORMATS.contains(&ty) {
        return Err(bad(k, format!("{ty} has no CUDA GEMV")));
    }
    if !(1..=8).contains(&nt) {
        return Err(bad(
            k,
            format!("{nt} activation rows; the kernels take 1..=8"),
        ));
    }
    let fmt =
        ActFmt::for_weight(ty).ok_or_else(|| bad(k, format!("{ty} has no paired activation")))?;
    let wrb = ty
        .row_bytes(kk)
        .ok_or_else(|| bad(k, format!("row length {kk} is not whole {ty} blocks")))?;
    let xrb = fmt.row_bytes(kk).ok_or_else(|| {
        bad(
            k,
            format!("row length {kk} is not whole {} blocks", fmt.name()),
        )
    })?;
    need(k, "w", w.len(), rows * wrb)?;
    need(k, "x", x.len(), nt * xrb)?;
    need(k, "y", y.len(), nt * rows)?;
    let grid = rows.div_ceil(4) as u32;
    let ri = i32_of(k, rows)?;
    let tn = ty.name().to_lowercase();
    let module = format!("gemv_{tn}");
    gpu.note_bytes(rows * wrb + nt * xrb);
    if optimized(k, variant)? && kk == 2560 {
        launch!(
            gpu,
            &module,
            format!("gemv_opt_{tn}_k2560_nt{nt}"),
            cfg(rows.div_ceil(8) as u32, 256),
            [w, x, y, &ri]
        )
    } else {
        let (ki, ni, wb, xb) = (i32_of(k, kk)?, nt as i32, wrb as u64, xrb as u64);
        launch!(
            gpu,
            &module,
            format!("gemv_base_{tn}"),
            cfg(grid, 128),
            [w, x, y, &ri, &ki, &ni, &wb, &xb]
        )
    }
}

/// `route`: `nt` rows of `n_exp` logits to top-`k` ids and weights.
#[allow(clippy::too_many_arguments)]
pub fn route(
    gpu: &Gpu,
    variant: &str,
    logits: &CudaSlice<f32>,
    ids: &mut CudaSlice<i32>,
    wts: &mut CudaSlice<f32>,
    nt: usize,
    n_exp: usize,
    k: usize,
) -> Result<(), CudaError> {
    let kn = "route";
    if n_exp == 0 || n_exp > 512 || k == 0 || k > 16 || k > n_exp {
        return Err(bad(
            kn,
            format!("{n_exp} experts / top-{k}: the kernels take up to 512 experts, k in 1..=16"),
        ));
    }
    need(kn, "logits", logits.len(), nt * n_exp)?;
    need(kn, "ids", ids.len(), nt * k)?;
    need(kn, "weights", wts.len(), nt * k)?;
    if optimized(kn, variant)? && ((n_exp, k) == (512, 10) || (n_exp, k) == (256, 8)) {
        launch!(
            gpu,
            "route",
            format!("route_opt_{n_exp}_{k}"),
            cfg(nt as u32, 32),
            [logits, ids, wts]
        )
    } else {
        let (ei, ki) = (n_exp as i32, k as i32);
        launch!(
            gpu,
            "route",
            "route_base",
            cfg(nt as u32, 32),
            [logits, ids, wts, &ei, &ki]
        )
    }
}

/// The slop tables on the device.
pub struct SlopDev {
    pub inverse: CudaSlice<i32>,
    pub pen_ids: CudaSlice<i32>,
    pub pen_vals: CudaSlice<f32>,
    pub newline: CudaSlice<i32>,
    pub blank: CudaSlice<i32>,
    pub ph_tok: CudaSlice<i32>,
    pub ph_start: CudaSlice<i32>,
    pub ph_pen: CudaSlice<f32>,
    pub n_pen: i32,
    pub n_nl: i32,
    pub n_bl: i32,
    pub n_ph: i32,
    pub cap_nl: i32,
    pub cap_bl: i32,
}

impl SlopDev {
    /// Uploads validated tables (`nv`: the draft vocabulary the logits will have).
    pub fn upload(
        gpu: &Gpu,
        t: &strata_engine::kernels::slop::SlopTables,
        nv: usize,
    ) -> Result<SlopDev, CudaError> {
        t.validate(nv)?;
        Ok(SlopDev {
            inverse: gpu.upload(&t.inverse)?,
            pen_ids: gpu.upload(&t.pen_ids)?,
            pen_vals: gpu.upload(&t.pen_vals)?,
            newline: gpu.upload(&t.newline)?,
            blank: gpu.upload(&t.blank)?,
            ph_tok: gpu.upload(&t.phrase_tokens)?,
            ph_start: gpu.upload(&t.phrase_start)?,
            ph_pen: gpu.upload(&t.phrase_pen)?,
            n_pen: t.pen_ids.len() as i32,
            n_nl: t.newline.len() as i32,
            n_bl: t.blank.len() as i32,
            n_ph: t.n_phrases() as i32,
            cap_nl: t.cap_newline,
            cap_bl: t.cap_blank,
        })
    }
}

/// `slop_pen` on `nv` draft logits in place. The state arrays hold [`STATE_LEN`] values;
/// `banned` holds `n_banned` ids (validated by the caller, as the tables are by
/// [`SlopDev::upload`]).
#[allow(clippy::too_many_arguments)]
pub fn slop_pen(
    gpu: &Gpu,
    variant: &str,
    t: &SlopDev,
    logits: &mut CudaSlice<f32>,
    nv: usize,
    mode: u32,
    prev: i32,
    banned: &CudaSlice<i32>,
    n_banned: usize,
    st_in: &CudaSlice<i32>,
    st_out: &mut CudaSlice<i32>,
) -> Result<(), CudaError> {
    let k = "slop_pen";
    if mode > 2 {
        return Err(bad(k, format!("mode {mode}, expected 0, 1 or 2")));
    }
    need(k, "logits", logits.len(), nv)?;
    need(k, "banned", banned.len(), n_banned)?;
    need(k, "state in", st_in.len(), STATE_LEN)?;
    need(k, "state out", st_out.len(), STATE_LEN)?;
    let (nvi, nb, mi) = (i32_of(k, nv)?, n_banned as i32, mode as i32);
    let (name, block) = if optimized(k, variant)? {
        ("slop_pen_opt", 256)
    } else {
        ("slop_pen_base", 32)
    };
    launch!(
        gpu,
        "sample",
        name,
        cfg(1, block),
        [
            logits,
            &nvi,
            &t.inverse,
            &t.pen_ids,
            &t.pen_vals,
            &t.n_pen,
            &t.newline,
            &t.n_nl,
            &t.blank,
            &t.n_bl,
            &t.ph_tok,
            &t.ph_start,
            &t.ph_pen,
            &t.n_ph,
            banned,
            &nb,
            &t.cap_nl,
            &t.cap_bl,
            &mi,
            &prev,
            st_in,
            st_out
        ]
    )
}

/// Scratch of the multi-block pick.
pub struct PickScratch {
    pub part_v: CudaSlice<f32>,
    pub part_i: CudaSlice<i32>,
    pub ticket: CudaSlice<u32>,
}

/// Blocks the optimized pick uses for `nv` values (4 values, one 16-byte load, a thread).
pub fn pick_blocks(nv: usize) -> usize {
    nv.div_ceil(1024).clamp(1, 1024)
}

impl PickScratch {
    pub fn new(gpu: &Gpu, nv: usize) -> Result<PickScratch, CudaError> {
        let b = pick_blocks(nv);
        Ok(PickScratch {
            part_v: gpu.zeros(b)?,
            part_i: gpu.zeros(b)?,
            ticket: gpu.zeros(1)?,
        })
    }
}

/// `pick` over `nv` logits: `out` gets (index, token, value bits).
#[allow(clippy::too_many_arguments)]
pub fn pick(
    gpu: &Gpu,
    variant: &str,
    logits: &CudaSlice<f32>,
    draft_ids: &CudaSlice<i32>,
    nv: usize,
    out: &mut CudaSlice<i32>,
    scratch: &mut PickScratch,
) -> Result<(), CudaError> {
    let k = "pick";
    if nv == 0 {
        return Err(bad(k, "empty vocabulary".into()));
    }
    need(k, "logits", logits.len(), nv)?;
    need(k, "draft ids", draft_ids.len(), nv)?;
    need(k, "out", out.len(), 3)?;
    let nvi = i32_of(k, nv)?;
    if optimized(k, variant)? {
        let b = pick_blocks(nv);
        need(
            k,
            "scratch",
            scratch.part_v.len().min(scratch.part_i.len()),
            b,
        )?;
        launch!(
            gpu,
            "sample",
            "pick_opt",
            cfg(b as u32, 256),
            [
                logits,
                draft_ids,
                &nvi,
                out,
                &mut scratch.part_v,
                &mut scratch.part_i,
                &mut scratch.ticket
            ]
        )
    } else {
        launch!(
            gpu,
            "sample",
            "pick_base",
            cfg(1, 1024),
            [logits, draft_ids, &nvi, out]
        )
    }
}

/// An empty kernel: the launch floor.
pub fn noop(gpu: &Gpu) -> Result<(), CudaError> {
    launch!(gpu, "norm", "noop", cfg(1, 32), [])
}
