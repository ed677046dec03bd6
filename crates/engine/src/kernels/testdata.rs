//! Random kernel inputs for the parity tests and the harness: floats that include −0.0,
//! denormals and large magnitudes (DESIGN.md §3, determinism 3), valid weight blocks, and the
//! table shapes of the slop-penalty and pick kernels. Deterministic per seed.

use strata_quant::synth::SplitMix64;

/// A seeded generator.
#[derive(Clone, Debug)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64(
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED,
        ))
    }

    pub fn u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.u64() >> 11) % n.max(1) as u64) as usize
    }

    pub fn unit(&mut self) -> f32 {
        self.0.next_f32()
    }

    pub fn normal(&mut self) -> f32 {
        self.0.next_normal()
    }

    /// A float of scale `scale`, or, one time in 64, a special: ±0.0, a denormal, or a large
    /// magnitude (2^20..2^40, squares stay finite).
    pub fn f32_special(&mut self, scale: f32) -> f32 {
        let r = self.u64();
        if r & 63 != 0 {
            return self.normal() * scale;
        }
        let sign = if r & 64 != 0 { -1.0f32 } else { 1.0 };
        match (r >> 7) % 4 {
            0 => -0.0,
            1 => 0.0,
            2 => sign * f32::from_bits(1 + (self.u64() as u32 & 0x007f_fffe)),
            _ => sign * (2f32).powf(20.0 + 20.0 * self.unit()),
        }
    }

    pub fn f32_vec_special(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32_special(scale)).collect()
    }

    /// Plain normal values (no specials), e.g. norm weights.
    pub fn f32_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }

    /// `n` distinct values in `0..range` (n ≤ range), in random order.
    pub fn distinct(&mut self, n: usize, range: usize) -> Vec<i32> {
        let mut seen = std::collections::HashSet::with_capacity(n);
        let mut out = Vec::with_capacity(n);
        while out.len() < n.min(range) {
            let v = self.below(range) as i32;
            if seen.insert(v) {
                out.push(v);
            }
        }
        out
    }
}

/// `n_blocks` random valid blocks of `ty` (finite, modest scales), from `strata_quant::synth`.
pub fn weight_blocks(ty: strata_quant::GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
    strata_quant::synth::random_blocks(ty, n_blocks, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specials_appear() {
        let mut r = Rng::new(1);
        let v = r.f32_vec_special(100_000, 1.0);
        assert!(v.iter().any(|x| x.to_bits() == 0x8000_0000));
        assert!(v.iter().any(|x| x.is_subnormal()));
        assert!(v.iter().any(|x| x.abs() > 1e6));
        assert!(v.iter().all(|x| x.is_finite()));
        let d = r.distinct(100, 1000);
        let s: std::collections::HashSet<_> = d.iter().collect();
        assert_eq!(s.len(), 100);
    }
}
