//! One launch builder per catalogue op: argument checks (every buffer covers what the kernel
//! touches, shapes the kernels take), the variant's entry (`baseline` → `*_base`, `optimized`
//! → the entry specialized by constants), and the bound dispatch(es). Semantics:
//! `strata_engine::kernels`; float contract: `shaders/common.wgsl`.

use strata_engine::kernels::registry::{BASELINE, OPTIMIZED};
use strata_engine::kernels::slop::{SlopTables, STATE_LEN};
use strata_engine::kernels::{ActFmt, KernelError};
use strata_quant::GgmlType;

use crate::device::{Buf, Launch, Wgpu};
use crate::shaders;
use crate::WgpuError;

fn optimized(op: &str, variant: &str) -> Result<bool, WgpuError> {
    match variant {
        BASELINE => Ok(false),
        OPTIMIZED => Ok(true),
        v => Err(WgpuError::Kernel(KernelError::UnknownVariant {
            op: op.into(),
            variant: v.into(),
            origin: "the wgpu backend",
            known: format!("{BASELINE}, {OPTIMIZED}"),
        })),
    }
}

fn bad(kernel: &str, what: String) -> WgpuError {
    WgpuError::Launch {
        kernel: kernel.into(),
        what,
    }
}

fn need(kernel: &str, what: &str, b: &Buf, bytes: usize) -> Result<(), WgpuError> {
    if (b.bytes as usize) < bytes {
        return Err(bad(
            kernel,
            format!("{what} holds {} bytes, the launch needs {bytes}", b.bytes),
        ));
    }
    Ok(())
}

fn u32_of(kernel: &str, v: usize) -> Result<u32, WgpuError> {
    u32::try_from(v).map_err(|_| {
        bad(
            kernel,
            format!("size {v} exceeds the kernels' 32-bit index"),
        )
    })
}

/// Largest row the norm kernels take (their block-scale arrays in workgroup memory).
pub const MAX_NORM_ROW: usize = 10240;

fn image_bytes(k: &str, fmt: ActFmt, n: usize) -> Result<usize, WgpuError> {
    let rb = fmt
        .row_bytes(n)
        .ok_or_else(|| bad(k, format!("n = {n} is not whole {} blocks", fmt.name())))?;
    if n == 0 || n > MAX_NORM_ROW || !rb.is_multiple_of(4) {
        return Err(bad(
            k,
            format!(
                "n = {n}: the kernels take rows of 1..={MAX_NORM_ROW} values whose {} image is whole 4-byte words",
                fmt.name()
            ),
        ));
    }
    Ok(rb)
}

#[allow(clippy::too_many_arguments)]
fn norm_launch(
    g: &Wgpu,
    k: &str,
    opt: bool,
    bufs: [&Buf; 3],
    rows: usize,
    n: usize,
    eps: f32,
    fmt: ActFmt,
    norm: bool,
) -> Result<Vec<Launch>, WgpuError> {
    let params = [
        u32_of(k, n)?,
        eps.to_bits(),
        fmt.code(),
        u32_of(k, rows)?,
        norm as u32,
    ];
    let groups = (u32_of(k, rows)?, 1, 1);
    let l = if opt {
        let spec = shaders::spec_norm(n, fmt, norm);
        g.launch("norm", "rms_xprep_opt", &spec, &params, &bufs, groups)?
    } else {
        g.launch("norm", "rms_xprep_base", &[], &params, &bufs, groups)?
    };
    Ok(vec![l])
}

/// `rms_xprep`: `nt` rows of `n` in `x`, weight `w` (`n`), image in `fmt` to `out`.
#[allow(clippy::too_many_arguments)]
pub fn rms_xprep(
    g: &Wgpu,
    variant: &str,
    x: &Buf,
    w: &Buf,
    out: &Buf,
    nt: usize,
    n: usize,
    eps: f32,
    fmt: ActFmt,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "rms_xprep";
    let rb = image_bytes(k, fmt, n)?;
    need(k, "x", x, nt * n * 4)?;
    need(k, "w", w, n * 4)?;
    need(k, "out", out, nt * rb)?;
    norm_launch(
        g,
        k,
        optimized(k, variant)?,
        [x, w, out],
        nt,
        n,
        eps,
        fmt,
        true,
    )
}

