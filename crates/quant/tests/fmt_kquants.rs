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

// ---------------------------------------------------------------------------------------------
// SIMD kernels against the scalar reference, bit for bit.

use proptest::prelude::*;
use strata_quant::Isa;

const WEIGHT_TYPES: [GgmlType; 5] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Byte offsets of the f16 super-block scales (d, and dmin where the type has one).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

/// Finite f16 bit patterns, weighted towards the edge cases.
fn finite_f16() -> impl Strategy<Value = u16> {
    prop_oneof![
        3 => (any::<bool>(), 0x0400u16..0x7C00).prop_map(|(s, m)| m | if s { 0x8000 } else { 0 }),
        1 => (any::<bool>(), 1u16..0x0400).prop_map(|(s, m)| m | if s { 0x8000 } else { 0 }),
        1 => prop_oneof![Just(0u16), Just(0x8000u16), Just(0x7BFF), Just(0xFBFF)],
    ]
}

/// One activation block of f32: a random power-of-two scale (tiny to huge) times values in
/// [-1, 1], sometimes with a single outlier.
fn act_block() -> impl Strategy<Value = Vec<f32>> {
    (
        -60i32..60,
        prop::collection::vec(-1f32..1.0, 256),
        any::<u8>(),
        -100f32..100.0,
    )
        .prop_map(|(e, mut v, pos, out)| {
            let s = 2f32.powi(e);
            for x in &mut v {
                *x *= s;
            }
            if pos % 3 == 0 {
                v[pos as usize] = out * s;
            }
            v
        })
}

fn weights(ty: GgmlType, nb: usize) -> impl Strategy<Value = Vec<u8>> {
    let ts = ty.type_size();
    (
        prop::collection::vec(any::<u8>(), nb * ts),
        prop::collection::vec(finite_f16(), 2 * nb),
    )
        .prop_map(move |(mut w, scales)| {
            for (b, blk) in w.chunks_exact_mut(ts).enumerate() {
                for (i, &o) in f16_fields(ty).iter().enumerate() {
                    blk[o..o + 2].copy_from_slice(&scales[2 * b + i].to_le_bytes());
                }
            }
            w
        })
}

/// Every SIMD kernel variant this CPU runs (the preferred one and the alternatives) gives the
/// scalar reference's bits.
fn check_isas_equal(ty: GgmlType, w: &[u8], xq: &[u8]) -> Result<(), TestCaseError> {
    let n = xq.len() / 292 * 256;
    let want = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, w, xq).unwrap();
    for isa in [Isa::Avx2, Isa::Avx512] {
        for (name, f) in strata_quant::simd::kquants_x86::variants(ty, isa) {
            let got = f(n, w, xq);
            prop_assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{ty} {} {name}: got {got:e} ({:#010x}), scalar {want:e} ({:#010x})",
                isa.name(),
                got.to_bits(),
                want.to_bits()
            );
        }
    }
    Ok(())
}

fn quantized_row(blocks: &[Vec<f32>]) -> Vec<u8> {
    let x: Vec<f32> = blocks.concat();
    let mut xq = vec![0u8; x.len() / 256 * 292];
    strata_quant::quantize(GgmlType::Q8_K, &x, &mut xq).unwrap();
    xq
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Random weight blocks × Q8_K rows quantized from random f32: every ISA equals scalar.
    #[test]
    fn simd_dots_equal_scalar(
        (ty, w, xs) in (0usize..5, 1usize..7).prop_flat_map(|(t, nb)| {
            let ty = WEIGHT_TYPES[t];
            (Just(ty), weights(ty, nb), prop::collection::vec(act_block(), nb))
        })
    ) {
        check_isas_equal(ty, &w, &quantized_row(&xs))?;
    }

    /// Arbitrary Q8_K bytes (codes down to −128, bsums that need not match the codes, any
    /// finite d): the integer work wraps identically in every kernel.
    #[test]
    fn simd_dots_equal_scalar_on_raw_q8k(
        (ty, w, mut xq, ds) in (0usize..5, 1usize..4).prop_flat_map(|(t, nb)| {
            let ty = WEIGHT_TYPES[t];
            (
                Just(ty),
                weights(ty, nb),
                prop::collection::vec(any::<u8>(), nb * 292),
                prop::collection::vec(prop::num::f32::NORMAL | prop::num::f32::ZERO, nb),
            )
        })
    ) {
        for (blk, d) in xq.chunks_exact_mut(292).zip(&ds) {
            blk[..4].copy_from_slice(&d.to_le_bytes());
        }
        check_isas_equal(ty, &w, &xq)?;
    }
}

