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

/// A finite f16 bit pattern of any class: zeros of both signs, subnormals, normals up to 65504.
fn finite_f16(r: u16) -> u16 {
    if (r >> 10) & 0x1f == 0x1f {
        r & !0x4000 // exponent 31 → 15: a normal of the same sign and mantissa
    } else {
        r
    }
}

/// One Q2_0 row and its Q8_0 activation for `nb` blocks, from raw random bytes (codes of every
/// value, including -128 activations) with finite scales.
fn q2_0_rows(nb: usize, bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let (wb, xb) = bytes.split_at(nb * 18);
    let mut w = wb.to_vec();
    let mut x = xb.to_vec();
    for b in w.chunks_exact_mut(18) {
        let d = finite_f16(u16::from_le_bytes([b[0], b[1]]));
        b[..2].copy_from_slice(&d.to_le_bytes());
    }
    for b in x.chunks_exact_mut(34) {
        let d = finite_f16(u16::from_le_bytes([b[0], b[1]]));
        b[..2].copy_from_slice(&d.to_le_bytes());
    }
    (w, x)
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn case() -> impl Strategy<Value = (usize, Vec<u8>)> {
        prop_oneof![1..=4usize, 60..=70usize, Just(64usize), 127..=130usize].prop_flat_map(|nb| {
            (
                Just(nb),
                proptest::collection::vec(any::<u8>(), nb * (18 + 68)),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Random Q2_0 rows of several lengths: every ISA's kernel gives the scalar reference's
        /// bits (odd block counts, partial scale chunks and extreme scales included).
        #[test]
        fn q2_0_simd_equals_scalar((nb, bytes) in case()) {
            let (w, x) = q2_0_rows(nb, &bytes);
            let n = 64 * nb;
            let want = strata_quant::vec_dot_isa(GgmlType::Q2_0, Isa::Scalar, n, &w, &x).unwrap();
            for isa in [Isa::Avx2, Isa::Avx512] {
                if strata_quant::has_simd_dot(GgmlType::Q2_0, isa) {
                    let got = strata_quant::vec_dot_isa(GgmlType::Q2_0, isa, n, &w, &x).unwrap();
                    prop_assert_eq!(got.to_bits(), want.to_bits(), "nb={} {}: {:e} vs {:e}", nb, isa.name(), got, want);
                }
            }
        }

        /// The scalar dot of every low-bit type agrees with an f64 sum over the dequantized
        /// rows (an oracle that shares nothing with the dot's element mapping but dequantize,
        /// itself checked against ggml), within f32 rounding of Σ|terms|.
        #[test]
        fn lowbit_dot_matches_dequantized(seed in any::<u64>(), ty_i in 0..LOWBIT.len(), nb in 1..6usize) {
            let ty = LOWBIT[ty_i];
            let xty = ty.vec_dot_type().unwrap();
            let n = 256 * nb;
            let mut rng = strata_quant::synth::SplitMix64(seed);
            let src: Vec<f32> = (0..2 * n).map(|_| rng.next_normal()).collect();
            let mut w = vec![0u8; ty.row_bytes(n).unwrap()];
            let mut x = vec![0u8; xty.row_bytes(n).unwrap()];
            strata_quant::quantize(ty, &src[..n], &mut w).unwrap();
            strata_quant::quantize(xty, &src[n..], &mut x).unwrap();
            let (mut wd, mut xd) = (vec![0f32; n], vec![0f32; n]);
            strata_quant::dequantize(ty, &w, &mut wd).unwrap();
            strata_quant::dequantize(xty, &x, &mut xd).unwrap();
            let exact: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = wd.iter().zip(&xd).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let got = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, &w, &x).unwrap() as f64;
            prop_assert!((got - exact).abs() <= 1e-5 * mag, "{}: {} vs {} (Σ|t| {})", ty, got, exact, mag);
        }
    }
}

#[test]
fn q2_0_simd_kernels_present() {
    for isa in [Isa::Avx2, Isa::Avx512] {
        if strata_quant::simd::supported(isa) {
            assert!(
                strata_quant::has_simd_dot(GgmlType::Q2_0, isa),
                "{}",
                isa.name()
            );
        }
    }
}

/// Q2_0 × Q8_0 throughput, one thread, in GB/s of weight bytes: rows of 4096 elements, a
/// cache-resident matrix (256 rows, 288 KiB) and a streamed one (64 Ki rows, 72 MiB).
/// `cargo test --release -p strata-quant --test fmt_lowbit -- --ignored --nocapture q2_0_bench`
#[test]
#[ignore = "benchmark"]
fn q2_0_bench() {
    let n = 4096;
    let rb = GgmlType::Q2_0.row_bytes(n).unwrap();
    let mut rng = strata_quant::synth::SplitMix64(7);
    let x: Vec<f32> = (0..n).map(|_| rng.next_normal()).collect();
    let mut xq = vec![0u8; GgmlType::Q8_0.row_bytes(n).unwrap()];
    strata_quant::quantize(GgmlType::Q8_0, &x, &mut xq).unwrap();
    for rows in [256usize, 65536] {
        let src: Vec<f32> = (0..n * 64).map(|_| rng.next_normal()).collect();
        let mut w = vec![0u8; rows * rb];
        for chunk in w.chunks_mut(64 * rb) {
            let r = chunk.len() / rb;
            strata_quant::quantize(GgmlType::Q2_0, &src[..r * n], chunk).unwrap();
        }
        for isa in Isa::ALL {
            if !strata_quant::simd::supported(isa) {
                continue;
            }
            let f = strata_quant::dot_fn(GgmlType::Q2_0, isa).unwrap();
            // The minimum over many passes: the machine may be shared, and interference only
            // ever adds time.
            let trials = if isa == Isa::Scalar {
                2
            } else if rows <= 256 {
                400
            } else {
                12
            };
            let mut sink = 0f32;
            let mut s = f64::INFINITY;
            for _ in 0..trials {
                let t = std::time::Instant::now();
                for row in w.chunks_exact(rb) {
                    sink += f(n, row, &xq);
                }
                s = s.min(t.elapsed().as_secs_f64());
            }
            let reps = 1;
            let gbs = (reps * rows * rb) as f64 / s / 1e9;
            let ns_row = s * 1e9 / (reps * rows) as f64;
            eprintln!(
                "Q2_0 x Q8_0 {:>6} {:>7} rows: {gbs:6.2} GB/s of weights, {ns_row:7.1} ns/row (sink {sink:e})",
                isa.name(),
                rows
            );
        }
    }
}
