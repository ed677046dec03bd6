//! F32 / F16 / BF16 against ggml's vectors, the dequantize-only conversions (F64, I8..I64), and
//! property tests holding every SIMD dot product bitwise equal to the scalar reference.

mod common;

use strata_quant::GgmlType;

#[test]
fn f32_fixture() {
    common::check_type(GgmlType::F32, false, 1e-5);
}

#[test]
fn f16_fixture() {
    common::check_type(GgmlType::F16, true, 1e-5);
}

#[test]
fn bf16_fixture() {
    common::check_type(GgmlType::BF16, true, 1e-5);
}

#[test]
fn dump_types_dequantize() {
    let mut out = [0f32; 3];
    let cases: [(GgmlType, Vec<u8>, [f32; 3]); 5] = [
        (GgmlType::I8, vec![0x80, 0x7f, 0xff], [-128.0, 127.0, -1.0]),
        (
            GgmlType::I16,
            [i16::MIN, 300, -2]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            [-32768.0, 300.0, -2.0],
        ),
        (
            GgmlType::I32,
            [i32::MIN, 16_777_217, -5]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            // 2^24 + 1 is not an f32: it rounds to even, 2^24.
            [-2147483648.0, 16_777_216.0, -5.0],
        ),
        (
            GgmlType::I64,
            [i64::MIN, 1 << 40, 7]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            [-9.223372e18, 1_099_511_627_776.0, 7.0],
        ),
        (
            GgmlType::F64,
            [0.1f64, -1e300, 1e-50]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            [0.1f32, f32::NEG_INFINITY, 0.0],
        ),
    ];
    for (ty, bytes, want) in cases {
        strata_quant::dequantize(ty, &bytes, &mut out).expect("dequantize");
        common::assert_bits_eq(ty.name(), &out, &want);
    }
}
