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

// ---------------------------------------------------------------------------------------------
// Properties on random blocks: every ISA gives the scalar reference's bits.

use proptest::prelude::*;
use strata_quant::Isa;

/// Weight types of this family that have a dot product, with the offsets of their f16 fields.
const DOT_TYPES: [(GgmlType, &[usize]); 6] = [
    (GgmlType::Q4_0, &[0]),
    (GgmlType::Q4_1, &[0, 2]),
    (GgmlType::Q5_0, &[0]),
    (GgmlType::Q5_1, &[0, 2]),
    (GgmlType::Q8_0, &[0]),
    (GgmlType::IQ4_NL, &[0]),
];

/// Finite f16 bit patterns: zeros, subnormals, and normals of either sign, with extra weight on
/// the special ones.
fn finite_f16() -> impl Strategy<Value = u16> {
    prop_oneof![
        Just(0u16),
        Just(0x8000u16),
        (0u16..0x400).prop_map(|m| m | 0x8000),
        0u16..0x400,
        any::<u16>().prop_map(|b| if b & 0x7c00 == 0x7c00 { b & !0x4000 } else { b }),
    ]
}

/// `nb` blocks of `ty` from random bytes, the f16 fields at `f16_offsets` replaced by `scales`.
fn with_scales(ty: GgmlType, mut bytes: Vec<u8>, scales: &[u16], f16_offsets: &[usize]) -> Vec<u8> {
    let ts = ty.type_size();
    let mut s = scales.iter().cycle();
    for blk in bytes.chunks_exact_mut(ts) {
        for &o in f16_offsets {
            blk[o..o + 2].copy_from_slice(&s.next().copied().unwrap_or(0).to_le_bytes());
        }
    }
    bytes
}

