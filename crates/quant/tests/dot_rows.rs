//! Multi-row dot products (one weight row against several activation rows, `vec_dot_rows_isa`):
//! every row's result must carry the bits of the single-row kernel of the same ISA, for any
//! number of rows (the kernels take up to 8 per pass over the weight row and loop), on every
//! ISA this CPU runs. The single-row kernels are held to the scalar reference by each family's
//! own tests, so this closes the chain multi-row = single-row = reference.

use proptest::prelude::*;
use strata_quant::synth::{random_blocks, SplitMix64};
use strata_quant::{dot_fn, dot_rows_fn, simd, vec_dot_isa, vec_dot_rows_isa, GgmlType, Isa};

/// Types with multi-row kernels (on AVX2 and AVX-512), most used first.
const ROWS_TYPES: &[GgmlType] = &[
    GgmlType::Q2_0,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::IQ4_XS,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::Q3_K,
    GgmlType::Q2_K,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::BF16,
    GgmlType::F16,
    GgmlType::F32,
];

/// Blocks per test row: the float types have one element per block, so they get rows long
/// enough to cross their kernels' 64-lane steps and 1024-element chunks.
fn test_blocks(ty: GgmlType, nb: usize) -> usize {
    if ty.block_size() == 1 {
        97 * nb + nb % 64
    } else {
        nb
    }
}

/// An activation row of `n` values for weight type `ty`: normal values times `scale`, quantized
/// to `ty`'s activation type as a matmul would.
fn activation(ty: GgmlType, n: usize, seed: u64, scale: f32) -> Vec<u8> {
    let xty = ty.vec_dot_type().expect("a weight type with a dot product");
    let mut rng = SplitMix64(seed);
    let x: Vec<f32> = (0..n).map(|_| rng.next_normal() * scale).collect();
    let mut out = vec![0u8; xty.row_bytes(n).expect("whole blocks")];
    strata_quant::quantize(xty, &x, &mut out).expect("activation quantizer");
    out
}

/// Same bits, or both NaN (a scale that overflowed to infinity makes NaN, whose payload the
/// contract does not fix).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn isas() -> Vec<Isa> {
    Isa::ALL
        .into_iter()
        .filter(|i| simd::supported(*i))
        .collect()
}

/// Weight `ty`, `nb` blocks, `rows` activation rows: multi-row results against single-row ones.
fn check(ty: GgmlType, w: &[u8], nb: usize, xs: &[Vec<u8>]) -> Result<(), TestCaseError> {
    let n = nb * ty.block_size();
    let xr: Vec<&[u8]> = xs.iter().map(|x| x.as_slice()).collect();
    for isa in isas() {
        let mut out = vec![f32::NAN; xr.len()];
        vec_dot_rows_isa(ty, isa, n, w, &xr, &mut out)
            .map_err(|e| TestCaseError::fail(format!("{ty} {}: {e}", isa.name())))?;
        for (r, x) in xr.iter().enumerate() {
            let want = vec_dot_isa(ty, isa, n, w, x)
                .map_err(|e| TestCaseError::fail(format!("{ty} {}: {e}", isa.name())))?;
            prop_assert!(
                same(out[r], want),
                "{} {}: nb={} row {} of {}: multi-row {:e} ({:#010x}), single-row {:e} ({:#010x})",
                ty,
                isa.name(),
                nb,
                r,
                xr.len(),
                out[r],
                out[r].to_bits(),
                want,
                want.to_bits()
            );
        }
    }
    Ok(())
}

