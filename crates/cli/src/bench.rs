//! `strata bench`: throughput programs. `strata bench formats` measures dequantize and dot
//! throughput per block format, on one thread and on all threads, beside the machine's measured
//! memory bandwidth — the numbers to hold against ggml's `test-quantize-perf` on the same machine;
//! `strata bench spec` (bench/spec.rs) the speculative speed-up curve.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rayon::prelude::*;
use serde_json::json;
use strata_quant::{simd, synth, GgmlType, Isa};

use crate::outln;

mod spec;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand)]
pub enum What {
    /// Dequantize and dot-product throughput of every block format
    Formats(FormatsArgs),
    /// MTP speculative decoding: tokens/s with and without drafts, window cost, forced acceptance
    Spec(spec::BenchArgs),
    /// Model throughput in llama-bench's terms: prompt (pp) and decode (tg) tokens/s at depths
    Model(crate::bench_model::Args),
}

#[derive(clap::Args)]
pub struct FormatsArgs {
    /// Only these types (comma-separated, e.g. q4_k,q8_0); default all weight types
    #[arg(long, value_delimiter = ',')]
    pub types: Vec<String>,
    /// Elements per test, as ggml's test-quantize-perf: l1 = 4096, l2 = 65536, l3 = 655360,
    /// mem = 65536000 (comma-separated)
    #[arg(long, value_delimiter = ',', default_values_t = vec!["l1".to_string(), "mem".to_string()])]
    pub sizes: Vec<String>,
    /// ISA for the dot products (scalar, avx2, avx512); default the best this CPU has
    #[arg(long)]
    pub isa: Option<String>,
    /// Minimum measuring time per cell, in milliseconds
    #[arg(long, default_value_t = 300)]
    pub min_ms: u64,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.what {
        What::Formats(a) => formats(a),
        What::Spec(a) => spec::bench(a),
        What::Model(a) => crate::bench_model::run(a),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Best time of repeated runs of `f` over at least `min` of wall time (ggml reports the minimum).
fn best_time(min: Duration, mut f: impl FnMut() -> f32) -> Duration {
    let mut sink = 0f32;
    for _ in 0..2 {
        sink += f();
    }
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut iters = 0;
    while start.elapsed() < min || iters < 3 {
        let t = Instant::now();
        sink += f();
        best = best.min(t.elapsed());
        iters += 1;
    }
    std::hint::black_box(sink);
    best
}

/// Read bandwidth of this machine: a sum over 1 GiB of u64, one thread and all threads.
fn memory_bandwidth(min: Duration) -> (f64, f64) {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let one = best_time(min, || {
        buf.iter().fold(0u64, |a, &b| a.wrapping_add(b)) as f32
    });
    let all = best_time(min, || {
        buf.par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, |a, b| a.wrapping_add(b)) as f32
    });
    let bytes = (n * 8) as f64;
    (
        bytes / one.as_secs_f64() / GIB,
        bytes / all.as_secs_f64() / GIB,
    )
}

fn size_elems(name: &str) -> anyhow::Result<usize> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "l1" => 32 * 128,
        "l2" => 32 * 2048,
        "l3" => 32 * 20480,
        "mem" => 32 * 2_048_000,
        other => other
            .parse::<usize>()
            .with_context(|| format!("--sizes: '{other}' is not l1, l2, l3, mem or a count"))?,
    })
}

struct Cell {
    ty: GgmlType,
    size: usize,
    deq_1t: f64,
    deq_all: f64,
    dot_1t: Option<f64>,
    dot_all: Option<f64>,
}

