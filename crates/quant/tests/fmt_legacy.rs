//! Legacy block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL) against ggml's vectors.

mod common;

use common::{assert_bytes_eq, Vectors};
use strata_quant::legacy;
use strata_quant::GgmlType;

type RowQuant = fn(&[f32], &mut [u8]);

/// Both Q8_0 quantizers (reference and CPU activation path) reproduce every Q8_0 byte string in
/// the fixtures: the weight quantization `blocks_q` and the activation rows `dot_xq`.
#[test]
fn q8_0_quantizers_match_fixtures() {
    let cases: [(GgmlType, &str, &str); 4] = [
        (GgmlType::Q8_0, "source", "blocks_q"),
        (GgmlType::Q8_0, "dot_x", "dot_xq"),
        (GgmlType::Q4_0, "dot_x", "dot_xq"),
        (GgmlType::Q5_0, "dot_x", "dot_xq"),
    ];
    let quants: [(&str, RowQuant); 2] = [
        ("ref", legacy::quantize_row_q8_0_ref),
        ("act", legacy::quantize_row_q8_0_act),
    ];
    for (ty, src, want) in cases {
        let v = Vectors::load(ty);
        for (qname, q) in quants {
            let mut got = vec![0u8; v.bytes(want).len()];
            q(&v.f32s(src), &mut got);
            assert_bytes_eq(
                &format!("{ty} {want} via q8_0 {qname}"),
                &got,
                v.bytes(want),
                34,
            );
        }
    }
}

/// Both Q8_1 quantizers reproduce `blocks_q` of q8_1 and the Q8_1 activation rows of Q4_1/Q5_1.
#[test]
fn q8_1_quantizers_match_fixtures() {
    let cases: [(GgmlType, &str, &str); 3] = [
        (GgmlType::Q8_1, "source", "blocks_q"),
        (GgmlType::Q4_1, "dot_x", "dot_xq"),
        (GgmlType::Q5_1, "dot_x", "dot_xq"),
    ];
    let quants: [(&str, RowQuant); 2] = [
        ("ref", legacy::quantize_row_q8_1_ref),
        ("act", legacy::quantize_row_q8_1),
    ];
    for (ty, src, want) in cases {
        let v = Vectors::load(ty);
        for (qname, q) in quants {
            let mut got = vec![0u8; v.bytes(want).len()];
            q(&v.f32s(src), &mut got);
            assert_bytes_eq(
                &format!("{ty} {want} via q8_1 {qname}"),
                &got,
                v.bytes(want),
                36,
            );
        }
        let mut got = vec![0u8; v.bytes(want).len()];
        strata_quant::quantize(GgmlType::Q8_1, &v.f32s(src), &mut got).expect("quantize");
        assert_bytes_eq(
            &format!("{ty} {want} via quantize()"),
            &got,
            v.bytes(want),
            36,
        );
    }
}

/// Where the two Q8_0 quantizers part: an exact tie. With amax = 127 both scales are 1, and 0.5
/// rounds away from zero in the reference but to even (0) on ggml's AVX path; 1.5 and 2.5 go to
/// 2 on the AVX path, 2 and 3 in the reference.
#[test]
fn q8_0_tie_rounding_differs_between_paths() {
    let mut x = [0f32; 32];
    x[0] = 127.0;
    x[1] = 0.5;
    x[2] = 1.5;
    x[3] = 2.5;
    x[4] = -0.5;
    let mut r = [0u8; 34];
    let mut a = [0u8; 34];
    legacy::quantize_row_q8_0_ref(&x, &mut r);
    legacy::quantize_row_q8_0_act(&x, &mut a);
    assert_eq!(&r[2..7], &[127, 1, 2, 3, (-1i8) as u8]);
    assert_eq!(&a[2..7], &[127, 0, 2, 2, 0]);
    // The public entry point quantizes as ggml's CPU backend quantizes activations.
    let mut q = [0u8; 34];
    strata_quant::quantize(GgmlType::Q8_0, &x, &mut q).expect("quantize");
    assert_eq!(q, a);
}

#[test]
fn q4_0_fixture() {
    common::check_type(GgmlType::Q4_0, true, 1e-5);
}

#[test]
fn q4_1_fixture() {
    common::check_type(GgmlType::Q4_1, true, 2e-3);
}

#[test]
fn q5_0_fixture() {
    common::check_type(GgmlType::Q5_0, true, 1e-5);
}

#[test]
fn q5_1_fixture() {
    common::check_type(GgmlType::Q5_1, true, 2e-3);
}

#[test]
fn q8_0_fixture() {
    common::check_type(GgmlType::Q8_0, true, 1e-5);
}

#[test]
fn q8_1_fixture() {
    common::check_type(GgmlType::Q8_1, true, 0.0);
}

#[test]
fn iq4_nl_fixture() {
    common::check_type(GgmlType::IQ4_NL, true, 1e-5);
}
