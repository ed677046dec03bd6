//! `strata synth`: writes a synthetic qwen4exp GGUF (random valid blocks in the public Q2_0
//! release's mix, full size or scaled) with strata-synth, so anyone can measure without the
//! 35 GB download. This module only turns arguments into options and reports progress.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use strata_synth::{Options, Plan, Sink, WriteOptions};

#[derive(clap::Args)]
pub struct Args {
    /// Output file (refused if it exists, unless --force), or a device such as /dev/null to
    /// time the generator without a disk
    #[arg(long, value_name = "FILE.gguf", required_unless_present = "dry_run")]
    pub out: Option<PathBuf>,
    /// Layers (layer i is QSA attention when i % 4 == 3, else Gated DeltaNet)
    #[arg(long, default_value_t = 48)]
    pub layers: usize,
    /// Routed experts per layer
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    /// Experts per token (capped at --experts)
    #[arg(long, default_value_t = 10)]
    pub expert_used: usize,
    /// Also write an MTP head at the real geometry, as a separate `qwen4exp_mtp` file beside
    /// the trunk (FILE-mtp.gguf; attach it with --mtp)
    #[arg(long)]
    pub mtp: bool,
    /// PLE n-gram table rows per head (the real table has ~20,000,000; 0 = no PLE block); the
    /// per-token PLE work does not depend on it, only its cache locality
    #[arg(long, default_value_t = 65_536)]
    pub ple_rows_per_head: u64,
    /// Vocabulary size (248,320 as the real model; fewer for small test files)
    #[arg(long, default_value_t = strata_synth::FULL_VOCAB)]
    pub vocab: usize,
    /// `context_length` written into the file
    #[arg(long, default_value_t = 262_144)]
    pub ctx: u32,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Random pool per block type, MiB (tensors are tiled from it)
    #[arg(long, default_value_t = 64)]
    pub pool_mib: usize,
    /// Replace an existing output file
    #[arg(long)]
    pub force: bool,
    /// Print the plan (sizes per type) and write nothing
    #[arg(long)]
    pub dry_run: bool,
    /// List every tensor with its shape and type
    #[arg(long)]
    pub print_tensors: bool,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn summary(what: &str, plan: &Plan, print_tensors: bool) {
    let mut by_type: Vec<(strata_gguf::GgmlType, usize, u64)> = Vec::new();
    for t in &plan.tensors {
        match by_type.iter_mut().find(|e| e.0 == t.ty) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.bytes();
            }
            None => by_type.push((t.ty, 1, t.bytes())),
        }
    }
    by_type.sort_by_key(|e| std::cmp::Reverse(e.2));
    eprintln!(
        "{what}: {} tensors, {:.2} B params, tensor data {:.2} GiB ({:.2} GB)",
        plan.tensors.len(),
        plan.params() as f64 / 1e9,
        gib(plan.data_bytes()),
        plan.data_bytes() as f64 / 1e9
    );
    for (ty, n, b) in by_type {
        eprintln!("  {:7} {n:5} tensors {:10.3} GiB", ty.name(), gib(b));
    }
    if print_tensors {
        for t in &plan.tensors {
            println!(
                "{:44} {:24} {:7} {:>14}",
                t.name,
                format!("{:?}", t.ne),
                t.ty.name(),
                t.bytes()
            );
        }
    }
}

/// `FILE.gguf` → `FILE-mtp.gguf`; a device sink stays the device.
fn mtp_path(out: &Path, device: bool) -> PathBuf {
    if device {
        return out.to_path_buf();
    }
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!("{stem}-mtp.gguf"))
}

fn write_one(what: &str, plan: &Plan, path: &Path, wo: &WriteOptions) -> Result<()> {
    let total = plan.data_bytes();
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let progress = |done: u64| {
        let ms = start.elapsed().as_millis() as u64;
        let prev = last.load(Ordering::Relaxed);
        if ms >= prev + 5000
            && last
                .compare_exchange(prev, ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            eprintln!(
                "  {what}: {:.2} / {:.2} GiB ({:.0} %), {:.0} MB/s",
                gib(done),
                gib(total),
                100.0 * done as f64 / total.max(1) as f64,
                done as f64 / 1e6 / start.elapsed().as_secs_f64()
            );
        }
    };
    let r = strata_synth::write(plan, path, wo, &progress)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "{what}: {} ({:.2} GB): pools {:.0} MiB in {:.2} s, data {:.2} GB in {:.2} s = {:.0} MB/s ({} threads, no fsync)",
        path.display(),
        r.file_len as f64 / 1e9,
        r.pool_bytes as f64 / (1 << 20) as f64,
        r.pool_seconds,
        r.data_bytes as f64 / 1e9,
        r.write_seconds,
        r.data_bytes as f64 / 1e6 / r.write_seconds.max(1e-9),
        rayon::current_num_threads()
    );
    Ok(())
}

pub fn run(a: Args) -> Result<ExitCode> {
    let o = Options {
        layers: a.layers,
        experts: a.experts,
        expert_used: a.expert_used,
        ple_rows_per_head: a.ple_rows_per_head,
        seed: a.seed,
        vocab: a.vocab,
        ctx: a.ctx,
    };
    let trunk = strata_synth::trunk_plan(&o)?;
    let mtp = if a.mtp {
        Some(strata_synth::mtp_plan(&o)?)
    } else {
        None
    };
    summary("trunk", &trunk, a.print_tensors);
    if let Some(m) = &mtp {
        summary("MTP head", m, a.print_tensors);
    }
    let Some(out) = a.out.filter(|_| !a.dry_run) else {
        return Ok(ExitCode::SUCCESS);
    };
    if a.pool_mib == 0 {
        anyhow::bail!("--pool-mib must be greater than zero");
    }
    let device = std::fs::metadata(&out).is_ok_and(|m| !m.is_file() && !m.is_dir());
    let wo = WriteOptions {
        seed: a.seed,
        pool_bytes: a.pool_mib << 20,
        sink: if device {
            Sink::Device
        } else {
            Sink::File { overwrite: a.force }
        },
        ..WriteOptions::default()
    };
    // Both outputs are checked before either is written.
    let mtp_out = mtp_path(&out, device);
    if mtp.is_some() && !device && !a.force && mtp_out.exists() {
        anyhow::bail!("{} exists; pass --force to replace it", mtp_out.display());
    }
    write_one("trunk", &trunk, &out, &wo)?;
    if let Some(m) = &mtp {
        write_one("MTP head", m, &mtp_out, &wo)?;
    }
    Ok(ExitCode::SUCCESS)
}
