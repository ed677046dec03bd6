//! The sampler flags beyond temperature / top-k / top-p / min-p / seed (which `run.rs`'s
//! `SampleArgs` holds): repetition, frequency and presence penalties, DRY, slop, and the order
//! of the chain; and the chain they describe, as the JSON form the server takes per request.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use strata_engine::sampler::dry::{self, DryParams};
use strata_engine::sampler::guard::{GuardStop, GuardedGeneration};
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{parse_list, ListChoice, SlopConfig};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_tokenizer::Tokenizer;

use crate::run::SampleArgs;

/// The default order of the chain (llama.cpp's names; `slop` is strata's).
pub const DEFAULT_ORDER: &str = "penalties;dry;slop;top_k;top_p;min_p;temperature";

#[derive(clap::Args, Clone, Debug)]
pub struct PenaltyArgs {
    /// Repetition penalty over the last --repeat-last-n tokens (1: off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over (-1: all, 0: off)
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub repeat_last_n: i64,
    /// Subtracted per occurrence in the window (0: off)
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Subtracted once for any occurrence in the window (0: off)
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// DRY strength (0: off)
    #[arg(long, default_value_t = 0.0)]
    pub dry_multiplier: f32,
    /// DRY growth per token of repeat past the allowed length
    #[arg(long, default_value_t = 1.75)]
    pub dry_base: f32,
    /// Longest repeat DRY leaves alone
    #[arg(long, default_value_t = 2)]
    pub dry_allowed_length: u32,
    /// Tokens DRY searches (-1: all, 0: off)
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub dry_penalty_last_n: i64,
    /// A DRY sequence breaker (repeatable; replaces the defaults "\n", ":", "\"", "*")
    #[arg(long, value_name = "TEXT")]
    pub dry_sequence_breaker: Vec<String>,
    /// Order of the chain, names separated by ';' or ',' (stages left out do not run)
    #[arg(long, value_name = "LIST", default_value = DEFAULT_ORDER)]
    pub samplers: String,
    /// Slop penalties: 0 off, 1 token level (penalties and newline/blank run caps), 2 phrase
    /// level with rewinds (no listed phrase is ever written). Default: 0, or 2 when
    /// --slop-phrase or --slop-list is given
    #[arg(long, value_name = "0|1|2")]
    pub slop_mode: Option<u8>,
    /// A slop list replacing the built-in one: one `"phrase" penalty` per line (see
    /// crates/engine/data/slop.txt); `none` for no list (only --slop-phrase), `default` for
    /// the built-in one
    #[arg(long, value_name = "FILE")]
    pub slop_list: Option<PathBuf>,
    /// A phrase banned outright (repeatable), on top of the list
    #[arg(long, value_name = "TEXT")]
    pub slop_phrase: Vec<String>,
    /// Longest run of newline tokens under slop (0: no cap)
    #[arg(long, default_value_t = 3)]
    pub slop_newline_run: u32,
    /// Longest run of blank (whitespace-only) tokens under slop (0: no cap)
    #[arg(long, default_value_t = 4)]
    pub slop_blank_run: u32,
    /// Most phrase rewinds per reply under slop mode 2; past it the reply ends before the phrase
    #[arg(long, default_value_t = 64)]
    pub slop_max_rewinds: u32,
}

impl PenaltyArgs {
    fn slop(&self) -> Result<SlopConfig> {
        let mode = match self.slop_mode {
            Some(m) => m,
            None if self.slop_list.is_some() || !self.slop_phrase.is_empty() => 2,
            None => 0,
        };
        let (list, entries) = match &self.slop_list {
            Some(p) if p.as_os_str() == "none" => (ListChoice::None, Vec::new()),
            Some(p) if p.as_os_str() == "default" => (ListChoice::Default, Vec::new()),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading the slop list {}", p.display()))?;
                (
                    ListChoice::None,
                    parse_list(&text, &p.display().to_string())?,
                )
            }
            None => (ListChoice::Default, Vec::new()),
        };
        let c = SlopConfig {
            mode,
            list,
            entries,
            ban: self.slop_phrase.clone(),
            newline_run_cap: self.slop_newline_run,
            blank_run_cap: self.slop_blank_run,
            max_rewinds: self.slop_max_rewinds,
        };
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(c)
    }
}

