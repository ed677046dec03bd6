//! Matrix products on the CPU: quantize each activation row once to the weight's
//! `vec_dot_type` (FORMATS.md pairing), then one `DotFn` call per (output row, activation row).
//! Output rows are split across threads; each dot is computed whole by one thread, so the result
//! does not depend on the thread count or on how many activation rows share the call.

use rayon::prelude::*;
use strata_quant::{GgmlType, Isa};

use crate::error::{EngineError, Result};
use crate::kernels::embed::EmbedFn;
use crate::kernels::norm::{XprepFn, XprepPairFn};
use crate::kernels::registry::Chosen;
use crate::kernels::ActFmt;

/// Activation rows in a weight's paired format.
pub(crate) struct Prepared {
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub row_bytes: usize,
    pub bytes: Vec<u8>,
}

impl Prepared {
    /// The image of rows `rows` of these rows, in that order (a row's image depends on that
    /// row alone, so it equals quantizing the gathered f32 rows).
    pub fn gather(&self, rows: impl Iterator<Item = usize>) -> Prepared {
        let mut bytes = Vec::new();
        let mut n = 0;
        for r in rows {
            bytes.extend_from_slice(&self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes]);
            n += 1;
        }
        Prepared {
            ty: self.ty,
            k: self.k,
            n,
            row_bytes: self.row_bytes,
            bytes,
        }
    }
}

/// Quantize `n` rows of `k` f32 values to the activation type that `wty` pairs with: through
/// the catalogue's `xprep` in the variant the backend resolved (its `optimized` variant is the
/// best ISA's quantizer, bitwise the reference's) for the four catalogue formats, and through
/// the registry's `xprep_pair` for the pairings outside them (F16, Q8_1).
pub(crate) fn prepare(
    pair: &Chosen<XprepPairFn>,
    xprep: &Chosen<XprepFn>,
    wty: GgmlType,
    x: &[f32],
    k: usize,
    name: &str,
) -> Result<Prepared> {
    let xty = wty.vec_dot_type().ok_or_else(|| {
        EngineError::shape("matmul", format!("{name}: type {wty} has no dot product"))
    })?;
    let row_bytes = xty.row_bytes(k).ok_or_else(|| {
        EngineError::shape(
            "matmul",
            format!(
                "{name}: rows of {k} are not a whole number of {xty} blocks ({})",
                xty.block_size()
            ),
        )
    })?;
    if k == 0 || !x.len().is_multiple_of(k) {
        return Err(EngineError::shape(
            "matmul",
            format!("{name}: {} activations are not rows of {k}", x.len()),
        ));
    }
    let n = x.len() / k;
    let mut bytes = vec![0u8; n * row_bytes];
    if let Some(fmt) = ActFmt::for_weight(wty) {
        let f = xprep.get();
        // A few runs of whole rows per thread (one call per run, not per row).
        let per = n.div_ceil(4 * rayon::current_num_threads().max(1)).max(1);
        if n > per {
            x.par_chunks(per * k)
                .zip(bytes.par_chunks_mut(per * row_bytes))
                .try_for_each(|(src, dst)| f(src, k, fmt, dst))?;
        } else {
            f(x, k, fmt, &mut bytes)?;
        }
    } else {
        let f = pair.get();
        let per = n.div_ceil(4 * rayon::current_num_threads().max(1)).max(1);
        if n > per {
            x.par_chunks(per * k)
                .zip(bytes.par_chunks_mut(per * row_bytes))
                .try_for_each(|(src, dst)| f(xty, src, k, dst))?;
        } else {
            f(xty, x, k, &mut bytes)?;
        }
    }
    Ok(Prepared {
        ty: xty,
        k,
        n,
        row_bytes,
        bytes,
    })
}

