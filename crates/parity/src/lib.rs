//! strata-parity: the A/B and parity harness (DESIGN.md §6). For each kernel and shape it runs
//! the baseline and the candidate (optimized) variant on the same fresh random inputs (−0.0,
//! denormals and large magnitudes included), checks them bit for bit, checks the backend
//! against the CPU reference within the kernel's stated tolerance, and times the pair
//! interleaved (A B, B A, …) with medians. GPU timing uses device events around captured
//! graphs of repeated launches; `--cold` rotates 16 copies of the weights so each launch reads
//! them from memory. The report renders as the kernel report's markdown table or as JSON.
//!
//! The suites: `mtp-ab` (rms_xprep, combine_gnorm, xprep, embed × 13 formats, slop_pen ×
//! modes × vocabulary sizes, pick), `router-ab` (route 512/10 and 256/8 × nt 1..8, and the
//! router-gate GEMV), `sample` (slop_pen, pick) and `gemv` (9 formats × 1–8 rows).
//!
//! The suites are written once ([`suites`]) against [`backend::KernelBackend`]; the CPU
//! ([`cpu`]), CUDA ([`cuda`]) and wgpu ([`wgpu`]) backends implement it.

pub mod backend;
pub mod check;
pub mod cpu;
pub mod cuda;
pub mod stats;
pub mod suites;
pub mod wgpu;

use std::fmt::Write;

/// A suite of kernel pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    MtpAb,
    RouterAb,
    Sample,
    Gemv,
}

impl Suite {
    pub const ALL: [Suite; 4] = [Suite::MtpAb, Suite::RouterAb, Suite::Sample, Suite::Gemv];

    pub fn name(self) -> &'static str {
        match self {
            Suite::MtpAb => "mtp-ab",
            Suite::RouterAb => "router-ab",
            Suite::Sample => "sample",
            Suite::Gemv => "gemv",
        }
    }

    pub fn from_name(s: &str) -> Option<Suite> {
        Suite::ALL.into_iter().find(|x| x.name() == s)
    }
}

/// Where the pairs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
    Wgpu,
}

impl BackendKind {
    pub fn from_name(s: &str) -> Option<BackendKind> {
        match s {
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            "wgpu" => Some(BackendKind::Wgpu),
            _ => None,
        }
    }
}

/// Harness options.
#[derive(Clone, Debug)]
pub struct Options {
    pub backend: BackendKind,
    /// Rotate 16 copies of large inputs (weights, tables) so launches read from memory.
    pub cold: bool,
    /// Fewer shapes, trials and repetitions (the CPU suites finish in seconds; CI runs this).
    pub quick: bool,
    /// Fresh-input trials per shape for the parity checks.
    pub trials: usize,
    /// Timing samples per variant (each a median input).
    pub reps: usize,
    pub seed: u64,
}

impl Options {
    pub fn new(backend: BackendKind, quick: bool, cold: bool) -> Options {
        Options {
            backend,
            cold,
            quick,
            trials: if quick { 2 } else { 4 },
            reps: if quick { 7 } else { 31 },
            seed: 0x5eed_2026,
        }
    }
}

/// One row of a report.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub kernel: String,
    pub shape: String,
    pub base_us: f64,
    pub cand_us: f64,
    /// `BITWISE PASS`, or `FAIL: ...` naming the first differing element.
    pub parity: String,
    /// Agreement with the CPU reference (CUDA rows): `exact`, `within ...`, or `FAIL: ...`.
    pub vs_cpu: String,
    /// Bytes a launch must move (inputs read once, outputs written once).
    pub bytes: f64,
    /// The row's floor: bytes over measured bandwidth, or the launch floor, the larger.
    pub floor_us: f64,
    pub failed: bool,
    /// FNV-1a of the optimized variant's outputs on the first trial: equal digests on two
    /// adapters (same seed and shapes) mean the same bits there.
    pub digest: String,
}