/// Σ dequant(w)·dequant(x) in f64 and Σ |dequant(w)·dequant(x)|: an oracle for the dot
/// products built only on the (fixture-checked) dequantizers.
fn f64_dot(ty: GgmlType, w: &[u8], xq: &[u8]) -> (f64, f64) {
    let n = xq.len() / 292 * 256;
    let (mut wf, mut xf) = (vec![0f32; n], vec![0f32; n]);
    strata_quant::dequantize(ty, w, &mut wf).unwrap();
    strata_quant::dequantize(GgmlType::Q8_K, xq, &mut xf).unwrap();
    let dot = wf.iter().zip(&xf).map(|(&a, &b)| a as f64 * b as f64).sum();
    let mag = wf
        .iter()
        .zip(&xf)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    (dot, mag)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The scalar reference agrees with the f64 dot product of the dequantized rows (scales
    /// of ordinary magnitude; the error is relative to Σ|w·x| because rows can cancel).
    #[test]
    fn scalar_dot_matches_dequantized_f64(
        (ty, w, xs) in (0usize..5, 1usize..5).prop_flat_map(|(t, nb)| {
            let ty = WEIGHT_TYPES[t];
            let scale = (any::<bool>(), 0x1000u16..0x2C00)
                .prop_map(|(s, m)| m | if s { 0x8000 } else { 0 });
            let w = (
                prop::collection::vec(any::<u8>(), nb * ty.type_size()),
                prop::collection::vec(scale, 2 * nb),
            )
                .prop_map(move |(mut w, sc)| {
                    for (b, blk) in w.chunks_exact_mut(ty.type_size()).enumerate() {
                        for (i, &o) in f16_fields(ty).iter().enumerate() {
                            blk[o..o + 2].copy_from_slice(&sc[2 * b + i].to_le_bytes());
                        }
                    }
                    w
                });
            (Just(ty), w, prop::collection::vec(prop::collection::vec(-4f32..4.0, 256), nb))
        })
    ) {
        let xq = quantized_row(&xs);
        let got = strata_quant::vec_dot_isa(ty, Isa::Scalar, xq.len() / 292 * 256, &w, &xq)
            .unwrap() as f64;
        let (want, mag) = f64_dot(ty, &w, &xq);
        prop_assert!(
            (got - want).abs() <= 1e-5 * mag.max(1e-30),
            "{ty}: got {got:e}, f64 {want:e}, Σ|w·x| {mag:e}"
        );
    }
}

/// Reference quantizers round-trip random rows with the error their bit widths allow, and
/// all-zero blocks come back as exact zeros.
#[test]
fn weight_quantizers_round_trip() {
    // Relative RMS error bounds, about 15% above what these quantizers reach on normal data
    // (2-bit 0.29, 3-bit 0.146, 4-bit 0.069, 5-bit 0.035, 6-bit 0.017). Magnitudes stay where
    // the f16 super-block scales can represent them.
    let bounds = [
        (GgmlType::Q2_K, 0.33),
        (GgmlType::Q3_K, 0.17),
        (GgmlType::Q4_K, 0.08),
        (GgmlType::Q5_K, 0.04),
        (GgmlType::Q6_K, 0.02),
    ];
    let mut rng = strata_quant::synth::SplitMix64(42);
    for (ty, bound) in bounds {
        for scale in [1e-2f32, 1.0, 1e3] {
            let n = 256 * 32;
            let mut x: Vec<f32> = (0..n).map(|_| rng.next_normal() * scale).collect();
            x[256..512].fill(0.0);
            let mut q = vec![0u8; ty.row_bytes(n).unwrap()];
            strata_quant::quantize(ty, &x, &mut q).unwrap();
            let mut y = vec![0f32; n];
            strata_quant::dequantize(ty, &q, &mut y).unwrap();
            assert!(y[256..512].iter().all(|&v| v == 0.0), "{ty}: zero block");
            let err: f64 = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| ((a - b) as f64).powi(2))
                .sum();
            let norm: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
            let rel = (err / norm).sqrt();
            println!("{ty} scale {scale:e}: relative RMS error {rel:.4}");
            assert!(
                rel < bound,
                "{ty} scale {scale:e}: relative RMS error {rel} >= {bound}"
            );
        }
    }
}

/// The kernels this CPU runs: the fixture dot products go through every one of them.
#[test]
fn simd_kernels_present() {
    for ty in WEIGHT_TYPES {
        for isa in [Isa::Avx2, Isa::Avx512] {
            if strata_quant::simd::supported(isa) {
                assert!(
                    strata_quant::has_simd_dot(ty, isa),
                    "{ty} has no {} kernel",
                    isa.name()
                );
            }
        }
    }
}

/// Throughput of every kernel, in GB/s of weight bytes, on one core: a cache-resident matrix
/// (64 rows) and a memory-sized one (8192 rows) of 4096-element rows; the best of 7 trials of
/// about 32 MB each, so other processes on the machine disturb it less.
/// Run: `cargo test --release -p strata-quant --test fmt_kquants -- --ignored --nocapture bench`
#[test]
#[ignore = "benchmark"]
fn bench_kquant_dots() {
    let n = 4096;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut xq = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
    strata_quant::quantize(GgmlType::Q8_K, &x, &mut xq).unwrap();
    let only = std::env::var("KQ_BENCH_TYPE").ok();
    for ty in WEIGHT_TYPES {
        if only
            .as_deref()
            .is_some_and(|o| !o.eq_ignore_ascii_case(ty.name()))
        {
            continue;
        }
        let rb = ty.row_bytes(n).unwrap();
        for rows in [64usize, 8192] {
            let w = strata_quant::synth::random_blocks(ty, rows * n / 256, 7);
            let mut kernels = vec![("scalar", "", strata_quant::dot_fn(ty, Isa::Scalar).unwrap())];
            for isa in [Isa::Avx2, Isa::Avx512] {
                for (name, f) in strata_quant::simd::kquants_x86::variants(ty, isa) {
                    kernels.push((isa.name(), name, f));
                }
            }
            for (isa, variant, f) in kernels {
                let reps = (32 << 20) / (rows * rb) + 1;
                let trials = if isa == "scalar" { 1 } else { 7 };
                let mut best = 0f64;
                let mut sink = 0f32;
                for _ in 0..trials {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        for r in 0..rows {
                            sink += f(n, &w[r * rb..(r + 1) * rb], &xq);
                        }
                    }
                    let gbs = (reps * rows * rb) as f64 / t.elapsed().as_secs_f64() / 1e9;
                    best = best.max(gbs);
                }
                println!(
                    "{ty} {isa:>6} {variant:3} rows={rows:5}: {best:6.2} GB/s  (sink {sink:e})"
                );
            }
        }
    }
}