/// `xprep`: `rows` rows of `n` from `x` to their image in `fmt`. `dummy` is any small buffer
/// (the norm module's weight binding, unread here).
#[allow(clippy::too_many_arguments)]
pub fn xprep(
    g: &Wgpu,
    variant: &str,
    x: &Buf,
    dummy: &Buf,
    out: &Buf,
    rows: usize,
    n: usize,
    fmt: ActFmt,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "xprep";
    let rb = image_bytes(k, fmt, n)?;
    need(k, "x", x, rows * n * 4)?;
    need(k, "out", out, rows * rb)?;
    norm_launch(
        g,
        k,
        optimized(k, variant)?,
        [x, dummy, out],
        rows,
        n,
        0.0,
        fmt,
        false,
    )
}

/// `combine_gnorm`: `h` (`nt·streams·n`), `e` (`nt·n`), `w` (`streams·n`) to `r`, `o`.
#[allow(clippy::too_many_arguments)]
pub fn combine_gnorm(
    g: &Wgpu,
    variant: &str,
    h: &Buf,
    e: &Buf,
    w: &Buf,
    r: &Buf,
    o: &Buf,
    nt: usize,
    n: usize,
    streams: usize,
    eps: f32,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "combine_gnorm";
    if n == 0 || streams == 0 {
        return Err(bad(k, format!("n = {n}, streams = {streams}")));
    }
    need(k, "h", h, nt * streams * n * 4)?;
    need(k, "e", e, nt * n * 4)?;
    need(k, "w", w, streams * n * 4)?;
    need(k, "r", r, nt * streams * n * 4)?;
    need(k, "o", o, nt * streams * n * 4)?;
    let params = [
        u32_of(k, n)?,
        eps.to_bits(),
        u32_of(k, streams)?,
        u32_of(k, nt)?,
    ];
    let bufs = [h, e, w, r, o];
    let l = if optimized(k, variant)? {
        let spec = shaders::spec_combine(n, streams);
        let groups = (u32_of(k, nt * streams)?, 1, 1);
        g.launch(
            "combine",
            "combine_gnorm_opt",
            &spec,
            &params,
            &bufs,
            groups,
        )?
    } else {
        let groups = (u32_of(k, nt)?, 1, 1);
        g.launch("combine", "combine_gnorm_base", &[], &params, &bufs, groups)?
    };
    Ok(vec![l])
}

/// `embed`: rows `ids` of `table` (`ty`, rows of `row_len`) to `out` (`n_ids·row_len`); an id
/// at or past `table_rows` gives a NaN row. `tab`: [`crate::shaders::grid_table`].
#[allow(clippy::too_many_arguments)]
pub fn embed(
    g: &Wgpu,
    variant: &str,
    ty: GgmlType,
    table: &Buf,
    table_rows: usize,
    ids: &Buf,
    n_ids: usize,
    out: &Buf,
    row_len: usize,
    tab: &Buf,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "embed";
    if !strata_engine::kernels::embed::REPORT_FORMATS.contains(&ty) {
        return Err(bad(k, format!("{ty} is not one of the 13 report formats")));
    }
    let rb = ty
        .row_bytes(row_len)
        .filter(|&b| b > 0)
        .ok_or_else(|| bad(k, format!("row length {row_len} is not whole {ty} blocks")))?;
    need(k, "table", table, table_rows * rb)?;
    need(k, "ids", ids, n_ids * 4)?;
    need(k, "out", out, n_ids * row_len * 4)?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let params = [
        ty.id(),
        u32_of(k, row_len)?,
        u32_of(k, rb)?,
        u32_of(k, table_rows)?,
        u32_of(k, bs)?,
        u32_of(k, ts)?,
    ];
    let bufs = [table, ids, out, tab];
    let groups = (u32_of(k, n_ids)?, 1, 1);
    let l = if optimized(k, variant)? {
        let spec = shaders::spec_embed(ty, row_len)
            .ok_or_else(|| bad(k, format!("row length {row_len} is not whole {ty} blocks")))?;
        g.launch("embed", "embed_opt", &spec, &params, &bufs, groups)?
    } else {
        g.launch("embed", "embed_base", &[], &params, &bufs, groups)?
    };
    Ok(vec![l])
}

