//! The coverage contract: every ggml weight type 0–42 dequantizes and has a scalar
//! reference dot product; the activation quantizers exist; the required weight quantizers exist;
//! and the types the public Flash-Next releases use have AVX2 and AVX-512 kernels.

use strata_quant::{format_fns, has_simd_dot, simd, GgmlType, Isa};

const WEIGHT_TYPES: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0",
];

const RELEASE_TYPES: &[&str] = &[
    "Q2_0", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S",
    "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "BF16", "F16", "F32",
];

fn ty(name: &str) -> GgmlType {
    GgmlType::from_name(name).unwrap_or_else(|| panic!("{name} missing from the type table"))
}

#[test]
fn every_weight_type_dequantizes_and_dots() {
    for name in WEIGHT_TYPES {
        let f = format_fns(ty(name));
        assert!(f.dequantize.is_some(), "{name}: no dequantize");
        assert!(f.dot.is_some(), "{name}: no scalar reference dot");
    }
}

#[test]
fn quantizers_exist() {
    for name in [
        "Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "Q4_0", "Q4_K", "Q6_K", "Q2_0",
    ] {
        assert!(
            format_fns(ty(name)).quantize.is_some(),
            "{name}: no quantizer"
        );
    }
}

#[test]
fn release_types_have_simd_kernels() {
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !simd::supported(isa) {
            eprintln!(
                "{}: not supported by this CPU, coverage not checked",
                isa.name()
            );
            continue;
        }
        for name in RELEASE_TYPES {
            assert!(
                has_simd_dot(ty(name), isa),
                "{name}: no {} kernel",
                isa.name()
            );
        }
    }
}