/// `out[r][o] = dot(w row o, x row r)` for `m` weight rows of `k` elements in `w` (type `wty`).
pub(crate) fn matmul_prepared(
    isa: Isa,
    wty: GgmlType,
    w: &[u8],
    m: usize,
    x: &Prepared,
    name: &str,
) -> Result<Vec<f32>> {
    let k = x.k;
    let n = x.n;
    let dot = strata_quant::dot_fn(wty, isa)
        .ok_or_else(|| EngineError::shape("matmul", format!("{name}: no dot product for {wty}")))?;
    if wty.vec_dot_type() != Some(x.ty) {
        return Err(EngineError::shape(
            "matmul",
            format!(
                "{name}: activations prepared as {} for a {wty} weight",
                x.ty
            ),
        ));
    }
    let w_row = wty.row_bytes(k).ok_or_else(|| {
        EngineError::shape(
            "matmul",
            format!("{name}: rows of {k} are not whole {wty} blocks"),
        )
    })?;
    if w.len() < m * w_row {
        return Err(EngineError::shape(
            "matmul",
            format!(
                "{name}: {} bytes hold fewer than {m} rows of {w_row}",
                w.len()
            ),
        ));
    }
    let xr = x.row_bytes;
    let xb = &x.bytes;
    let xs: Vec<&[u8]> = xb.chunks_exact(xr.max(1)).take(n).collect();
    if n == 1 {
        // A decode step: one value per weight row, which is already the output's layout.
        // Keep each task above ~64k multiply-adds so small products do not drown in scheduling.
        let min_len = (65536 / k.max(1)).max(1);
        let mut out = vec![0f32; m];
        out.par_iter_mut()
            .with_min_len(min_len)
            .enumerate()
            .for_each(|(o, c)| *c = dot(k, &w[o * w_row..(o + 1) * w_row], xs[0]));
        return Ok(out);
    }
    // A prefill or verify window: tiles of weight rows, each against every activation row. A
    // multi-row kernel unpacks each weight block once for up to eight activation rows; its
    // results are bitwise those of the one-row kernel. Each tile is written row-major
    // (`[activation row][weight row]`), so the output is assembled by contiguous copies.
    let rows_fn = strata_quant::dot_rows_fn(wty, isa);
    let threads = rayon::current_num_threads().max(1);
    let tile = (m / (4 * threads)).clamp(8, 64);
    let tiles: Vec<Vec<f32>> = (0..m.div_ceil(tile))
        .into_par_iter()
        .map(|t| {
            let o0 = t * tile;
            let rows = tile.min(m - o0);
            let mut out = vec![0f32; n * rows];
            let mut part = [0f32; 8];
            for j in 0..rows {
                let o = o0 + j;
                let wr = &w[o * w_row..(o + 1) * w_row];
                match rows_fn {
                    // At most eight rows per call: the most any multi-row kernel takes.
                    Some(f) => {
                        for (c, xc) in xs.chunks(8).enumerate() {
                            let part = &mut part[..xc.len()];
                            f(k, wr, xc, part);
                            for (i, &v) in part.iter().enumerate() {
                                out[(8 * c + i) * rows + j] = v;
                            }
                        }
                    }
                    None => {
                        for (r, xr) in xs.iter().enumerate() {
                            out[r * rows + j] = dot(k, wr, xr);
                        }
                    }
                }
            }
            out
        })
        .collect();
    let mut out = vec![0f32; n * m];
    out.par_chunks_mut(m).enumerate().for_each(|(r, row)| {
        for (t, part) in tiles.iter().enumerate() {
            let rows = part.len() / n;
            row[t * tile..t * tile + rows].copy_from_slice(&part[r * rows..(r + 1) * rows]);
        }
    });
    Ok(out)
}

/// `out[r][o] = dot(w row o widened to f32, x row r in f32)` for float weights (F16/BF16): the
/// "exact" mode that skips activation rounding, to separate it from everything else in tests.
/// Weight rows are widened by `embed` (the catalogue's dequantizer in the backend's variant).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_widened(
    isa: Isa,
    embed: EmbedFn,
    wty: GgmlType,
    w: &[u8],
    m: usize,
    k: usize,
    x: &[f32],
    name: &str,
) -> Result<Vec<f32>> {
    let dot = strata_quant::dot_fn(GgmlType::F32, isa)
        .ok_or_else(|| EngineError::shape("matmul", format!("{name}: no f32 dot product")))?;
    let w_row = wty.row_bytes(k).ok_or_else(|| {
        EngineError::shape(
            "matmul",
            format!("{name}: rows of {k} are not whole {wty} blocks"),
        )
    })?;
    if k == 0 || !x.len().is_multiple_of(k) || w.len() < m * w_row {
        return Err(EngineError::shape(
            "matmul",
            format!(
                "{name}: {} activations in rows of {k}, {} weight bytes for {m} rows",
                x.len(),
                w.len()
            ),
        ));
    }
    let n = x.len() / k;
    let xb: &[u8] = bytemuck::cast_slice(x);
    let min_len = (65536 / (k * n).max(1)).max(1);
    let mut out_t = vec![0f32; m * n];
    out_t
        .par_chunks_mut(n)
        .with_min_len(min_len)
        .enumerate()
        .try_for_each(|(o, col)| -> Result<()> {
            let mut row = vec![0f32; k];
            embed(wty, &w[o * w_row..(o + 1) * w_row], k, &[0], &mut row)?;
            let rb: &[u8] = bytemuck::cast_slice(&row);
            for (r, c) in col.iter_mut().enumerate() {
                *c = dot(k, rb, &xb[r * k * 4..(r + 1) * k * 4]);
            }
            Ok(())
        })?;
    Ok(transpose(&out_t, m, n))
}

