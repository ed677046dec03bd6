//! K-quant family against ggml's vectors (`fixtures/formats/q{2..6}_k`, `q8_k`): dequantization,
//! quantization and dot products, plus properties that tie the SIMD kernels to the scalar
//! reference bit for bit.

mod common;

use common::{assert_bits_eq, assert_bytes_eq, Vectors};
use strata_quant::GgmlType;

#[test]
fn q8_k_quantize_and_dequantize() {
    common::check_type(GgmlType::Q8_K, true, 1e-5);
}

/// Every K-quant fixture's `dot_xq` is the CPU backend's Q8_K quantization of `dot_x`.
#[test]
fn q8_k_matches_every_dot_xq() {
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let v = Vectors::load(ty);
        let x = v.f32s("dot_x");
        let mut xq = vec![0u8; GgmlType::Q8_K.row_bytes(x.len()).unwrap()];
        strata_quant::quantize(GgmlType::Q8_K, &x, &mut xq).unwrap();
        assert_bytes_eq(&format!("{ty} dot_xq"), &xq, v.bytes("dot_xq"), 292);
    }
}

/// An all-zero block gives d = 0 and zero codes; dequantizing a block gives d·q.
#[test]
fn q8_k_zero_block_and_extremes() {
    let mut x = vec![0f32; 512];
    x[256 + 7] = -3.0;
    x[256 + 9] = 3.0;
    let mut q = vec![0xAAu8; 584];
    strata_quant::quantize(GgmlType::Q8_K, &x, &mut q).unwrap();
    assert!(q[..292].iter().all(|&b| b == 0), "zero block");
    let b = &q[292..];
    assert_eq!(
        f32::from_le_bytes(b[0..4].try_into().unwrap()),
        1.0 / (-127.0f32 / -3.0)
    );
    assert_eq!(
        b[4 + 7] as i8,
        -127,
        "the first largest element maps to -127"
    );
    assert_eq!(b[4 + 9] as i8, 127, "its opposite is clamped to 127");
    let mut y = vec![0f32; 512];
    strata_quant::dequantize(GgmlType::Q8_K, &q, &mut y).unwrap();
    assert_bits_eq("zero block", &y[..256], &[0f32; 256]);
    let d = 1.0 / (-127.0f32 / -3.0);
    assert_eq!(y[256 + 7], d * -127.0);
    assert!((y[256 + 7] + 3.0).abs() < 1e-6);
}

#[test]
fn q2_k_fixture() {
    common::check_type(GgmlType::Q2_K, true, 1e-5);
}

#[test]
fn q3_k_fixture() {
    common::check_type(GgmlType::Q3_K, true, 1e-5);
}

#[test]
fn q4_k_fixture() {
    common::check_type(GgmlType::Q4_K, true, 1e-5);
}

#[test]
fn q5_k_fixture() {
    common::check_type(GgmlType::Q5_K, true, 1e-5);
}

#[test]
fn q6_k_fixture() {
    common::check_type(GgmlType::Q6_K, true, 1e-5);
}
