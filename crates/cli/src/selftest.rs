//! `strata selftest`: every parity suite on one backend, summed up in a few lines a user can
//! paste back (a Mac user with `--backend wgpu`, where no one on the project has run it): the
//! build and the machine, the adapter, per suite the rows that are bitwise equal to their
//! baseline and within their stated agreement with the CPU reference, a digest of the
//! optimized outputs (equal digests on two machines mean the same bits), and one verdict.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{bail, Context};
use strata_parity::{BackendKind, Options, Report, Suite};

use crate::outln;

#[derive(clap::Args)]
pub struct Args {
    /// cpu | cuda | wgpu (adapter: STRATA_WGPU_ADAPTER, an index or part of its name)
    #[arg(long, default_value = "wgpu")]
    pub backend: String,
    /// Every shape, trial and repetition instead of the quick set (minutes instead of seconds)
    #[arg(long)]
    pub full: bool,
}

/// FNV-1a over the rows' digests in order: one number per suite to compare across machines.
fn suite_digest(r: &Report) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for row in &r.rows {
        for b in row.digest.bytes().chain([b'\n']) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// The summary lines of one suite, and the rows that failed.
fn summarize(r: &Report) -> (String, Vec<String>) {
    let bitwise = r.rows.iter().filter(|x| x.parity == "BITWISE PASS").count();
    let failed: Vec<String> = r
        .rows
        .iter()
        .filter(|x| x.failed)
        .map(|x| {
            format!(
                "  FAILED {} {}: parity {}; vs CPU {}",
                x.kernel, x.shape, x.parity, x.vs_cpu
            )
        })
        .collect();
    let line = format!(
        "suite {:<9} {:>3} rows, {:>3} bitwise equal to their baseline, {} failed; digest {}",
        r.suite,
        r.rows.len(),
        bitwise,
        failed.len(),
        suite_digest(r)
    );
    (line, failed)
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Some(backend) = BackendKind::from_name(&a.backend) else {
        bail!(
            "unknown backend '{}': expected cpu, cuda or wgpu",
            a.backend
        );
    };
    let opts = Options::new(backend, !a.full, false);
    let be = strata_parity::open(&opts)
        .with_context(|| format!("strata selftest --backend {}", a.backend))?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "strata selftest {} ({} {}, {} mode, seed {})",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        std::env::consts::ARCH,
        if a.full { "full" } else { "quick" },
        opts.seed
    );
    let mut failures = Vec::new();
    let mut rows = 0;
    let mut device = String::new();
    for s in Suite::ALL {
        let rep = strata_parity::run_on(be.as_ref(), s, &opts)
            .with_context(|| format!("strata selftest: suite {}", s.name()))?;
        if device.is_empty() {
            device = format!("{} backend: {}", rep.backend, rep.device);
            let _ = writeln!(out, "{device}");
        }
        let (line, failed) = summarize(&rep);
        let _ = writeln!(out, "{line}");
        rows += rep.rows.len();
        failures.extend(failed);
    }
    for f in &failures {
        let _ = writeln!(out, "{f}");
    }
    if failures.is_empty() {
        let _ = write!(
            out,
            "VERDICT: PASS — all {rows} rows bitwise equal to their baseline and within their \
             stated agreement with the CPU reference"
        );
    } else {
        let _ = write!(
            out,
            "VERDICT: FAIL — {} of {rows} rows failed (listed above)",
            failures.len()
        );
    }
    outln!("{out}")?;
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}