/// `gemv`: `rows` weight rows of `kk` elements (`ty`) times `nt` activation rows (the paired
/// format) into `y` (`nt·rows`, token-major).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    g: &Wgpu,
    variant: &str,
    ty: GgmlType,
    w: &Buf,
    rows: usize,
    kk: usize,
    x: &Buf,
    nt: usize,
    y: &Buf,
    tab: &Buf,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "gemv";
    if !strata_engine::kernels::gemv::GEMV_FORMATS.contains(&ty) {
        return Err(bad(k, format!("{ty} has no wgpu GEMV")));
    }
    if !(1..=8).contains(&nt) {
        return Err(bad(
            k,
            format!("{nt} activation rows; the kernels take 1..=8"),
        ));
    }
    let fmt = ActFmt::for_weight(ty).ok_or_else(|| bad(k, format!("{ty}: no activation")))?;
    let wrb = ty
        .row_bytes(kk)
        .ok_or_else(|| bad(k, format!("row length {kk} is not whole {ty} blocks")))?;
    let xrb = fmt
        .row_bytes(kk)
        .filter(|b| b.is_multiple_of(4))
        .ok_or_else(|| {
            bad(
                k,
                format!(
                    "row length {kk}: {} rows must be whole 4-byte words",
                    fmt.name()
                ),
            )
        })?;
    need(k, "w", w, rows * wrb)?;
    need(k, "x", x, nt * xrb)?;
    need(k, "y", y, nt * rows * 4)?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let params = [
        ty.id(),
        u32_of(k, rows)?,
        u32_of(k, kk)?,
        u32_of(k, nt)?,
        u32_of(k, wrb)?,
        u32_of(k, xrb)?,
        u32_of(k, bs)?,
        u32_of(k, ts)?,
        fmt.code(),
    ];
    let bufs = [w, x, y, tab];
    // The optimized kernel runs one workgroup per row for all nt tokens: below 512 rows that
    // leaves the GPU idle for nt > 1 (H200: 1.09–1.17× the baseline at 256 rows), so there the
    // optimized variant is the baseline's dispatch (same bits either way).
    let l = if optimized(k, variant)? && (nt == 1 || rows >= 512) {
        let spec = shaders::spec_gemv(ty, kk, nt)
            .ok_or_else(|| bad(k, format!("{ty}: no specialization for k = {kk}")))?;
        g.launch(
            "gemv",
            "gemv_opt",
            &spec,
            &params,
            &bufs,
            (u32_of(k, rows)?, 1, 1),
        )?
    } else {
        let groups = (u32_of(k, rows)?, u32_of(k, nt)?, 1);
        g.launch("gemv", "gemv_base", &[], &params, &bufs, groups)?
    };
    Ok(vec![l])
}

/// `route`: `nt` rows of `n_exp` logits to top-`k` ids and weights.
#[allow(clippy::too_many_arguments)]
pub fn route(
    g: &Wgpu,
    variant: &str,
    logits: &Buf,
    ids: &Buf,
    wts: &Buf,
    nt: usize,
    n_exp: usize,
    k: usize,
) -> Result<Vec<Launch>, WgpuError> {
    let kn = "route";
    if n_exp == 0 || n_exp > 512 || k == 0 || k > 16 || k > n_exp {
        return Err(bad(
            kn,
            format!("{n_exp} experts / top-{k}: the kernels take up to 512 experts, k in 1..=16"),
        ));
    }
    need(kn, "logits", logits, nt * n_exp * 4)?;
    need(kn, "ids", ids, nt * k * 4)?;
    need(kn, "weights", wts, nt * k * 4)?;
    let params = [u32_of(kn, n_exp)?, u32_of(kn, k)?, u32_of(kn, nt)?];
    let bufs = [logits, ids, wts];
    let groups = (u32_of(kn, nt)?, 1, 1);
    let l = if optimized(kn, variant)? {
        let spec = shaders::spec_route(n_exp, k);
        g.launch("route", "route_opt", &spec, &params, &bufs, groups)?
    } else {
        g.launch("route", "route_base", &[], &params, &bufs, groups)?
    };
    Ok(vec![l])
}

/// The slop tables and one step's banned ids on the device (layout: `shaders/slop.wgsl`).
pub struct SlopDev {
    pub ints: Buf,
    pub flts: Buf,
    params: Vec<u32>,
}

