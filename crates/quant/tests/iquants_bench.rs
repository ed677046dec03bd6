//! Throughput of the I-quant dot kernels, in GB/s of weight bytes on one core. Ignored by
//! default (a measurement, not a check); run with
//! `cargo test --release -p strata-quant --test iquants_bench -- --ignored --nocapture` (best of
//! three wall-clock runs: run it on a quiet machine)
//! (`STRATA_BENCH_TYPES=IQ4_XS,IQ3_S` and `STRATA_BENCH_ISAS=avx2,avx512` narrow it down).

use std::time::Instant;

use strata_quant::{GgmlType, Isa};

const TYPES: [GgmlType; 8] = [
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ2_XXS,
    GgmlType::IQ1_M,
    GgmlType::IQ1_S,
];

/// A deterministic byte stream (xorshift), so runs are comparable.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

#[test]
#[ignore = "benchmark"]
fn dot_throughput() {
    let n = 4096;
    let only = std::env::var("STRATA_BENCH_TYPES").unwrap_or_default();
    for ty in TYPES {
        if !only.is_empty() && !only.split(',').any(|t| t.eq_ignore_ascii_case(ty.name())) {
            continue;
        }
        let rb = ty.row_bytes(n).unwrap();
        for (label, total) in [("L2", 192 << 10), ("mem", 64 << 20)] {
            let rows = (total / rb).max(1);
            let mut w = bytes(rows * rb, 7);
            let ts = ty.type_size();
            for b in 0..w.len() / ts {
                // A finite f16 scale (IQ1_M keeps its scale in the top nibbles: any value is
                // fine for timing).
                if ty != GgmlType::IQ1_M {
                    w[b * ts..b * ts + 2].copy_from_slice(&0x2c00u16.to_le_bytes());
                }
            }
            let src: Vec<f32> = bytes(n, 3).iter().map(|&b| b as f32 / 64.0 - 2.0).collect();
            let mut x = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
            strata_quant::quantize(GgmlType::Q8_K, &src, &mut x).unwrap();
            let mut line = format!("{:8} {:4} ", ty.name(), label);
            let isas = std::env::var("STRATA_BENCH_ISAS").unwrap_or_default();
            for isa in Isa::ALL {
                if !strata_quant::simd::supported(isa)
                    || !(isas.is_empty() || isas.split(',').any(|i| i == isa.name()))
                {
                    continue;
                }
                let f = strata_quant::dot_fn(ty, isa).unwrap();
                // Best of three wall-clock runs of ~256 MB each (thread CPU time from
                // schedstat advances in scheduler ticks, too coarse for runs this short).
                let reps = ((256usize << 20) / (rows * rb)).max(1);
                let mut sink = 0f32;
                let mut s = f64::INFINITY;
                for _ in 0..3 {
                    let wall = Instant::now();
                    for _ in 0..reps {
                        for r in 0..rows {
                            sink += f(n, &w[r * rb..(r + 1) * rb], &x);
                        }
                    }
                    s = s.min(wall.elapsed().as_secs_f64());
                }
                std::hint::black_box(sink);
                let gbs = (reps * rows * rb) as f64 / s / 1e9;
                line += &format!(" {}={gbs:6.2} GB/s", isa.name());
            }
            println!("{line}");
        }
    }
}
