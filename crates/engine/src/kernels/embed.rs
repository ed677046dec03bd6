//! `embed`: embedding rows of token ids, dequantized from the table's format (the report's
//! `mtp_embed<F>`, DESIGN.md §4). The baseline decodes the 13 report formats block by block
//! with [`dequant_block`], a plain transcription of ggml's dequantizers that the CUDA kernels
//! mirror operation for operation (products `(d·s)·q` then `− m`, never fused); the optimized
//! variant goes through `strata_quant::dequantize`, the tuned and fixture-tested row
//! dequantizers. Both give the same bits.

use strata_quant::dot::{le_f16, le_u16, le_u32};
use strata_quant::grids::{IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use strata_quant::GgmlType;

use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, invalid, KernelError};

/// The formats of the report's `mtp_embed` table, in its order.
pub const REPORT_FORMATS: [GgmlType; 13] = [
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::Q2_0,
    GgmlType::IQ3_S,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ3_XXS,
];

/// Gathers rows `ids` of `table` (rows of `row_len` elements of `ty`) into `out`
/// (`ids.len() · row_len` values).
pub type EmbedFn = fn(
    ty: GgmlType,
    table: &[u8],
    row_len: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError>;

fn embed_check(
    ty: GgmlType,
    table: &[u8],
    row_len: usize,
    ids: &[u32],
    out: &[f32],
) -> Result<usize, KernelError> {
    let rb = ty.row_bytes(row_len).filter(|&b| b > 0).ok_or_else(|| {
        invalid(
            "embed",
            format!("row length {row_len} is not a whole number of {ty} blocks"),
        )
    })?;
    if !table.len().is_multiple_of(rb) {
        return Err(invalid(
            "embed",
            format!(
                "table of {} bytes is not whole {ty} rows of {rb} bytes",
                table.len()
            ),
        ));
    }
    let rows = table.len() / rb;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= rows) {
        return Err(invalid(
            "embed",
            format!("token id {bad} is outside the table's {rows} rows"),
        ));
    }
    check_len("embed", "output", out.len(), ids.len() * row_len)?;
    Ok(rb)
}

pub fn embed_optimized(
    ty: GgmlType,
    table: &[u8],
    row_len: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let rb = embed_check(ty, table, row_len, ids, out)?;
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(row_len)) {
        let row = &table[id as usize * rb..(id as usize + 1) * rb];
        strata_quant::dequantize(ty, row, o).map_err(|source| KernelError::Quant {
            kernel: "embed",
            source,
        })?;
    }
    Ok(())
}

pub fn embed_baseline(
    ty: GgmlType,
    table: &[u8],
    row_len: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    if !REPORT_FORMATS.contains(&ty) {
        return embed_optimized(ty, table, row_len, ids, out);
    }
    let rb = embed_check(ty, table, row_len, ids, out)?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(row_len)) {
        let row = &table[id as usize * rb..(id as usize + 1) * rb];
        for (b, y) in row.chunks_exact(ts).zip(o.chunks_exact_mut(bs)) {
            dequant_block(ty, b, y);
        }
    }
    Ok(())
}

pub static EMBED: Op<EmbedFn> = Op {
    name: "embed",
    variants: &[
        Variant {
            name: BASELINE,
            f: embed_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: embed_optimized,
        },
    ],
};

