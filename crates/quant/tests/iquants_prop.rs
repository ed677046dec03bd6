//! Property tests for the I-quant dot products: on random blocks (random bytes, finite f16
//! scales) and random Q8_K rows (codes in −127..=127, consistent group sums), every ISA's kernel
//! gives the same bits as the scalar reference, and the reference is close to a float64 dot of
//! the dequantized rows.

use proptest::prelude::*;
use strata_quant::{GgmlType, Isa};

const TYPES: [GgmlType; 8] = [
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_XS,
];

/// A finite f16 of magnitude 2^-14..2^1 with either sign.
fn f16_bits(r: u16) -> u16 {
    let exp = 1 + (r >> 10) % 16; // biased exponent 1..=16
    (r & 0x8000) | (exp << 10) | (r & 0x3ff)
}

/// Overwrite the block's f16 super-scale with a finite value.
fn set_scale(ty: GgmlType, block: &mut [u8], r: u16) {
    let bits = f16_bits(r);
    if ty == GgmlType::IQ1_M {
        // The scale's four nibbles sit in the top 4 bits of the four u16 scale words.
        for k in 0..4 {
            let o = 48 + 2 * k + 1;
            block[o] = (block[o] & 0x0f) | ((((bits >> (4 * k)) & 0xf) as u8) << 4);
        }
    } else {
        block[..2].copy_from_slice(&bits.to_le_bytes());
    }
}

/// A Q8_K row of `nb` blocks: f32 d, codes, and the 16 group sums.
fn q8k_row(d: &[f32], qs: &[i8]) -> Vec<u8> {
    let mut out = Vec::new();
    for (b, &db) in d.iter().enumerate() {
        out.extend_from_slice(&db.to_le_bytes());
        let q = &qs[256 * b..256 * (b + 1)];
        out.extend(q.iter().map(|&v| v as u8));
        for g in 0..16 {
            let s: i16 = q[16 * g..16 * (g + 1)].iter().map(|&v| v as i16).sum();
            out.extend_from_slice(&s.to_le_bytes());
        }
    }
    out
}

fn case() -> impl Strategy<Value = (GgmlType, usize, Vec<u8>, Vec<u16>, Vec<f32>, Vec<i8>)> {
    (0..TYPES.len(), 1usize..=4).prop_flat_map(|(t, nb)| {
        let ty = TYPES[t];
        (
            Just(ty),
            Just(nb),
            proptest::collection::vec(any::<u8>(), nb * ty.type_size()),
            proptest::collection::vec(any::<u16>(), nb),
            proptest::collection::vec(prop_oneof![1e-4f32..1.0f32, -1.0f32..-1e-4f32], nb),
            proptest::collection::vec(-127i8..=127, nb * 256),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn simd_bitwise_equal_to_scalar((ty, nb, mut w, scales, xd, xq) in case()) {
        let ts = ty.type_size();
        for (b, &r) in scales.iter().enumerate() {
            set_scale(ty, &mut w[b * ts..(b + 1) * ts], r);
        }
        let x = q8k_row(&xd, &xq);
        let n = 256 * nb;
        let scalar = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, &w, &x).unwrap();
        prop_assert!(scalar.is_finite());
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !strata_quant::simd::supported(isa) {
                continue;
            }
            let got = strata_quant::vec_dot_isa(ty, isa, n, &w, &x).unwrap();
            prop_assert_eq!(got.to_bits(), scalar.to_bits(), "{} {}: {:e} vs scalar {:e}", ty, isa.name(), got, scalar);
        }
        // The reference itself against a float64 dot of the dequantized operands.
        let mut wf = vec![0f32; n];
        strata_quant::dequantize(ty, &w, &mut wf).unwrap();
        let (mut exact, mut mag) = (0f64, 0f64);
        for (i, &wv) in wf.iter().enumerate() {
            let xv = xd[i / 256] as f64 * xq[i] as f64;
            exact += wv as f64 * xv;
            mag += (wv as f64 * xv).abs();
        }
        prop_assert!(
            (scalar as f64 - exact).abs() <= 1e-5 * mag.max(1e-30),
            "{}: scalar {:e}, f64 {:e} (sum of magnitudes {:e})", ty, scalar, exact, mag
        );
    }
}

/// Extreme codes: every Q8_K code ±127 against every weight byte pattern 0x00 and 0xff (the
/// largest scales and grid entries), all ISAs bitwise equal.
#[test]
fn extreme_codes_bitwise_equal() {
    for ty in TYPES {
        let ts = ty.type_size();
        for fill in [0x00u8, 0xff, 0x55, 0xaa] {
            for q in [127i8, -127] {
                let mut w = vec![fill; 2 * ts];
                set_scale(ty, &mut w[..ts], 0x3c00);
                set_scale(ty, &mut w[ts..], 0xbc00);
                let x = q8k_row(&[1.0, -0.5], &[q; 512]);
                let scalar = strata_quant::vec_dot_isa(ty, Isa::Scalar, 512, &w, &x).unwrap();
                for isa in [Isa::Avx2, Isa::Avx512] {
                    if strata_quant::simd::supported(isa) {
                        let got = strata_quant::vec_dot_isa(ty, isa, 512, &w, &x).unwrap();
                        assert_eq!(
                            got.to_bits(),
                            scalar.to_bits(),
                            "{ty} {} fill {fill:#x} q {q}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}
