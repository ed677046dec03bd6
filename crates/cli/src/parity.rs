//! `strata parity`: the A/B and parity harness (DESIGN.md §6) over the kernel catalogue.
//! Prints the report's markdown table per suite (or JSON) and exits with status 2 when any
//! pair or any backend-versus-CPU check fails.

use std::process::ExitCode;

use anyhow::{bail, Context};
use strata_parity::{BackendKind, Options, Suite};

use crate::outln;

#[derive(clap::Args)]
pub struct Args {
    /// mtp-ab | router-ab | sample | gemv | all (kernels), prompt | verify (a whole model:
    /// prefill and verify windows against single steps, bitwise), or ops (a model's
    /// overridable operations against their default compositions on the same backend)
    pub suite: String,
    /// cpu | cuda | wgpu (adapter: STRATA_WGPU_ADAPTER, an index or part of its name)
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// The model of the prompt and verify suites (default: the default model)
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: Option<std::path::PathBuf>,
    /// The CUDA device or wgpu adapter of the prompt and verify suites
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: usize,
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
    if MODEL_SUITES.contains(&a.suite.as_str()) {
        return run_model(a);
    }
    if a.model.is_some() {
        bail!(
            "-m is for the prompt, verify and ops suites; '{}' runs the kernel catalogue",
            a.suite
        );
    }
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
                "unknown suite '{}': expected mtp-ab, router-ab, sample, gemv, all, prompt, verify or ops",
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

/// The suites that run on a loaded model.
const MODEL_SUITES: [&str; 3] = ["prompt", "verify", "ops"];

/// The model suites (`prompt`, `verify`, `ops`): the model loaded on the backend asked for, the
/// suite run, the report printed; status 2 when a row is not bitwise.
fn run_model(a: Args) -> anyhow::Result<ExitCode> {
    use crate::args::backend::{BackendChoice, BackendKind as Kind};
    let kind = match a.backend.as_str() {
        "cpu" => Kind::Cpu,
        "cuda" => Kind::Cuda,
        "wgpu" => Kind::Wgpu,
        "auto" => Kind::Auto,
        b => bail!("unknown backend '{b}': expected cpu, cuda, wgpu or auto"),
    };
    if a.cold {
        bail!(
            "--cold rotates kernel weights; the {} suite runs a whole model",
            a.suite
        );
    }
    let path = match &a.model {
        Some(p) => {
            crate::output::check_input("-m", p)?;
            p.clone()
        }
        None => crate::model_cache::default_model_path(true)?,
    };
    // The prompt and verify suites measure the determinism contract: the exact prefill.
    let choice = BackendChoice {
        kind,
        device: a.device,
        prefill: Some(crate::args::backend::PrefillMode::Exact),
    };
    let opened = crate::load::open(&path)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let loaded = crate::load::Loaded::bind(
        &opened,
        &path,
        threads,
        strata_engine::backend::KvType::default(),
        None,
        Some(if a.quick { 256 } else { 1024 }),
        &choice,
    )?;
    let seed = a.seed.unwrap_or(1);
    let mut rep = strata_parity::Report {
        suite: a.suite.clone(),
        backend: loaded.backend_name().to_string(),
        device: format!("{} ({})", path.display(), loaded.backend_note),
        ..Default::default()
    };
    let (n, prefix) = if a.quick { (24, 11) } else { (96, 37) };
    let suite = a.suite.as_str();
    crate::load::each_model!(&loaded.model, m => {
        match suite {
            "prompt" => crate::parity_model::prompt_suite(m.as_ref(), n, seed, &mut rep)?,
            "verify" => crate::parity_model::verify_suite(m.as_ref(), prefix, seed, &mut rep)?,
            _ => crate::parity_model::OpsSuite::ops_suite(m.as_ref(), seed, &mut rep)?,
        }
    });
    if suite != "ops" {
        rep.notes.push(
            "baseline: the same tokens as single steps from a fresh state (the oracle); \
             candidate: the call under test; times are wall clock of one run each"
                .to_string(),
        );
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&rep.json())?)?;
    } else {
        outln!("{}", rep.markdown())?;
    }
    if rep.failed() {
        eprintln!("strata parity: at least one parity check FAILED");
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}