/// Activation magnitudes: tiny, ordinary and large (Q8_0's f16 scale overflows near the top).
fn scales() -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec(-24i32..=24, 1..=19)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Valid random blocks (`synth::random_blocks`), 1..=19 activation rows of random
    /// magnitudes: every multi-row result equals the single-row one, per type and ISA.
    #[test]
    fn rows_equal_single_row_dots(nb in 1usize..=11, seed in any::<u64>(), exps in scales()) {
        for &ty in ROWS_TYPES {
            let nb = test_blocks(ty, nb);
            let w = random_blocks(ty, nb, seed);
            let n = nb * ty.block_size();
            let xs: Vec<Vec<u8>> = exps
                .iter()
                .enumerate()
                .map(|(r, &e)| activation(ty, n, seed ^ ((r as u64 + 1) * 0x9e37), 2f32.powi(e)))
                .collect();
            check(ty, &w, nb, &xs)?;
        }
    }

    /// Fully random weight bytes (any scale bits: huge, subnormal, infinite, NaN).
    #[test]
    fn rows_equal_single_row_dots_raw_weights(
        nb in 1usize..=9,
        seed in any::<u64>(),
        rows in 1usize..=17,
    ) {
        for &ty in ROWS_TYPES {
            let nb = test_blocks(ty, nb);
            let mut w = vec![0u8; nb * ty.type_size()];
            SplitMix64(seed).fill_bytes(&mut w);
            let n = nb * ty.block_size();
            let xs: Vec<Vec<u8>> = (0..rows)
                .map(|r| activation(ty, n, seed.wrapping_add(r as u64), 1.0 + r as f32))
                .collect();
            check(ty, &w, nb, &xs)?;
        }
    }
}

/// A long row (many 4-block groups and a tail) and exactly 8, 9 and 16 rows.
#[test]
fn long_rows_and_group_edges() {
    for &ty in ROWS_TYPES {
        let nb = 4096 / ty.block_size() + 3;
        let w = random_blocks(ty, nb, 7);
        let n = nb * ty.block_size();
        for rows in [8usize, 9, 16] {
            let xs: Vec<Vec<u8>> = (0..rows)
                .map(|r| activation(ty, n, 100 + r as u64, 3.0))
                .collect();
            if let Err(e) = check(ty, &w, nb, &xs) {
                panic!("{e}");
            }
        }
    }
}

/// Every type above has its own multi-row kernel on each SIMD ISA this CPU runs (not the
/// per-row fallback; the float types on AVX-512 only), and the best ISA has one.
#[test]
fn multi_row_kernels_exist() {
    for &ty in ROWS_TYPES {
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !simd::supported(isa) {
                eprintln!("{}: not supported by this CPU, not checked", isa.name());
                continue;
            }
            // The float types have no AVX2 kernel: the per-row fallback is faster there.
            if isa == Isa::Avx2 && ty.block_size() == 1 {
                assert!(
                    dot_rows_fn(ty, isa).is_none(),
                    "{ty}: unexpected AVX2 kernel"
                );
                continue;
            }
            assert!(
                dot_rows_fn(ty, isa).is_some(),
                "{ty}: no {} multi-row kernel",
                isa.name()
            );
        }
        if simd::best() == Isa::Avx512 || (simd::best() == Isa::Avx2 && ty.block_size() > 1) {
            assert!(
                dot_rows_fn(ty, simd::best()).is_some(),
                "{ty}: none on the best ISA"
            );
        }
    }
}

/// Wrong sizes are errors, not out-of-bounds reads.
#[test]
fn rows_check_sizes() {
    for &ty in ROWS_TYPES {
        let n = 2 * ty.block_size();
        let w = random_blocks(ty, 2, 1);
        let x = activation(ty, n, 2, 1.0);
        let short = &x[..x.len() - 1];
        for isa in isas() {
            let mut out = [0f32; 2];
            assert!(vec_dot_rows_isa(ty, isa, n, &w, &[&x, &x], &mut out).is_ok());
            assert!(vec_dot_rows_isa(ty, isa, n, &w, &[&x, short], &mut out).is_err());
            assert!(vec_dot_rows_isa(ty, isa, n, &w, &[&x], &mut out).is_err());
            assert!(vec_dot_rows_isa(ty, isa, n, &w[1..], &[&x, &x], &mut out).is_err());
        }
    }
}

/// Seconds per timed case.
const BENCH_SECS: f64 = 0.5;

