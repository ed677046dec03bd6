//! The arguments the commands share, parsed by clap and validated once: each group has a
//! `resolve()` that checks every value (naming the flag, the value and its range) and returns a
//! plain config (`ThreadsArgs` is the thread count alone, for commands without `ModelArgs`).
//! Commands depend on this module and on the support modules (`load`, `output`,
//! `model_cache`), never on each other. The ranges are documented in docs/SAMPLING.md.

pub mod backend;
pub mod model;
pub mod sampling;
pub mod spec;

use anyhow::{bail, Result};

/// Refuses `v` (naming `flag` and the `range` it must lie in) unless `ok(v)`; NaN never passes
/// since every `ok` is a comparison.
pub fn check_f32(flag: &str, v: f32, ok: impl Fn(f32) -> bool, range: &str) -> Result<()> {
    if !v.is_nan() && ok(v) {
        return Ok(());
    }
    bail!("{flag} {v}: out of range; expected {range}")
}

pub fn check_i64(flag: &str, v: i64, lo: i64, range: &str) -> Result<()> {
    if v >= lo {
        return Ok(());
    }
    bail!("{flag} {v}: out of range; expected {range}")
}

/// The worker-thread count, as `model`, `logits` and `bench spec` take it.
#[derive(clap::Args, Clone, Debug)]
pub struct ThreadsArgs {
    /// Worker threads (0: one per core; more than the cores is capped at the cores, with a
    /// warning)
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
}

impl ThreadsArgs {
    pub fn resolve(&self) -> usize {
        threads("--threads", self.threads)
    }
}

/// Worker threads: 0 is one per core; more than the cores this process may run on are capped
/// at that count with a warning (oversubscribed workers wait on each other at every operation:
/// `--threads 1000` made a token 500 times slower).
pub fn threads(flag: &str, requested: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if requested > cores {
        eprintln!(
            "warning: {flag} {requested}: this machine runs {cores} threads at once; using {cores}"
        );
        return cores;
    }
    requested
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_errors_name_flag_value_and_range() {
        let e = check_f32("--top-p", f32::NAN, |p| p > 0.0 && p <= 1.0, "(0, 1]").unwrap_err();
        assert_eq!(e.to_string(), "--top-p NaN: out of range; expected (0, 1]");
        assert!(check_f32("--top-p", 1.0, |p| p > 0.0 && p <= 1.0, "(0, 1]").is_ok());
        let e = check_i64("--repeat-last-n", -2, -1, "-1 (all), 0 (off) or a count").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--repeat-last-n -2: out of range"),
            "{e}"
        );
    }

    #[test]
    fn threads_are_capped_at_the_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads("-t", 0), 0);
        assert_eq!(threads("-t", cores), cores);
        assert_eq!(threads("-t", cores + 1000), cores);
    }
}
