//! Random but valid blocks of any type, for benchmarks and synthetic models (DESIGN.md §7).
//! Every scale field holds a finite value of modest magnitude, so timings never hit NaN or
//! denormal slow paths, and the values resemble real weights.

use crate::dot::f32_to_f16;
use crate::GgmlType;

/// A small deterministic generator (splitmix64), so benchmarks and synthetic files are
/// reproducible without a dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Approximately normal(0, 1) (sum of four uniforms, rescaled).
    pub fn next_normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.next_f32()).sum::<f32>() - 2.0;
        s * 1.732_050_8
    }

    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Byte offsets of the f16 scale fields inside one block of `ty`.
fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | Q1_0 | Q2_0 => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ4_XS => &[0],
        TQ1_0 => &[52],
        TQ2_0 => &[64],
        _ => &[],
    }
}

/// `n_blocks` random valid blocks of `ty` (for scalar types: `n_blocks` random finite values).
pub fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64(seed ^ (ty.id() as u64) << 32);
    let ts = ty.type_size();
    let mut out = vec![0u8; n_blocks * ts];
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.next_normal().to_le_bytes());
            }
            return out;
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_f16(rng.next_normal()).to_le_bytes());
            }
            return out;
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                let b = (rng.next_normal().to_bits() >> 16) as u16;
                c.copy_from_slice(&b.to_le_bytes());
            }
            return out;
        }
        _ => {}
    }
    rng.fill_bytes(&mut out);
    let offsets = f16_scale_offsets(ty);
    for block in out.chunks_exact_mut(ts) {
        for &o in offsets {
            // Scales of magnitude 2^-10 .. 2^-4, either sign: what real weights look like.
            let mag = (2f32).powf(-10.0 + 6.0 * rng.next_f32());
            let s = if rng.next_u64() & 1 == 0 { mag } else { -mag };
            block[o..o + 2].copy_from_slice(&f32_to_f16(s).to_le_bytes());
        }
        match ty {
            // IQ1_M: the f16 scale is assembled from the top nibbles of the four u16 scale
            // words (bytes 48..56); pin its exponent nibble to a small finite range.
            GgmlType::IQ1_M => {
                block[55] = (block[55] & 0x0F) | 0x10;
            }
            // MXFP4: E8M0 exponent, keep 2^(e-128) moderate.
            GgmlType::MXFP4 => block[0] = 118 + (block[0] % 8),
            // NVFP4: four UE4M3 sub-scales; keep them finite (0x7F is NaN) and moderate.
            GgmlType::NVFP4 => {
                for b in &mut block[..4] {
                    *b = 0x20 + (*b % 0x30);
                }
            }
            // Q8_K (activation type): f32 d then 256 i8 and 16 i16 group sums.
            GgmlType::Q8_K => {
                let d = (2f32).powf(-10.0 + 6.0 * rng.next_f32());
                block[0..4].copy_from_slice(&d.to_le_bytes());
                for g in 0..16 {
                    let s: i16 = block[4 + 16 * g..4 + 16 * (g + 1)]
                        .iter()
                        .map(|&q| q as i8 as i16)
                        .sum();
                    block[260 + 2 * g..262 + 2 * g].copy_from_slice(&s.to_le_bytes());
                }
            }
            _ => {}
        }
    }
    out
}

/// A random activation row of `n` values, quantized to `ty` (an activation type) when it is
/// quantized, as it would reach a dot product.
pub fn random_activation(ty: GgmlType, n: usize, seed: u64) -> Result<Vec<u8>, crate::QuantError> {
    let mut rng = SplitMix64(seed);
    let x: Vec<f32> = (0..n).map(|_| rng.next_normal()).collect();
    let bytes = ty.row_bytes(n).ok_or(crate::QuantError::NotWholeBlocks {
        ty,
        n,
        block: ty.block_size(),
    })?;
    let mut out = vec![0u8; bytes];
    crate::quantize(ty, &x, &mut out)?;
    Ok(out)
}
