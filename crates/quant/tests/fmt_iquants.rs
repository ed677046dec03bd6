//! The I-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS) against ggml's
//! own test vectors: bit-exact dequantization, dot products within 1e-5 of the float64
//! reference on every ISA this CPU has, and SIMD kernels bitwise equal to the scalar reference.

mod common;

use common::{assert_bits_eq, Vectors};
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

/// The types that have their own AVX2 and AVX-512 kernels (all of them).
const SIMD_TYPES: [GgmlType; 8] = [
    GgmlType::IQ1_S,
    GgmlType::IQ2_XXS,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ1_M,
];

#[test]
fn dequantize_matches_ggml() {
    for ty in TYPES {
        let v = Vectors::load(ty);
        for (blocks, deq) in [("blocks_raw", "deq_raw"), ("blocks_q", "deq_q")] {
            let want = v.f32s(deq);
            assert!(!want.is_empty(), "{ty}: empty {deq}");
            let mut got = vec![0f32; want.len()];
            strata_quant::dequantize(ty, v.bytes(blocks), &mut got).expect("dequantize");
            assert_bits_eq(&format!("{ty} {deq}"), &got, &want);
        }
    }
}

/// The dot products on ggml's own Q8_K activation bytes (`dot_xq`), so this does not depend on
/// our Q8_K quantizer: within 1e-5 of `dot_ref`, and every ISA bitwise equal to the scalar one.
#[test]
fn dot_matches_reference_on_ggml_activations() {
    for ty in TYPES {
        let v = Vectors::load(ty);
        let n = v.f32s("dot_x").len();
        let rb = ty.row_bytes(n).expect("whole blocks");
        let xq = v.bytes("dot_xq");
        let w = v.bytes("dot_w");
        let want = v.f64s("dot_ref");
        let ggml = v.f32s("dot_out");
        assert_eq!(w.len(), want.len() * rb, "{ty}: dot_w size");
        for r in 0..want.len() {
            let row = &w[r * rb..(r + 1) * rb];
            let scalar = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, row, xq).expect("dot");
            let rel = (scalar as f64 - want[r]).abs() / want[r].abs().max(1e-30);
            assert!(
                rel <= 1e-5,
                "{ty} row {r}: got {scalar:e}, dot_ref {:e} (ggml {:e}), rel {rel:e}",
                want[r],
                ggml[r]
            );
            for isa in [Isa::Avx2, Isa::Avx512] {
                if !strata_quant::simd::supported(isa) {
                    eprintln!("{ty}: {} not supported on this CPU, skipped", isa.name());
                    continue;
                }
                let got = strata_quant::vec_dot_isa(ty, isa, n, row, xq).expect("dot");
                assert_eq!(
                    got.to_bits(),
                    scalar.to_bits(),
                    "{ty} row {r} {}: {got:e} != scalar {scalar:e}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn simd_kernels_exist() {
    for ty in SIMD_TYPES {
        for isa in [Isa::Avx2, Isa::Avx512] {
            if strata_quant::simd::supported(isa) {
                assert!(
                    strata_quant::has_simd_dot(ty, isa),
                    "{ty}: no {} kernel",
                    isa.name()
                );
            }
        }
    }
}

/// The full standard check, including the crate's Q8_K quantizer on `dot_x` (its bytes must be
/// ggml's `dot_xq`).
#[test]
fn check_type_with_q8k_quantizer() {
    for ty in TYPES {
        common::check_type(ty, false, 1e-5);
    }
}

#[test]
fn rejects_wrong_lengths() {
    for ty in TYPES {
        let ts = ty.type_size();
        let mut y = vec![0f32; 256];
        assert!(strata_quant::dequantize(ty, &vec![0u8; ts + 1], &mut y).is_err());
        let x = vec![0u8; 292];
        assert!(strata_quant::vec_dot(ty, 256, &vec![0u8; ts - 1], &x).is_err());
        assert!(strata_quant::vec_dot(ty, 256, &vec![0u8; ts], &x[..291]).is_err());
        assert!(strata_quant::vec_dot(ty, 255, &vec![0u8; ts], &x).is_err());
    }
}
