//! Random blocks per ggml type, with every scale field a finite normal f16 chosen so the
//! dequantized weights have a standard deviation of about 0.01–0.03 (the Python reference
//! writer's ranges), so activations stay bounded through 48 layers and no timing meets a NaN or
//! denormal path. Also the small per-tensor values (norm gammas, `ssm_a`, dt bias, conv taps).

use strata_quant::synth::SplitMix64;
use strata_quant::GgmlType;

use crate::plan::Fill;
use crate::{Result, SynthError};

/// The generator behind every random byte (splitmix64: reproducible, no dependency).
pub type BlockRng = SplitMix64;

fn f16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

fn uniform(rng: &mut BlockRng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * rng.next_f32()
}

/// Packs 8 six-bit scales and 8 six-bit mins into the 12-byte Q4_K/Q5_K layout (ggml's
/// `get_scale_min_k4` read backwards).
fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
}

/// `n_blocks` random blocks of `ty` (for F32/F16/BF16: `n_blocks` values of N(0, 0.02)).
pub fn random_pool(ty: GgmlType, n_blocks: usize, seed: u64) -> Result<Vec<u8>> {
    use GgmlType::*;
    let mut rng = SplitMix64(seed ^ (u64::from(ty.id()) << 40) ^ 0x5EED_0000);
    let bs = ty.type_size();
    let mut out = vec![0u8; n_blocks * bs];
    match ty {
        F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&(0.02f32 * rng.next_normal()).to_le_bytes());
            }
            return Ok(out);
        }
        F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(0.02f32 * rng.next_normal()));
            }
            return Ok(out);
        }
        BF16 => {
            for c in out.chunks_exact_mut(2) {
                let b = ((0.02f32 * rng.next_normal()).to_bits() >> 16) as u16;
                c.copy_from_slice(&b.to_le_bytes());
            }
            return Ok(out);
        }
        Q2_0 | Q8_0 | IQ4_NL | Q4_K | Q5_K | Q3_K | Q6_K | IQ4_XS => {}
        other => return Err(SynthError::Type(other)),
    }
    rng.fill_bytes(&mut out);
    for b in out.chunks_exact_mut(bs) {
        match ty {
            // {f16 d; u8 qs[16]}: value (code − 1)·d; code 3 (+2d) becomes 1 (0), so the
            // weights are a symmetric {−d, 0, +d}.
            Q2_0 => {
                b[0..2].copy_from_slice(&f16(uniform(&mut rng, 5e-3, 1.5e-2)));
                for q in &mut b[2..18] {
                    let both = (*q & 0xAA) & ((*q & 0x55) << 1);
                    *q &= !both;
                }
            }
            // {f16 d; codes}: |code| ≤ 127 (Q8_0) or a table value ≤ 127 (IQ4_NL).
            Q8_0 | IQ4_NL => b[0..2].copy_from_slice(&f16(uniform(&mut rng, 1e-4, 2e-4))),
            // {f16 d, dmin; scales[12]; ...}: d·sc·q − dmin·m with m = sc and dmin = d·mean(q),
            // so every sub-block is d·sc·(q − mean): zero mean.
            Q4_K | Q5_K => {
                let (mean_q, lo, hi) = if ty == Q4_K {
                    (7.5, 8, 64)
                } else {
                    (15.5, 4, 32)
                };
                let d = uniform(&mut rng, 6.5e-5, 1.2e-4);
                let mut sc = [0u8; 8];
                for s in &mut sc {
                    *s = lo + (rng.next_u64() % (hi - lo) as u64) as u8;
                }
                b[0..2].copy_from_slice(&f16(d));
                b[2..4].copy_from_slice(&f16(d * mean_q));
                pack_k4_scales(&sc, &sc, &mut b[4..16]);
            }
            // {hmask[32]; qs[64]; scales[12]; f16 d}: d·(sc − 32)·q3, any 6-bit scale.
            Q3_K => b[108..110].copy_from_slice(&f16(uniform(&mut rng, 2e-4, 4e-4))),
            // {ql[128]; qh[64]; i8 scales[16]; f16 d}: d·sc·(q − 32), scales 1..8.
            Q6_K => {
                for s in &mut b[192..208] {
                    *s = 1 + (rng.next_u64() % 8) as u8;
                }
                b[208..210].copy_from_slice(&f16(uniform(&mut rng, 6.5e-5, 1.2e-4)));
            }
            // {f16 d; u16 scales_h; u8 scales_l[4]; qs[128]}: d·(ls − 32)·kvalue; high bits 2
            // and low nibbles 1..4 give ls − 32 in 1..4.
            IQ4_XS => {
                b[0..2].copy_from_slice(&f16(uniform(&mut rng, 6.5e-5, 1.2e-4)));
                b[2] = 0xAA;
                b[3] = 0xAA;
                for r in &mut b[4..8] {
                    *r = ((*r & 3) + 1) | ((((*r >> 4) & 3) + 1) << 4);
                }
            }
            _ => unreachable!("filtered above"),
        }
    }
    Ok(out)
}