impl SampleArgs {
    /// The chain the flags describe, in `--samplers` order, without the stages whose settings
    /// make them no-ops; `--sampler JSON` replaces it all. A temperature ≤ 0 is greedy: the
    /// filters and temperature go, the logit edits (penalties, DRY, slop) stay.
    pub fn config(&self) -> Result<SamplerConfig> {
        if let Some(json) = &self.sampler {
            return Ok(SamplerConfig::from_json(json)?);
        }
        let x = &self.extra;
        let greedy = self.temp <= 0.0;
        let mut stages = Vec::new();
        for name in x
            .samplers
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let stage = match name {
                "penalties" => Some(Stage::Penalties(PenaltyParams {
                    last_n: x.repeat_last_n,
                    repeat: x.repeat_penalty,
                    frequency: x.frequency_penalty,
                    presence: x.presence_penalty,
                }))
                .filter(|s| !matches!(s, Stage::Penalties(p) if p.is_neutral())),
                "dry" => Some(Stage::Dry(DryParams {
                    multiplier: x.dry_multiplier,
                    base: x.dry_base,
                    allowed_length: x.dry_allowed_length,
                    last_n: x.dry_penalty_last_n,
                    sequence_breakers: if x.dry_sequence_breaker.is_empty() {
                        dry::default_breakers()
                    } else {
                        x.dry_sequence_breaker.clone()
                    },
                }))
                .filter(|s| !matches!(s, Stage::Dry(p) if p.is_neutral())),
                "slop" => Some(Stage::Slop(x.slop()?))
                    .filter(|s| !matches!(s, Stage::Slop(c) if c.mode == 0)),
                "top_k" => (!greedy && self.top_k > 0).then_some(Stage::TopK { k: self.top_k }),
                "top_p" => (!greedy && self.top_p < 1.0).then_some(Stage::TopP {
                    p: self.top_p,
                    min_keep: 1,
                }),
                "min_p" => (!greedy && self.min_p > 0.0).then_some(Stage::MinP {
                    p: self.min_p,
                    min_keep: 1,
                }),
                "temperature" => {
                    (!greedy && self.temp != 1.0).then_some(Stage::Temperature { t: self.temp })
                }
                other => bail!(
                    "--samplers: unknown stage {other:?}; expected names from {DEFAULT_ORDER}"
                ),
            };
            if let Some(s) = stage {
                if stages.contains(&s) {
                    bail!("--samplers names {name:?} twice");
                }
                stages.push(s);
            }
        }
        let pick = if greedy {
            Pick::Greedy
        } else {
            Pick::Draw {
                seed: self.seed.unwrap_or_else(crate::run::clock_seed),
            }
        };
        let c = SamplerConfig { stages, pick };
        c.validate()?;
        Ok(c)
    }

    /// The sampler, bound to the model's vocabulary (DRY breakers, slop phrases and classes).
    pub fn build_for(&self, tok: &Tokenizer) -> Result<Sampler> {
        let c = self.config()?;
        Sampler::with_vocab(c, tok).context("building the sampler")
    }
}

/// The `--verbose` line about slop's phrase level, when it acted.
pub fn report_slop(g: &GuardedGeneration) {
    match g.stop {
        GuardStop::RewindBudget => eprintln!(
            "slop: {} rewinds; the rewind budget ran out, the reply ends before a listed phrase",
            g.rewinds
        ),
        GuardStop::DeadEnd => eprintln!(
            "slop: {} rewinds; every continuation was banned, the reply ends there",
            g.rewinds
        ),
        GuardStop::Plain(_) if g.rewinds > 0 => eprintln!("slop: {} rewinds", g.rewinds),
        GuardStop::Plain(_) => {}
    }
}
