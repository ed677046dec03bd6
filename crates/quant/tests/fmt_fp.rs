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

mod props {
    use proptest::prelude::*;
    use strata_quant::{GgmlType, Isa};

    /// Bit patterns of finite elements: zeros of both signs, subnormals, and normals with the
    /// exponent (biased) drawn from `exp` — bounded so that no product or sum overflows.
    fn elem_bits(
        mant_bits: u32,
        exp_bits: u32,
        exp: std::ops::RangeInclusive<u32>,
    ) -> impl Strategy<Value = u32> {
        let mant = (1u32 << mant_bits) - 1;
        let sign = 1u32 << (mant_bits + exp_bits);
        prop_oneof![
            1 => Just(0u32),
            1 => Just(sign),
            2 => (any::<bool>(), 1..=mant).prop_map(move |(s, m)| m | if s { sign } else { 0 }),
            8 => (any::<bool>(), exp, 0..=mant).prop_map(move |(s, e, m)| {
                (e << mant_bits) | m | if s { sign } else { 0 }
            }),
        ]
    }

    fn row(ty: GgmlType, bits: &[u32]) -> Vec<u8> {
        match ty {
            GgmlType::F32 => bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
            _ => bits
                .iter()
                .flat_map(|b| (*b as u16).to_le_bytes())
                .collect(),
        }
    }

    fn lens() -> impl Strategy<Value = usize> {
        prop_oneof![0..200usize, 1000..1100usize, Just(4096usize)]
    }

    fn rows(ty: GgmlType) -> impl Strategy<Value = (Vec<u32>, Vec<u32>)> {
        let e = match ty {
            // f32 and bf16: |x| < 2^50, so |w·x| < 2^100 and no sum of < 2^20 terms overflows.
            GgmlType::F32 | GgmlType::BF16 => 27..=176u32,
            // f16: every finite value (65504² · 4096 is far below f32's range).
            _ => 1..=30u32,
        };
        let (m, x) = if ty == GgmlType::F16 {
            (10, 5)
        } else if ty == GgmlType::BF16 {
            (7, 8)
        } else {
            (23, 8)
        };
        lens().prop_flat_map(move |n| {
            (
                proptest::collection::vec(elem_bits(m, x, e.clone()), n),
                proptest::collection::vec(elem_bits(m, x, e.clone()), n),
            )
        })
    }

    fn check(ty: GgmlType, w: &[u32], x: &[u32]) -> Result<(), TestCaseError> {
        let n = w.len();
        let (w, x) = (row(ty, w), row(ty, x));
        let want = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, &w, &x).expect("scalar dot");
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !strata_quant::has_simd_dot(ty, isa) {
                continue;
            }
            let got = strata_quant::vec_dot_isa(ty, isa, n, &w, &x).expect("simd dot");
            prop_assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{} n={} {}: {:e} vs {:e}",
                ty,
                n,
                isa.name(),
                got,
                want
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn f32_simd_equals_scalar((w, x) in rows(GgmlType::F32)) { check(GgmlType::F32, &w, &x)?; }
        #[test]
        fn f16_simd_equals_scalar((w, x) in rows(GgmlType::F16)) { check(GgmlType::F16, &w, &x)?; }
        #[test]
        fn bf16_simd_equals_scalar((w, x) in rows(GgmlType::BF16)) { check(GgmlType::BF16, &w, &x)?; }
    }
}

/// Every fp type has AVX2 and AVX-512 kernels where the CPU has those ISAs (so the property
/// tests above are not comparing the reference with itself).
#[test]
fn fp_simd_kernels_present() {
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for isa in [strata_quant::Isa::Avx2, strata_quant::Isa::Avx512] {
            if strata_quant::simd::supported(isa) {
                assert!(strata_quant::has_simd_dot(ty, isa), "{ty} {}", isa.name());
            }
        }
    }
}