/// The values of a small tensor (norms, `ssm_a`, dt bias, conv taps), as f32.
pub fn small_values(fill: Fill, n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| match fill {
            // The converter folds 1 + w into the stored gamma.
            Fill::Norm => 1.0 + 0.02 * rng.next_normal(),
            // −exp(A_log), A_log uniform in log(1..16): a negative decay, a bounded recurrence.
            Fill::SsmA => -(uniform(&mut rng, 0.0, 16f32.ln())).exp(),
            // softplus(−4..−1) = 0.018..0.31.
            Fill::DtBias => uniform(&mut rng, -4.0, -1.0),
            Fill::Conv => 0.2 * rng.next_normal(),
            Fill::Pool => 0.02 * rng.next_normal(),
        })
        .collect()
}

/// `values` encoded as `ty` (F32, F16 or BF16: the only types small tensors use).
pub(crate) fn encode_small(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(values.len() * ty.type_size());
    for &v in values {
        match ty {
            GgmlType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            GgmlType::F16 => out.extend_from_slice(&f16(v)),
            GgmlType::BF16 => out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
            other => return Err(SynthError::Type(other)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pool type dequantizes (through strata-quant, an independent decoder) to finite
    /// values of the intended spread, and its f16 scales are normal numbers.
    #[test]
    fn pools_dequantize_to_finite_weights_of_modest_spread() {
        use GgmlType::*;
        for ty in [
            Q2_0, Q8_0, IQ4_NL, Q4_K, Q5_K, Q3_K, Q6_K, IQ4_XS, BF16, F16, F32,
        ] {
            let blocks = 4096 * 32 / ty.block_size();
            let pool = random_pool(ty, blocks, 7).unwrap();
            assert_eq!(pool.len(), blocks * ty.type_size());
            let mut v = vec![0f32; blocks * ty.block_size()];
            strata_quant::dequantize(ty, &pool, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{ty}: non-finite value");
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(
                (0.004..0.05).contains(&sd) && mean.abs() < 0.1 * sd.max(1e-3) + 2e-3,
                "{ty}: mean {mean:.5} sd {sd:.5}"
            );
        }
    }

    #[test]
    fn scales_are_normal_f16() {
        use GgmlType::*;
        let offs: [(GgmlType, &[usize]); 8] = [
            (Q2_0, &[0]),
            (Q8_0, &[0]),
            (IQ4_NL, &[0]),
            (Q4_K, &[0, 2]),
            (Q5_K, &[0, 2]),
            (Q3_K, &[108]),
            (Q6_K, &[208]),
            (IQ4_XS, &[0]),
        ];
        for (ty, offsets) in offs {
            let pool = random_pool(ty, 2000, 3).unwrap();
            for b in pool.chunks_exact(ty.type_size()) {
                for &o in offsets {
                    let h = half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]]));
                    assert!(h.is_normal() && h.to_f32() > 0.0, "{ty}: scale {h}");
                }
            }
        }
    }

    #[test]
    fn small_values_follow_their_roles() {
        let g = small_values(Fill::Norm, 10_000, 1);
        let mean = g.iter().sum::<f32>() / g.len() as f32;
        assert!((mean - 1.0).abs() < 0.002, "{mean}");
        assert!(g.iter().all(|&x| (0.85..1.15).contains(&x)));
        let a = small_values(Fill::SsmA, 1000, 2);
        assert!(
            a.iter().all(|&x| (-16.0..=-1.0).contains(&x)),
            "ssm_a must be negative"
        );
        let dt = small_values(Fill::DtBias, 1000, 3);
        assert!(dt.iter().all(|&x| (-4.0..=-1.0).contains(&x)));
    }

    #[test]
    fn unsupported_type_is_an_error() {
        assert!(matches!(
            random_pool(GgmlType::Q4_0, 4, 1),
            Err(SynthError::Type(GgmlType::Q4_0))
        ));
    }
}