/// `out[r][i] = dot(w row rows[i], x row r)`: the products of chosen weight rows only (the draft
/// vocabulary's rows of the LM head). Each entry is the same dot call on the same bytes as the
/// full product's, so it equals that product's entry bit for bit. With f32 activations, float
/// weights are widened (by `embed`) and met by the f32 activations instead (the exact mode of
/// `matmul_widened`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_rows(
    isa: Isa,
    embed: EmbedFn,
    wty: GgmlType,
    w: &[u8],
    m: usize,
    rows: &[u32],
    x: &Prepared,
    name: &str,
) -> Result<Vec<f32>> {
    let (k, n) = (x.k, x.n);
    // f32 activations against a float weight: the widened (exact) mode.
    let widen = x.ty == GgmlType::F32 && wty != GgmlType::F32;
    let dot_ty = if widen { GgmlType::F32 } else { wty };
    let dot = strata_quant::dot_fn(dot_ty, isa)
        .ok_or_else(|| EngineError::shape("matmul_rows", format!("{name}: no dot product")))?;
    let expect_x = if widen {
        Some(GgmlType::F32)
    } else {
        wty.vec_dot_type()
    };
    if expect_x != Some(x.ty) {
        return Err(EngineError::shape(
            "matmul_rows",
            format!(
                "{name}: activations prepared as {} for a {wty} weight",
                x.ty
            ),
        ));
    }
    let w_row = wty.row_bytes(k).ok_or_else(|| {
        EngineError::shape(
            "matmul_rows",
            format!("{name}: rows of {k} are not whole {wty} blocks"),
        )
    })?;
    if w.len() < m * w_row {
        return Err(EngineError::shape(
            "matmul_rows",
            format!("{name}: {} bytes hold fewer than {m} rows", w.len()),
        ));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r as usize >= m) {
        return Err(EngineError::shape(
            "matmul_rows",
            format!("{name}: row {bad} asked of a matrix of {m} rows"),
        ));
    }
    let xr = x.row_bytes;
    let xb = &x.bytes;
    let min_len = (65536 / (k * n).max(1)).max(1);
    let mut out_t = vec![0f32; rows.len() * n];
    out_t
        .par_chunks_mut(n)
        .with_min_len(min_len)
        .zip(rows.par_iter())
        .try_for_each(|(col, &o)| -> Result<()> {
            let wr = &w[o as usize * w_row..(o as usize + 1) * w_row];
            if widen {
                let mut row = vec![0f32; k];
                embed(wty, wr, k, &[0], &mut row)?;
                let rb: &[u8] = bytemuck::cast_slice(&row);
                for (r, c) in col.iter_mut().enumerate() {
                    *c = dot(k, rb, &xb[r * xr..(r + 1) * xr]);
                }
            } else {
                for (r, c) in col.iter_mut().enumerate() {
                    *c = dot(k, wr, &xb[r * xr..(r + 1) * xr]);
                }
            }
            Ok(())
        })?;
    let nr = rows.len();
    let mut out = vec![0f32; n * nr];
    for o in 0..nr {
        for r in 0..n {
            out[r * nr + o] = out_t[o * n + r];
        }
    }
    Ok(out)
}

/// Activation rows kept in f32 (the widened path's operand), in [`Prepared`] form.
pub(crate) fn prepare_f32(x: &[f32], k: usize, name: &str) -> Result<Prepared> {
    if k == 0 || !x.len().is_multiple_of(k) {
        return Err(EngineError::shape(
            "matmul",
            format!("{name}: {} activations are not rows of {k}", x.len()),
        ));
    }
    Ok(Prepared {
        ty: GgmlType::F32,
        k,
        n: x.len() / k,
        row_bytes: k * 4,
        bytes: bytemuck::cast_slice(x).to_vec(),
    })
}

/// `[m][n]` → `[n][m]`, a block of output rows at a time, so that both sides stay in cache for
/// a long LM head (the naive loop writes with a stride of `m` floats).
fn transpose(src: &[f32], m: usize, n: usize) -> Vec<f32> {
    const TILE: usize = 64;
    let mut out = vec![0f32; n * m];
    if n == 0 {
        return out;
    }
    for (bi, block) in src.chunks(TILE * n).enumerate() {
        let o0 = bi * TILE;
        for (r, dst) in out.chunks_exact_mut(m).enumerate() {
            for (j, col) in block.chunks_exact(n).enumerate() {
                dst[o0 + j] = col[r];
            }
        }
    }
    out
}