impl Row {
    pub fn ratio(&self) -> f64 {
        self.cand_us / self.base_us
    }
}

/// A suite's results.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub suite: String,
    pub backend: String,
    pub device: String,
    /// Measured device bandwidth (GB/s) and launch floor (µs), CUDA only.
    pub bandwidth_gbs: f64,
    pub launch_us: f64,
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn failed(&self) -> bool {
        self.rows.iter().any(|r| r.failed)
    }

    /// The report's markdown table.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### strata parity {} ({} backend: {})\n",
            self.suite, self.backend, self.device
        );
        for n in &self.notes {
            let _ = writeln!(s, "- {n}");
        }
        if !self.notes.is_empty() {
            s.push('\n');
        }
        let gpu = self.backend != "cpu";
        if gpu {
            s.push_str("| Kernel | Shape | Baseline (us) | Candidate (us) | Ratio | Delta | Parity | vs CPU | Floor (us) | Cand/floor |\n");
            s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        } else {
            s.push_str(
                "| Kernel | Shape | Baseline (us) | Candidate (us) | Ratio | Delta | Parity |\n",
            );
            s.push_str("|---|---|---|---|---|---|---|\n");
        }
        for r in &self.rows {
            let _ = write!(
                s,
                "| `{}` | `{}` | {:.3} | {:.3} | {:.4} | {:+.2}% | {} |",
                r.kernel,
                r.shape,
                r.base_us,
                r.cand_us,
                r.ratio(),
                (r.ratio() - 1.0) * 100.0,
                r.parity
            );
            if gpu {
                if r.floor_us > 0.0 {
                    let _ = write!(
                        s,
                        " {} | {:.3} | {:.2} |",
                        r.vs_cpu,
                        r.floor_us,
                        r.cand_us / r.floor_us
                    );
                } else {
                    let _ = write!(s, " {} | - | - |", r.vs_cpu);
                }
            }
            s.push('\n');
        }
        s
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "suite": self.suite,
            "backend": self.backend,
            "device": self.device,
            "bandwidth_gbs": self.bandwidth_gbs,
            "launch_us": self.launch_us,
            "notes": self.notes,
            "failed": self.failed(),
            "rows": self.rows.iter().map(|r| serde_json::json!({
                "kernel": r.kernel,
                "shape": r.shape,
                "baseline_us": r.base_us,
                "candidate_us": r.cand_us,
                "ratio": r.ratio(),
                "delta_pct": (r.ratio() - 1.0) * 100.0,
                "parity": r.parity,
                "vs_cpu": r.vs_cpu,
                "bytes": r.bytes,
                "floor_us": r.floor_us,
                "failed": r.failed,
                "digest": r.digest,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Errors that stop a suite (a parity failure is a result, not an error).
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error(transparent)]
    Kernel(#[from] strata_engine::kernels::KernelError),
    #[error(transparent)]
    Cuda(#[from] strata_cuda::CudaError),
    #[error(transparent)]
    Wgpu(#[from] strata_wgpu::WgpuError),
    #[error("{0}")]
    Other(String),
}

/// Opens the backend `opts.backend` names.
pub fn open(opts: &Options) -> Result<Box<dyn backend::KernelBackend>, ParityError> {
    Ok(match opts.backend {
        BackendKind::Cpu => Box::new(cpu::CpuBackend),
        BackendKind::Cuda => Box::new(cuda::CudaBackend::new(opts)?),
        BackendKind::Wgpu => Box::new(wgpu::WgpuBackend::new()?),
    })
}

/// Runs one suite on an open backend.
pub fn run_on(
    be: &dyn backend::KernelBackend,
    suite: Suite,
    opts: &Options,
) -> Result<Report, ParityError> {
    suites::run(be, suite, opts)
}

/// Opens the backend and runs one suite.
pub fn run(suite: Suite, opts: &Options) -> Result<Report, ParityError> {
    let be = open(opts)?;
    suites::run(be.as_ref(), suite, opts)
}