/// Activation-row counts the bench times the multi-row kernels at.
const ROWS_BENCH: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// Nanoseconds this thread has run on a CPU (Linux `schedstat`), if available.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Runs `f` over and over for about `secs` seconds; on-CPU seconds per run (wall time where
/// the kernel does not report thread CPU time).
fn time_per_run(secs: f64, mut f: impl FnMut()) -> f64 {
    f();
    let t = std::time::Instant::now();
    let cpu0 = thread_cpu_ns();
    let mut runs = 0usize;
    while t.elapsed().as_secs_f64() < secs {
        f();
        runs += 1;
    }
    let total = match (cpu0, thread_cpu_ns()) {
        (Some(a), Some(b)) if b > a => (b - a) as f64 * 1e-9,
        _ => t.elapsed().as_secs_f64(),
    };
    total / runs as f64
}

/// Throughput, one thread: 64 MiB of weight rows of 4096 elements (twice the L3 of the dev VM,
/// so weights stream from memory) against 1, 4 and 8 activation rows, in GB/s of weight
/// counted once per activation row. `single` calls the single-row kernel once per weight row;
/// `fallback xR` calls it R times per weight row (the row then comes from L1 after the first);
/// `rows xR` is the multi-row kernel. Timing, not a check:
/// `cargo test --release -p strata-quant --test dot_rows -- --ignored --nocapture bench`
/// (`STRATA_BENCH_TYPES=Q2_0,Q4_K` picks types, `STRATA_BENCH_N=2048` the row length, `STRATA_BENCH_MIB=1` the weight size).
#[test]
#[ignore]
fn bench_dot_rows() {
    let n: usize = std::env::var("STRATA_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let mib: usize = std::env::var("STRATA_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    // Any types by name (also ones without a multi-row kernel yet, to time the fallback).
    let types: Vec<GgmlType> = match std::env::var("STRATA_BENCH_TYPES") {
        Ok(p) => p.split(',').filter_map(GgmlType::from_name).collect(),
        Err(_) => ROWS_TYPES.to_vec(),
    };
    for ty in types {
        let rb = ty.row_bytes(n).expect("whole blocks");
        let wrows = (mib << 20) / rb;
        let w = random_blocks(ty, wrows * n / ty.block_size(), 11);
        // One contiguous activation matrix, as a matmul holds it.
        let xm: Vec<u8> = (0..8)
            .flat_map(|r| activation(ty, n, 50 + r, 1.0))
            .collect();
        let xr: Vec<&[u8]> = xm.chunks_exact(xm.len() / 8).collect();
        let gbs = |secs: f64, rows: usize| (wrows * rb * rows) as f64 / secs / 1e9;
        for isa in isas() {
            if isa == Isa::Scalar {
                continue;
            }
            let f = dot_fn(ty, isa).expect("a dot kernel");
            let mut sink = 0f32;
            let single = time_per_run(BENCH_SECS, || {
                for wr in w.chunks_exact(rb) {
                    sink += f(n, wr, xr[0]);
                }
            });
            let mut line = format!(
                "{:>7} {:>6}: single {:6.2}",
                ty.name(),
                isa.name(),
                gbs(single, 1)
            );
            for rows in [4usize, 8] {
                let fb = time_per_run(BENCH_SECS, || {
                    for wr in w.chunks_exact(rb) {
                        for x in &xr[..rows] {
                            sink += f(n, wr, x);
                        }
                    }
                });
                line += &format!(" | fallback x{rows} {:6.2}", gbs(fb, rows));
            }
            if let Some(g) = dot_rows_fn(ty, isa) {
                for rows in ROWS_BENCH {
                    if let Ok(only) = std::env::var("STRATA_BENCH_ROWS") {
                        if only.parse() != Ok(rows) {
                            continue;
                        }
                    }
                    let mut out = [0f32; 8];
                    let t = time_per_run(BENCH_SECS, || {
                        for wr in w.chunks_exact(rb) {
                            g(n, wr, &xr[..rows], &mut out[..rows]);
                            sink += out[0];
                        }
                    });
                    line += &format!(" | rows x{rows} {:6.2}", gbs(t, rows));
                }
            }
            eprintln!("{line}  GB/s ({sink:e})");
        }
    }
}