/// A random row of `nb` blocks for each weight type and its activation type.
fn rows() -> impl Strategy<Value = (usize, Vec<u8>, Vec<u16>, Vec<u8>, Vec<u16>)> {
    prop_oneof![0usize..=9, 10usize..=40, Just(128usize)].prop_flat_map(|nb| {
        (
            Just(nb),
            proptest::collection::vec(any::<u8>(), nb * 36),
            proptest::collection::vec(finite_f16(), 2 * nb.max(1)),
            proptest::collection::vec(any::<u8>(), nb * 36),
            proptest::collection::vec(finite_f16(), 2 * nb.max(1)),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn simd_dots_equal_scalar_reference((nb, wbytes, wscales, xbytes, xscales) in rows()) {
        let n = nb * 32;
        for (ty, offs) in DOT_TYPES {
            let xty = ty.vec_dot_type().unwrap();
            let xoffs: &[usize] = if xty == GgmlType::Q8_1 { &[0, 2] } else { &[0] };
            let w = with_scales(ty, wbytes[..nb * ty.type_size()].to_vec(), &wscales, offs);
            let x = with_scales(xty, xbytes[..nb * xty.type_size()].to_vec(), &xscales, xoffs);
            let want = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, &w, &x).unwrap();
            for isa in [Isa::Avx2, Isa::Avx512] {
                if !strata_quant::simd::supported(isa) {
                    continue;
                }
                let got = strata_quant::vec_dot_isa(ty, isa, n, &w, &x).unwrap();
                prop_assert_eq!(got.to_bits(), want.to_bits(), "{} {} nb={}: {:e} vs {:e}", ty, isa.name(), nb, got, want);
            }
            // The reference itself is a dot product: within f32 rounding of an f64 sum of the
            // dequantized rows (Q8_0 pairs; random Q8_1 sums are not Σx, so those are skipped).
            if xty == GgmlType::Q8_0 {
                let mut wf = vec![0f32; n];
                let mut xf = vec![0f32; n];
                strata_quant::dequantize(ty, &w, &mut wf).unwrap();
                strata_quant::dequantize(xty, &x, &mut xf).unwrap();
                let exact: f64 = wf.iter().zip(&xf).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wf.iter().zip(&xf).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                prop_assert!((want as f64 - exact).abs() <= 1e-6 * mag + 1e-37,
                    "{} nb={}: scalar {:e} vs f64 {:e}", ty, nb, want, exact);
            }
        }
    }
}

/// Random rows for the multi-row kernels: a weight row and 1..=11 activation rows (more than
/// one chunk of 8), `nb` blocks each.
/// (blocks, weight bytes, weight scales, activation rows' bytes, activation scales).
type MultiRows = (usize, Vec<u8>, Vec<u16>, Vec<Vec<u8>>, Vec<u16>);

fn multi_rows() -> impl Strategy<Value = MultiRows> {
    prop_oneof![0usize..=9, 10usize..=24].prop_flat_map(|nb| {
        (
            Just(nb),
            proptest::collection::vec(any::<u8>(), nb * 36),
            proptest::collection::vec(finite_f16(), 2 * nb.max(1)),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), nb * 36), 1..=11),
            proptest::collection::vec(finite_f16(), 2 * nb.max(1)),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// `dot_rows` gives, per row, the bits of the single-row dot (the scalar reference), on
    /// every ISA, for every legacy weight type.
    #[test]
    fn dot_rows_equal_single_row_dots((nb, wbytes, wscales, xrows, xscales) in multi_rows()) {
        let n = nb * 32;
        for (ty, offs) in DOT_TYPES {
            let xty = ty.vec_dot_type().unwrap();
            let xoffs: &[usize] = if xty == GgmlType::Q8_1 { &[0, 2] } else { &[0] };
            let w = with_scales(ty, wbytes[..nb * ty.type_size()].to_vec(), &wscales, offs);
            let xs: Vec<Vec<u8>> = xrows
                .iter()
                .enumerate()
                .map(|(r, x)| {
                    let sc: Vec<u16> = xscales.iter().map(|s| s.rotate_left(r as u32 % 3)).collect();
                    let sc: Vec<u16> = sc.iter().map(|b| if b & 0x7c00 == 0x7c00 { b & !0x4000 } else { *b }).collect();
                    with_scales(xty, x[..nb * xty.type_size()].to_vec(), &sc, xoffs)
                })
                .collect();
            let xr: Vec<&[u8]> = xs.iter().map(|x| x.as_slice()).collect();
            for isa in Isa::ALL {
                if !strata_quant::simd::supported(isa) {
                    continue;
                }
                let mut out = vec![f32::NAN; xr.len()];
                legacy::dot_rows(ty, isa, n, &w, &xr, &mut out).unwrap();
                for (r, x) in xr.iter().enumerate() {
                    let want = strata_quant::vec_dot_isa(ty, Isa::Scalar, n, &w, x).unwrap();
                    prop_assert_eq!(out[r].to_bits(), want.to_bits(),
                        "{} {} nb={} row {} of {}", ty, isa.name(), nb, r, xr.len());
                }
            }
        }
    }
}

/// `dot_rows` rejects wrong sizes with an error instead of reading out of bounds.
#[test]
fn dot_rows_checks_sizes() {
    let w = vec![0u8; 18 * 2];
    let x = vec![0u8; 34 * 2];
    let short = vec![0u8; 34];
    let mut out = [0f32; 2];
    for isa in Isa::ALL {
        let ok = legacy::dot_rows(GgmlType::Q4_0, isa, 64, &w, &[&x, &x], &mut out);
        assert_eq!(ok, Ok(()));
        assert!(legacy::dot_rows(GgmlType::Q4_0, isa, 64, &w, &[&x, &short], &mut out).is_err());
        assert!(legacy::dot_rows(GgmlType::Q4_0, isa, 64, &w[..18], &[&x], &mut out[..1]).is_err());
        assert!(legacy::dot_rows(GgmlType::Q4_0, isa, 64, &w, &[&x], &mut out).is_err());
        assert!(legacy::dot_rows(GgmlType::Q4_0, isa, 48, &w, &[&x], &mut out[..1]).is_err());
        assert!(legacy::dot_rows(GgmlType::Q4_K, isa, 256, &w, &[&x], &mut out[..1]).is_err());
    }
}

/// Nanoseconds this thread has run on a CPU (Linux `schedstat`), if available.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Throughput of the dot kernels, GB/s of weight bytes on one core, for a 4096-wide activation
/// row against 32 weight rows (in L2) and 2048 rows (4.5-8.5 MiB, from L3). Timing, not a check:
/// `cargo test --release -p strata-quant --test fmt_legacy -- --ignored --nocapture bench`.
#[test]
#[ignore]
fn bench_dot_throughput() {
    let n = 4096;
    for (rows, (ty, offs)) in [32usize, 2048]
        .into_iter()
        .flat_map(|r| DOT_TYPES.map(|t| (r, t)))
    {
        let xty = ty.vec_dot_type().unwrap();
        let rb = ty.row_bytes(n).unwrap();
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        };
        let w: Vec<u8> = (0..rb * rows).map(|_| rnd()).collect();
        let w = with_scales(ty, w, &[0x2c00, 0xac00, 0x2e66], offs);
        let x: Vec<u8> = (0..xty.row_bytes(n).unwrap()).map(|_| rnd()).collect();
        let x = with_scales(xty, x, &[0x2400], &[0, 2]);
        for isa in Isa::ALL {
            if !strata_quant::simd::supported(isa) {
                continue;
            }
            let f = strata_quant::dot_fn(ty, isa).unwrap();
            let mut sink = 0f32;
            let mut reps = 0usize;
            let t = std::time::Instant::now();
            let cpu0 = thread_cpu_ns();
            while t.elapsed().as_secs_f64() < 0.5 {
                for r in 0..rows {
                    sink += f(n, &w[r * rb..(r + 1) * rb], &x);
                }
                reps += 1;
            }
            // On-CPU time of this thread where the kernel reports it, so that other jobs on a
            // shared machine do not count; wall time otherwise.
            let secs = match (cpu0, thread_cpu_ns()) {
                (Some(a), Some(b)) if b > a => (b - a) as f64 * 1e-9,
                _ => t.elapsed().as_secs_f64(),
            };
            let gbs = (reps * rows * rb) as f64 / secs / 1e9;
            eprintln!(
                "{ty:>6} {:>6} {rows:>4} rows: {gbs:6.2} GB/s of weight ({sink:e})",
                isa.name()
            );
            if xty != GgmlType::Q8_0 || rows != 32 {
                continue;
            }
            // 8 activation rows per pass over each weight row: weight bytes x 8 per second.
            let xs8: Vec<Vec<u8>> = (0..8)
                .map(|i| x.iter().map(|b| b.wrapping_add(i)).collect::<Vec<u8>>())
                .map(|v| with_scales(xty, v, &[0x2400], &[0]))
                .collect();
            let xr: Vec<&[u8]> = xs8.iter().map(|v| v.as_slice()).collect();
            let mut out = [0f32; 8];
            let mut reps = 0usize;
            let t = std::time::Instant::now();
            let cpu0 = thread_cpu_ns();
            while t.elapsed().as_secs_f64() < 0.5 {
                for r in 0..rows {
                    legacy::dot_rows(ty, isa, n, &w[r * rb..(r + 1) * rb], &xr, &mut out).unwrap();
                    sink += out[7];
                }
                reps += 1;
            }
            let secs = match (cpu0, thread_cpu_ns()) {
                (Some(a), Some(b)) if b > a => (b - a) as f64 * 1e-9,
                _ => t.elapsed().as_secs_f64(),
            };
            let gbs = (reps * rows * rb * 8) as f64 / secs / 1e9;
            eprintln!(
                "{ty:>6} {:>6}   x8 rows: {gbs:6.2} GB/s of weight-row dots ({sink:e})",
                isa.name()
            );
        }
    }
}