/// Q4_K/Q5_K 6-bit (scale, min) of sub-block `j` (ggml's `get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q3_K scale `j` (0..16), minus 32.
#[inline]
pub fn scale_q3_k(j: usize, s: &[u8]) -> i32 {
    let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
    let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// Dequantizes one block of a report format (the unit decoders the CUDA kernels mirror).
pub fn dequant_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    use GgmlType::*;
    match ty {
        BF16 => y[0] = f32::from_bits((le_u16(b, 0) as u32) << 16),
        Q8_0 => {
            let d = le_f16(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        Q4_0 => {
            let d = le_f16(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        Q5_0 => {
            let d = le_f16(b, 0);
            let qh = le_u32(b, 2);
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = (((b[6 + j] & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                y[j + 16] = (((b[6 + j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        IQ4_NL => {
            let d = le_f16(b, 0);
            for j in 0..16 {
                y[j] = d * KVALUES_IQ4NL[(b[2 + j] & 0xF) as usize] as f32;
                y[j + 16] = d * KVALUES_IQ4NL[(b[2 + j] >> 4) as usize] as f32;
            }
        }
        Q2_0 => {
            let d = le_f16(b, 0);
            for j in 0..64 {
                let c = (b[2 + j / 4] >> (2 * (j % 4))) & 3;
                y[j] = (c as i32 - 1) as f32 * d;
            }
        }
        IQ4_XS => {
            let d = le_f16(b, 0);
            let sh = le_u16(b, 2);
            for ib in 0..8 {
                let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
                let ls = (lo as i32 | ((((sh >> (2 * ib)) & 3) as i32) << 4)) - 32;
                let dl = d * ls as f32;
                for j in 0..16 {
                    let q = b[8 + 16 * ib + j];
                    y[32 * ib + j] = dl * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
                    y[32 * ib + j + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
                }
            }
        }
        IQ3_S => {
            let d = le_f16(b, 0);
            for ib in 0..8 {
                let s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF;
                let db = d * (1 + 2 * s as i32) as f32;
                let h = b[66 + ib] as usize;
                for l in 0..4 {
                    let i1 = b[2 + 8 * ib + 2 * l] as usize | ((h << (8 - 2 * l)) & 256);
                    let i2 = b[2 + 8 * ib + 2 * l + 1] as usize | ((h << (7 - 2 * l)) & 256);
                    let signs = b[74 + 4 * ib + l];
                    for (k, g) in [IQ3S_GRID[i1], IQ3S_GRID[i2]].into_iter().enumerate() {
                        for j in 0..4 {
                            let m = (g >> (8 * j)) & 0xFF;
                            let neg = signs & (1 << (4 * k + j)) != 0;
                            let v = if neg { -(m as i32) } else { m as i32 };
                            y[32 * ib + 8 * l + 4 * k + j] = db * v as f32;
                        }
                    }
                }
            }
        }
        IQ3_XXS => {
            let d = le_f16(b, 0);
            for ib in 0..8 {
                let a = le_u32(b, 66 + 4 * ib);
                let db = d * (0.5 + (a >> 28) as f32) * 0.5;
                for l in 0..4 {
                    let signs = KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize];
                    let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize];
                    let g2 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l + 1] as usize];
                    for (k, g) in [g1, g2].into_iter().enumerate() {
                        for j in 0..4 {
                            let m = (g >> (8 * j)) & 0xFF;
                            let neg = signs & (1 << (4 * k + j)) != 0;
                            let v = if neg { -(m as i32) } else { m as i32 };
                            y[32 * ib + 8 * l + 4 * k + j] = db * v as f32;
                        }
                    }
                }
            }
        }
        Q3_K => {
            let d = le_f16(b, 108);
            for s in 0..16 {
                let dl = d * scale_q3_k(s, &b[96..108]) as f32;
                let (half, j, h) = (s / 8, (s / 2) % 4, s % 2);
                let bit = 1u8 << (4 * half + j);
                for l in 0..16 {
                    let q = b[32 + 32 * half + 16 * h + l];
                    let hm = b[16 * h + l];
                    let v = ((q >> (2 * j)) & 3) as i32 - if hm & bit != 0 { 0 } else { 4 };
                    y[16 * s + l] = dl * v as f32;
                }
            }
        }
        Q4_K | Q5_K => {
            let d = le_f16(b, 0);
            let dmin = le_f16(b, 2);
            let q5 = ty == Q5_K;
            let qs0 = if q5 { 48 } else { 16 };
            for s in 0..8 {
                let (sc, m) = scale_min_k4(s, &b[4..16]);
                let dl = d * sc as f32;
                let ml = dmin * m as f32;
                for l in 0..32 {
                    let mut v = (b[qs0 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
                    if q5 {
                        v |= ((b[16 + l] >> s) & 1) << 4;
                    }
                    y[32 * s + l] = dl * v as f32 - ml;
                }
            }
        }
        Q6_K => {
            let d = le_f16(b, 208);
            for e in 0..256 {
                let (half, r) = (e / 128, e % 128);
                let (quarter, l) = (r / 32, r % 32);
                let ql = b[64 * half + 32 * (quarter % 2) + l];
                let lo = if quarter < 2 { ql & 0xF } else { ql >> 4 };
                let hi = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
                let sc = b[192 + e / 16] as i8;
                y[e] = d * sc as f32 * ((lo | (hi << 4)) as i32 - 32) as f32;
            }
        }
        // Only reached for report formats (checked by the caller).
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::{weight_blocks, Rng};

    #[test]
    fn variants_bitwise_for_every_report_format() {
        let mut rng = Rng::new(21);
        let row_len = 2560;
        let rows = 40;
        for (k, &ty) in REPORT_FORMATS.iter().enumerate() {
            let nb = rows * row_len / ty.block_size();
            let table = weight_blocks(ty, nb, 100 + k as u64);
            let ids: Vec<u32> = (0..5).map(|_| rng.below(rows) as u32).collect();
            let mut a = vec![0f32; ids.len() * row_len];
            let mut b = vec![1f32; ids.len() * row_len];
            embed_baseline(ty, &table, row_len, &ids, &mut a).unwrap();
            embed_optimized(ty, &table, row_len, &ids, &mut b).unwrap();
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(x.to_bits(), y.to_bits(), "{ty} element {i}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn rejects_bad_ids_and_shapes() {
        let table = weight_blocks(GgmlType::Q8_0, 80 * 2, 1);
        let mut out = vec![0f32; 2560];
        assert!(embed_optimized(GgmlType::Q8_0, &table, 2560, &[2], &mut out).is_err());
        assert!(embed_optimized(GgmlType::Q8_0, &table, 2560, &[1], &mut out).is_ok());
        assert!(embed_baseline(GgmlType::Q8_0, &table, 2500, &[0], &mut out).is_err());
        assert!(embed_baseline(GgmlType::Q8_0, &table[..100], 2560, &[0], &mut out).is_err());
    }
}