impl SlopDev {
    /// Uploads validated tables (`nv`: the draft vocabulary of the logits) and `banned`.
    pub fn upload(
        g: &Wgpu,
        t: &SlopTables,
        nv: usize,
        banned: &[i32],
    ) -> Result<SlopDev, WgpuError> {
        let k = "slop_pen";
        t.validate(nv)?;
        if let Some(b) = banned
            .iter()
            .find(|&&b| b < 0 || b as usize >= t.inverse.len())
        {
            return Err(bad(
                k,
                format!("banned token {b} is outside the vocabulary"),
            ));
        }
        let mut ints = t.inverse.clone();
        let off = |v: &[i32], ints: &mut Vec<i32>| -> Result<u32, WgpuError> {
            let o = u32_of(k, ints.len())?;
            ints.extend_from_slice(v);
            Ok(o)
        };
        let o_pen = off(&t.pen_ids, &mut ints)?;
        let o_nl = off(&t.newline, &mut ints)?;
        let o_bl = off(&t.blank, &mut ints)?;
        let o_pt = off(&t.phrase_tokens, &mut ints)?;
        let o_ps = off(&t.phrase_start, &mut ints)?;
        let o_ban = off(banned, &mut ints)?;
        let mut flts = t.pen_vals.clone();
        let o_pp = u32_of(k, flts.len())?;
        flts.extend_from_slice(&t.phrase_pen);
        let params = vec![
            u32_of(k, nv)?,
            0,
            0,
            u32_of(k, t.pen_ids.len())?,
            u32_of(k, t.newline.len())?,
            u32_of(k, t.blank.len())?,
            u32_of(k, t.n_phrases())?,
            u32_of(k, banned.len())?,
            t.cap_newline as u32,
            t.cap_blank as u32,
            o_pen,
            o_nl,
            o_bl,
            o_pt,
            o_ps,
            o_ban,
            o_pp,
            u32_of(k, t.inverse.len())?,
        ];
        Ok(SlopDev {
            ints: g.upload("slop ints", &ints)?,
            flts: g.upload("slop floats", &flts)?,
            params,
        })
    }
}

/// `slop_pen` on `nv` draft logits in place; the state arrays hold [`STATE_LEN`] values
/// (`st_in` validated by the caller, as `SlopTables::validate_state` does on the CPU).
#[allow(clippy::too_many_arguments)]
pub fn slop_pen(
    g: &Wgpu,
    variant: &str,
    t: &SlopDev,
    logits: &Buf,
    nv: usize,
    mode: u32,
    prev: i32,
    st_in: &Buf,
    st_out: &Buf,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "slop_pen";
    if mode > 2 {
        return Err(bad(k, format!("mode {mode}, expected 0, 1 or 2")));
    }
    if nv as u32 != t.params[0] {
        return Err(bad(
            k,
            format!("{nv} logits, the tables were uploaded for {}", t.params[0]),
        ));
    }
    if prev < -1 || prev >= t.params[17] as i32 {
        return Err(bad(
            k,
            format!("previous token {prev} is outside the vocabulary"),
        ));
    }
    need(k, "logits", logits, nv * 4)?;
    need(k, "state in", st_in, STATE_LEN * 4)?;
    need(k, "state out", st_out, STATE_LEN * 4)?;
    let mut params = t.params.clone();
    params[1] = mode;
    params[2] = prev as u32;
    let bufs = [logits, &t.ints, &t.flts, st_in, st_out];
    let entry = if optimized(k, variant)? {
        "slop_pen_opt"
    } else {
        "slop_pen_base"
    };
    Ok(vec![g.launch(
        "slop",
        entry,
        &[],
        &params,
        &bufs,
        (1, 1, 1),
    )?])
}

/// Partials of the optimized pick (4 values an invocation, 256 a workgroup).
pub fn pick_partials(nv: usize) -> usize {
    nv.div_ceil(1024).clamp(1, 1024)
}

/// `pick` over `nv` logits: `out` gets (index, token, value bits). `part`: 2 ·
/// [`pick_partials`] u32.
pub fn pick(
    g: &Wgpu,
    variant: &str,
    logits: &Buf,
    draft_ids: &Buf,
    nv: usize,
    out: &Buf,
    part: &Buf,
) -> Result<Vec<Launch>, WgpuError> {
    let k = "pick";
    if nv == 0 || nv >= u32::MAX as usize {
        return Err(bad(k, format!("{nv} values")));
    }
    need(k, "logits", logits, nv * 4)?;
    need(k, "draft ids", draft_ids, nv * 4)?;
    need(k, "out", out, 12)?;
    let parts = pick_partials(nv);
    need(k, "partials", part, parts * 8)?;
    let params = [u32_of(k, nv)?, u32_of(k, parts)?];
    let bufs = [logits, draft_ids, out, part];
    if optimized(k, variant)? {
        Ok(vec![
            g.launch(
                "pick",
                "pick_opt1",
                &[],
                &params,
                &bufs,
                (parts as u32, 1, 1),
            )?,
            g.launch("pick", "pick_opt2", &[], &params, &bufs, (1, 1, 1))?,
        ])
    } else {
        Ok(vec![g.launch(
            "pick",
            "pick_base",
            &[],
            &params,
            &bufs,
            (1, 1, 1),
        )?])
    }
}