fn formats(a: FormatsArgs) -> anyhow::Result<ExitCode> {
    let isa = match &a.isa {
        None => simd::best(),
        Some(s) => match Isa::ALL.iter().find(|i| i.name() == s.as_str()) {
            Some(i) if simd::supported(*i) => *i,
            Some(_) => bail!("--isa {s}: this CPU does not support it"),
            None => bail!("--isa {s}: expected scalar, avx2 or avx512"),
        },
    };
    let types: Vec<GgmlType> = if a.types.is_empty() {
        strata_quant::TYPES
            .iter()
            .map(|t| t.ty)
            .filter(|t| t.vec_dot_type().is_some())
            .collect()
    } else {
        a.types
            .iter()
            .map(|n| GgmlType::from_name(n).with_context(|| format!("--types: unknown type '{n}'")))
            .collect::<anyhow::Result<_>>()?
    };
    let sizes: Vec<usize> = a
        .sizes
        .iter()
        .map(|s| size_elems(s))
        .collect::<anyhow::Result<_>>()?;
    let min = Duration::from_millis(a.min_ms);
    let threads = rayon::current_num_threads();
    let (bw1, bw_all) = memory_bandwidth(min);

    let mut cells = Vec::new();
    for &ty in &types {
        let fns = strata_quant::format_fns(ty);
        if fns.dequantize.is_none() {
            eprintln!("{ty}: no dequantize yet, skipped");
            continue;
        }
        for &size in &sizes {
            let bs = ty.block_size();
            let n = size.div_ceil(bs) * bs;
            let w = synth::random_blocks(ty, n / bs, 1);
            let mut out = vec![0f32; n];
            let wbytes = w.len() as f64;
            let t1 = best_time(min, || {
                strata_quant::dequantize(ty, &w, &mut out).ok();
                out[0]
            });
            // All threads: rows of 4096 elements (or one block when blocks are larger).
            let row = 4096usize.max(bs).min(n);
            let rb = ty.row_bytes(row).context("row size")?;
            let tall = best_time(min, || {
                w.par_chunks(rb)
                    .zip(out.par_chunks_mut(row))
                    .for_each(|(src, dst)| {
                        strata_quant::dequantize(ty, src, dst).ok();
                    });
                out[0]
            });
            let (mut dot_1t, mut dot_all) = (None, None);
            if let (Some(xty), Some(dot)) = (ty.vec_dot_type(), strata_quant::dot_fn(ty, isa)) {
                if let Ok(x) = synth::random_activation(xty, n, 2) {
                    let t = best_time(min, || dot(n, &w, &x));
                    dot_1t = Some(wbytes / t.as_secs_f64() / GIB);
                    let xrb = xty.row_bytes(row).context("row size")?;
                    let t = best_time(min, || {
                        w.par_chunks(rb)
                            .zip(x.par_chunks(xrb))
                            .map(|(wr, xr)| dot(row, wr, xr))
                            .sum::<f32>()
                    });
                    dot_all = Some(wbytes / t.as_secs_f64() / GIB);
                }
            }
            cells.push(Cell {
                ty,
                size: n,
                deq_1t: wbytes / t1.as_secs_f64() / GIB,
                deq_all: wbytes / tall.as_secs_f64() / GIB,
                dot_1t,
                dot_all,
            });
        }
    }

    if a.json {
        let rows: Vec<_> = cells
            .iter()
            .map(|c| {
                json!({"type": c.ty.name(), "elements": c.size, "dequantize_gibps_1t": c.deq_1t,
                "dequantize_gibps_all": c.deq_all, "dot_gibps_1t": c.dot_1t, "dot_gibps_all": c.dot_all,
                "dot_simd": strata_quant::has_simd_dot(c.ty, isa)})
            })
            .collect();
        let doc = json!({"isa": isa.name(), "threads": threads, "memory_read_gibps_1t": bw1,
            "memory_read_gibps_all": bw_all, "unit": "GiB/s of quantized weight bytes", "formats": rows});
        outln!("{}", serde_json::to_string_pretty(&doc)?)?;
    } else {
        outln!(
            "# strata bench formats — ISA {}, {} threads",
            isa.name(),
            threads
        )?;
        outln!(
            "memory read bandwidth: {bw1:.1} GiB/s (1 thread), {bw_all:.1} GiB/s (all threads)"
        )?;
        outln!("throughput in GiB/s of quantized weight bytes (as ggml's test-quantize-perf)\n")?;
        outln!("| type | elements | dequant 1t | dequant all | dot 1t | dot all | dot kernel |")?;
        outln!("|---|---|---|---|---|---|---|")?;
        let f = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
        for c in &cells {
            outln!(
                "| {} | {} | {:.2} | {:.2} | {} | {} | {} |",
                c.ty,
                c.size,
                c.deq_1t,
                c.deq_all,
                f(c.dot_1t),
                f(c.dot_all),
                if strata_quant::has_simd_dot(c.ty, isa) {
                    isa.name()
                } else {
                    "scalar"
                }
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
