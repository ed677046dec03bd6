//! `strata parity`: the A/B and parity harness (DESIGN.md §6) over the kernel catalogue.
//! Prints the report's markdown table per suite (or JSON) and exits with status 2 when any
//! pair or any backend-versus-CPU check fails.

use std::process::ExitCode;

use anyhow::{bail, Context};
use strata_parity::{BackendKind, Options, Suite};

use crate::outln;

#[derive(clap::Args)]
pub struct Args {
    /// mtp-ab | router-ab | sample | gemv | all
    pub suite: String,
    /// cpu | cuda | wgpu (adapter: STRATA_WGPU_ADAPTER, an index or part of its name)
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Rotate 16 copies of weights and tables so launches read from memory
    #[arg(long)]
    pub cold: bool,
    /// Fewer shapes, trials and repetitions (seconds on the CPU)
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of markdown
    #[arg(long)]
    pub json: bool,
    /// Timing samples per variant (default 31, quick 7)
    #[arg(long)]
    pub reps: Option<usize>,
    /// Fresh-input parity trials per shape (default 4, quick 2)
    #[arg(long)]
    pub trials: Option<usize>,
    /// Seed of the random inputs
    #[arg(long)]
    pub seed: Option<u64>,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Some(backend) = BackendKind::from_name(&a.backend) else {
        bail!(
            "unknown backend '{}': expected cpu, cuda or wgpu",
            a.backend
        );
    };
    let suites: Vec<Suite> = if a.suite == "all" {
        Suite::ALL.to_vec()
    } else {
        vec![Suite::from_name(&a.suite).with_context(|| {
            format!(
                "unknown suite '{}': expected mtp-ab, router-ab, sample, gemv or all",
                a.suite
            )
        })?]
    };
    let mut opts = Options::new(backend, a.quick, a.cold);
    if let Some(r) = a.reps {
        opts.reps = r.max(1);
    }
    if let Some(t) = a.trials {
        opts.trials = t.max(1);
    }
    if let Some(s) = a.seed {
        opts.seed = s;
    }
    let be = strata_parity::open(&opts)
        .with_context(|| format!("strata parity --backend {}", a.backend))?;
    let mut failed = false;
    let mut json = Vec::new();
    for s in suites {
        let rep = strata_parity::run_on(be.as_ref(), s, &opts)
            .with_context(|| format!("strata parity {} --backend {}", s.name(), a.backend))?;
        failed |= rep.failed();
        if a.json {
            json.push(rep.json());
        } else {
            outln!("{}", rep.markdown())?;
        }
    }
    if a.json {
        let v = if json.len() == 1 {
            json.remove(0)
        } else {
            serde_json::Value::Array(json)
        };
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    }
    if failed {
        eprintln!("strata parity: at least one parity check FAILED");
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}
