//! The speculative-decoding flags of `run` (`--mtp`, `--spec N`, `--spec-min-p`,
//! `--draft-vocab`), checked before the model is loaded.

use std::path::PathBuf;

use anyhow::{bail, Result};
use strata_engine::speculative::MAX_WINDOW;

use super::check_f32;

#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "MTP speculative decoding (qwen4exp)")]
pub struct SpecArgs {
    /// The MTP head GGUF (`strata convert-mtp`); a model file that carries `mtp.*` needs none
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp: Option<PathBuf>,
    /// Verify window N = 1..8 (up to N − 1 drafts per trunk pass; 1 is plain decoding);
    /// default 4 with a head
    #[arg(long = "spec", value_name = "N")]
    pub spec: Option<usize>,
    /// Draft floor in [0, 1]: end the draft chain at the first draft less likely than this
    /// (0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub spec_min_p: f32,
    /// Draft vocabulary: raw little-endian i32 token ids (`strata draft-vocab build`); the draft
    /// computes only those rows of the LM head (default: the full vocabulary)
    #[arg(long, value_name = "FILE")]
    pub draft_vocab: Option<PathBuf>,
}

/// What the speculative flags asked for, checked.
#[derive(Clone, Debug)]
pub struct SpecChoice {
    pub mtp: Option<PathBuf>,
    /// None: 4 with a head.
    pub window: Option<usize>,
    pub min_p: f32,
    pub draft_vocab: Option<PathBuf>,
}

impl SpecChoice {
    /// The window to run with, given whether the model has a head (checked at load).
    pub fn window(&self) -> usize {
        self.window.unwrap_or(4)
    }
}

impl SpecArgs {
    /// None when no flag asks for speculative decoding (`--spec 1` alone is plain decoding).
    pub fn resolve(&self) -> Result<Option<SpecChoice>> {
        if let Some(n) = self.spec {
            if !(1..=MAX_WINDOW).contains(&n) {
                bail!(
                    "--spec {n}: out of range; expected a verify window of 1 to {MAX_WINDOW} rows"
                );
            }
        }
        check_f32(
            "--spec-min-p",
            self.spec_min_p,
            |p| (0.0..=1.0).contains(&p),
            "a probability in [0, 1] (0: off)",
        )?;
        for (flag, p) in [("--mtp", &self.mtp), ("--draft-vocab", &self.draft_vocab)] {
            if let Some(p) = p {
                crate::output::check_input(flag, p)?;
            }
        }
        let wanted = self.mtp.is_some()
            || self.spec.is_some_and(|n| n > 1)
            || self.draft_vocab.is_some()
            || self.spec_min_p != 0.0;
        if !wanted {
            return Ok(None);
        }
        if self.spec == Some(1) && (self.draft_vocab.is_some() || self.spec_min_p != 0.0) {
            bail!("--draft-vocab and --spec-min-p shape the drafts, and --spec 1 makes none");
        }
        Ok(Some(SpecChoice {
            mtp: self.mtp.clone(),
            window: self.spec,
            min_p: self.spec_min_p,
            draft_vocab: self.draft_vocab.clone(),
        }))
    }
}
